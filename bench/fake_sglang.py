"""A fake SGLang 0.5.23 fleet: one asyncio process answering the control routes on many ports, over real HTTP/1.1.

Each port is one engine with its own label and pause state; it answers the 0.5.23 bodies of ``/pause_generation``
(a JSON body required), ``/continue_generation``, ``/update_weight_version``, ``/model_info`` (and the deprecated
``/get_model_info``), ``/update_weights_from_disk``, ``/flush_cache`` (``text/plain``), ``/abort_request`` and
``/health``, after the engine's ``delay`` seconds (the injected engine latency). An engine set to ``fail`` answers
every route but ``/health`` with a 500. No torch, no model: the control plane only (``bench/fleet.py`` drives it).

Every request is recorded by the server itself, on ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every
process of the machine): ``(port, path, arrived, answered, status)``, and the server counts open connections and
requests in flight (peaks too). A control port serves them: ``GET /_records?since=i``, ``GET /_stats``,
``POST /_reset`` (the peaks), ``POST /_behave`` ``{"ports": [...], "delay": s, "fail": bool}``.

Usage: python bench/fake_sglang.py --engines N [--delay S]; it prints ``{"control": port, "ports": [...]}`` on one
line once every port listens, and serves until stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}
_PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class FakeEngine:
    """One engine's state: its label, whether it is paused, and how it behaves."""

    port: int
    weight_version: str = "default"
    paused: str | None = None
    delay: float = 0.0
    fail: bool = False


