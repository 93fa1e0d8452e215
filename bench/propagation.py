"""Benchmark: how long a published version takes to reach a rollout-side tracker over a real NATS.

An embedded nats-server; a ``VersionPublisher`` (no engines) on one connection and a ``VersionTracker`` on
another. Each round publishes the next version (a JetStream publish acknowledged by the server, with the
fence check) and waits until the tracker holds it. Two figures per round: ``ack`` (the trainer's publish
call, claim check included) and ``observe`` (from just before the publish call until the tracker's
``current`` changed). Side by side, the old approach: one HTTP ``GET /model_info`` round trip to a local
server, which a drain paid per group. Results go to stdout and ``bench/results/propagation.json``.

Usage: python bench/propagation.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from weightbus.bus import EmbeddedNats, connect
from weightbus.consumers import VersionTracker
from weightbus.producers import VersionPublisher

RESULTS = Path(__file__).parent / "results" / "propagation.json"


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50_ms": 1000 * q[49], "p99_ms": 1000 * q[98], "max_ms": 1000 * ordered[-1], "n": len(ordered)}


async def _bus_rounds(rounds: int) -> tuple[list[float], list[float]]:
    acks: list[float] = []
    observed: list[float] = []
    with EmbeddedNats() as server:
        trainer_bus = await connect(server.url, name="bench-trainer")
        rollout_bus = await connect(server.url, name="bench-rollout")
        try:
            pub = await VersionPublisher(trainer_bus, "bench", trainer_id="bench").start()
            async with VersionTracker(rollout_bus, "bench", registry=CollectorRegistry()) as tracker:
                await tracker.wait_ready(10)
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    async with pub.update() as version:
                        pass
                    t1 = time.perf_counter()
                    await tracker.wait_for(version, 10)
                    t2 = time.perf_counter()
                    acks.append(t1 - t0)
                    observed.append(t2 - t0)
        finally:
            await trainer_bus.close()
            await rollout_bus.close()
    return acks, observed


class _ModelInfo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = b'{"weight_version": "10"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


def _http_rounds(rounds: int) -> list[float]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ModelInfo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    out: list[float] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.server_port}") as client:
            client.get("/model_info")
            for _ in range(rounds):
                t0 = time.perf_counter()
                int(client.get("/model_info").json()["weight_version"])
                out.append(time.perf_counter() - t0)
    finally:
        server.shutdown()
        server.server_close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    args = parser.parse_args()
    acks, observed = asyncio.run(_bus_rounds(args.rounds))
    http = _http_rounds(args.rounds)
    result = {
        "rounds": args.rounds,
        "publish_ack": _quantiles(acks),
        "publish_to_tracker": _quantiles(observed),
        "http_model_info_round_trip": _quantiles(http),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in ("publish_ack", "publish_to_tracker", "http_model_info_round_trip"):
        r = result[name]
        print(f"{name:28s} p50 {r['p50_ms']:7.3f} ms   p99 {r['p99_ms']:7.3f} ms   max {r['max_ms']:7.3f} ms")
    print("the tracker pays this once per version; the old approach paid an HTTP round trip per drained group")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
