"""Benchmark: the publisher's CPU per engine request, httpx against a bare HTTP/1.1 keep-alive client.

Why: ``bench/fleet.py`` finds weightbus's own control time at 256 engines about 100x its time at one, and every
phase of it scales with the number of requests. This measures what one request costs the client process, side by
side against the same fake SGLang fleet (``bench/fake_sglang.py``, one process, real HTTP): a ``GET /model_info``
(the read of every label, twice per update) and a ``POST /update_weight_version`` with its JSON body (the stamp),
each sent to every engine at once, rounds alternating between the two clients:

* ``httpx``: one ``httpx.AsyncClient`` per engine, as ``EngineFleet`` builds them (keep-alive, reused);
* ``keepalive``: weightbus's own lean client, one ``KeepAliveHttp`` per engine (what ``EngineFleet(urls)`` builds);
* ``weightbus``: the whole fleet path, ``SGLangClient`` over that ``KeepAliveHttp`` (encode, send, check, decode);
* ``bare``: a keep-alive connection per engine over asyncio streams, writing the request line and headers itself
  and reading a ``Content-Length`` body: the least any Python client can do per request, not a client weightbus
  ships (no TLS, redirects, chunked bodies or retries).

Figures are the process CPU (``time.process_time``) of a round divided by its requests, p50 over rounds.
Result: ``bench/results/http-client.json``.

Usage: python bench/http_client.py [--engines 64] [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from fleet import machine as describe_machine  # one description of the machine for every benchmark

from weightbus.engines.keepalive import KeepAliveHttp
from weightbus.engines.sglang import SGLangClient
from weightbus.process.eventloop import run as run_loop

RESULTS = Path(__file__).parent / "results" / "http-client.json"
FAKE = Path(__file__).parent / "fake_sglang.py"
ROUTES = ("model_info", "update_weight_version")


class BareConnection:
    """One keep-alive HTTP/1.1 connection to one engine (Content-Length bodies only)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> Any:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self._reader is not None
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nAccept: application/json\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self._writer.write(head.encode() + b"\r\n" + body)
        raw = await self._reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in raw.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return json.loads(await self._reader.readexactly(length))

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()


async def _run(ports: list[int], rounds: int) -> dict[str, Any]:
    engines = len(ports)
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") for port in ports]
    bare = [BareConnection(port) for port in ports]
    lean = [KeepAliveHttp(f"http://127.0.0.1:{port}") for port in ports]
    engines_ = [SGLangClient(k.url, http=k) for k in lean]
    stamp = {"new_version": "7", "abort_all_requests": False}
    body = json.dumps(stamp).encode()
    json_type = {"Content-Type": "application/json"}
    calls = {
        ("httpx", "model_info"): lambda: [c.get("/model_info") for c in clients],
        ("keepalive", "model_info"): lambda: [k.request("GET", "/model_info") for k in lean],
        ("weightbus", "model_info"): lambda: [e.model_info() for e in engines_],
        ("bare", "model_info"): lambda: [b.request("GET", "/model_info") for b in bare],
        ("httpx", "update_weight_version"): lambda: [c.post("/update_weight_version", json=stamp) for c in clients],
        ("keepalive", "update_weight_version"): lambda: [
            k.request("POST", "/update_weight_version", content=body, headers=json_type) for k in lean
        ],
        ("weightbus", "update_weight_version"): lambda: [e.update_weight_version("7") for e in engines_],
        ("bare", "update_weight_version"): lambda: [b.request("POST", "/update_weight_version", body) for b in bare],
    }
    for make in calls.values():  # warm-up: every connection open
        await asyncio.gather(*make())
    cpu: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, make in calls.items():
            start = time.process_time()
            await asyncio.gather(*make())
            cpu[key].append((time.process_time() - start) / engines * 1e6)
    for client in clients:
        await client.aclose()
    for conn in bare:
        await conn.aclose()
    for k in lean:
        await k.aclose()
    p50 = {f"{client}/{route}": statistics.median(values) for (client, route), values in cpu.items()}
    return {
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "cpu_model": describe_machine()["cpu_model"],
            "python": platform.python_version(),
        },
        "httpx": httpx.__version__,
        "engines": engines,
        "rounds": rounds,
        "client_cpu_us_per_request_p50": p50,
        "ratio_over_bare": {
            f"{client}/{route}": p50[f"{client}/{route}"] / p50[f"bare/{route}"]
            for client in ("httpx", "keepalive", "weightbus")
            for route in ROUTES
        },
        "ratio_httpx_over_weightbus": {route: p50[f"httpx/{route}"] / p50[f"weightbus/{route}"] for route in ROUTES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    fake = subprocess.Popen(
        [sys.executable, str(FAKE), "--engines", str(args.engines)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake.stdout is not None
        result = run_loop(_run(json.loads(fake.stdout.readline())["ports"], args.rounds))
    finally:
        if fake.stdin is not None:
            fake.stdin.close()
        fake.wait(timeout=30)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result["client_cpu_us_per_request_p50"].items():
        print(f"{key:32s} {value:8.1f} µs CPU per request (p50)")
    for key, ratio in result["ratio_over_bare"].items():
        print(f"{key} / bare: {ratio:.1f}x")
    for route, ratio in result["ratio_httpx_over_weightbus"].items():
        print(f"httpx / weightbus, {route}: {ratio:.1f}x")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