@dataclass
class FakeFleet:
    """Many engines in one process; the records and connection counts of all of them."""

    delay: float = 0.0
    engines: dict[int, FakeEngine] = field(default_factory=dict)
    records: list[tuple[int, str, float, float, int]] = field(default_factory=list)
    open_connections: int = 0
    peak_connections: int = 0
    accepted: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    _servers: list[asyncio.Server] = field(default_factory=list)

    async def start(self, count: int) -> int:
        """Listen on ``count`` free ports and a control port; returns the control port."""
        for _ in range(count):
            engine = FakeEngine(0, delay=self.delay)
            server = await asyncio.start_server(lambda r, w, e=engine: self._serve(e, r, w), "127.0.0.1", 0)
            engine.port = server.sockets[0].getsockname()[1]
            self.engines[engine.port] = engine
            self._servers.append(server)
        control = await asyncio.start_server(self._control, "127.0.0.1", 0)
        self._servers.append(control)
        port: int = control.sockets[0].getsockname()[1]
        return port

    async def aclose(self) -> None:
        for server in self._servers:
            server.close()

    # --- HTTP/1.1, keep-alive -------------------------------------------------------------------------------

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        try:
            body = await reader.readexactly(int(headers.get("content-length", "0")))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None  # the client closed the connection mid-request
        return method, target, headers, body

    @staticmethod
    def _write(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str = "application/json") -> None:
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + body)

    async def _serve(self, engine: FakeEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open_connections += 1
        self.peak_connections = max(self.peak_connections, self.open_connections)
        try:
            while (request := await self._read(reader)) is not None:
                method, target, headers, body = request
                arrived = time.monotonic()
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                try:
                    if engine.delay:
                        await _sleep_at_least(arrived + engine.delay)
                    path = urlsplit(target).path
                    status, payload, content_type = self._answer(engine, method, path, body)
                finally:
                    self.in_flight -= 1
                self._write(writer, status, payload, content_type)
                await writer.drain()
                self.records.append((engine.port, path, arrived, time.monotonic(), status))
                if headers.get("connection", "").lower() == "close":
                    break
        except ConnectionError:
            pass  # the client went away mid-request: nothing to answer
        finally:
            self.open_connections -= 1
            writer.close()

    # --- the 0.5.23 routes ----------------------------------------------------------------------------------

    def _answer(self, engine: FakeEngine, method: str, path: str, raw: bytes) -> tuple[int, bytes, str]:
        if path == "/health":
            return 200, b"", "text/plain"
        if engine.fail:
            return 500, b'{"message": "injected failure"}', "application/json"
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            return 400, b'{"detail": "invalid JSON"}', "application/json"

        def ok(payload: dict[str, Any]) -> tuple[int, bytes, str]:
            return 200, json.dumps(payload).encode(), "application/json"

        if path in ("/model_info", "/get_model_info") and method == "GET":
            return ok(
                {
                    "model_path": "fake",
                    "served_model_name": "fake",
                    "tokenizer_path": "fake",
                    "is_generation": True,
                    "preferred_sampling_params": None,
                    "weight_version": engine.weight_version,
                    "load_format": "auto",
                    "reasoning_parser": None,
                    "tool_call_parser": None,
                    "disaggregation_mode": "null",
                    "has_image_understanding": False,
                    "has_audio_understanding": False,
                    "model_type": "fake",
                    "architectures": ["FakeForCausalLM"],
                }
            )
        if path == "/flush_cache":
            return 200, b"Cache flushed.\nPlease check backend logs for more details.\n", "text/plain"
        if method != "POST":
            return 404, b'{"detail": "Not Found"}', "application/json"
        if not isinstance(body, dict):
            # 0.5.23 requires a JSON object on every POST control route (a bodyless pause is a 400).
            return 400, b'{"detail": "a JSON body is required"}', "application/json"
        if path == "/pause_generation":
            mode = body.get("mode", "abort")
            if mode not in _PAUSE_MODES:
                return 400, b'{"detail": "invalid mode"}', "application/json"
            engine.paused = mode
            return ok({"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":
            engine.paused = None
            return ok({"message": "Generation continued successfully.", "status": "ok"})
        if path == "/update_weight_version":
            new = body.get("new_version")
            if not isinstance(new, str):
                return 400, b'{"success": false, "message": "new_version is required"}', "application/json"
            engine.weight_version = new
            return ok({"success": True, "message": f"Weight version updated to {new}", "new_version": new})
        if path == "/update_weights_from_disk":
            if body.get("weight_version") is not None:
                engine.weight_version = str(body["weight_version"])
            return ok({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})
        if path == "/abort_request":
            return ok({})
        return 404, b'{"detail": "Not Found"}', "application/json"

    # --- control --------------------------------------------------------------------------------------------

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await self._read(reader)) is not None:
                method, target, _, raw = request
                url = urlsplit(target)
                if url.path == "/_records":
                    since = int(parse_qs(url.query).get("since", ["0"])[0])
                    payload: Any = {"records": self.records[since:], "next": len(self.records)}
                elif url.path == "/_stats":
                    payload = {
                        "open_connections": self.open_connections,
                        "peak_connections": self.peak_connections,
                        "accepted": self.accepted,
                        "peak_in_flight": self.peak_in_flight,
                        "engines": len(self.engines),
                        "cpu_s": time.process_time(),  # the whole fleet's CPU so far: it shares the machine
                    }
                elif url.path == "/_reset" and method == "POST":
                    self.peak_connections = self.open_connections
                    self.peak_in_flight = self.in_flight
                    payload = {}
                elif url.path == "/_behave" and method == "POST":
                    spec = json.loads(raw)
                    for port in spec["ports"]:
                        engine = self.engines[port]
                        engine.delay = float(spec.get("delay", self.delay))
                        engine.fail = bool(spec.get("fail", False))
                    payload = {}
                else:
                    self._write(writer, 404, b"{}")
                    await writer.drain()
                    continue
                self._write(writer, 200, json.dumps(payload).encode())
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


async def _sleep_at_least(deadline: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``deadline``: the injected latency is never shorter than asked."""
    # uvloop's timers run on a millisecond clock and may fire up to 1 ms before the deadline by time.monotonic(); the
    # benchmark subtracts the injected latency from the update's wall, so a short sleep would read as negative time.
    while (left := deadline - time.monotonic()) > 0:  # noqa: ASYNC110 (a deadline, not an event to wait for)
        await asyncio.sleep(left)


async def _main(count: int, delay: float) -> None:
    fleet = FakeFleet(delay=delay)
    control = await fleet.start(count)
    print(json.dumps({"control": control, "ports": list(fleet.engines)}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # serve until the parent closes our stdin (or dies)
    await fleet.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each engine takes to answer")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(_main(args.engines, args.delay))
    else:
        uvloop.run(_main(args.engines, args.delay))


if __name__ == "__main__":
    main()
