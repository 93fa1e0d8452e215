"""Subscriber process of ``bench/propagation.py``: holds a version by one transport and reports when it got each.

Protocol (JSON lines): the parent writes one command per trial on stdin, ``{"row": ..., "n": N, "timeout": s,
...}``; the worker subscribes, prints ``{"ready": true}`` once it cannot miss a later publish, then prints
``{"recv": [t_1, ..., t_N], "error": null, "heavy_imports": [], "cpu_s": s}``: ``t_v`` is ``time.time_ns()`` when
this process first held a version ``>= v`` (None if it never did before the timeout); ``cpu_s`` is the CPU time it
spent from ready to the end of the trial. EOF on stdin ends the worker.

Only the modules of the row run are imported, never torch: 64 of these share 2 cores. The garbage collector is
left as each library leaves it unless the parent passes ``--gc-freeze`` (then every row gets the same frozen
start-up heap).

Usage (by the parent only): python bench/propagation_worker.py [--gc-freeze]
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from weightbus.process.eventloop import run as run_loop

__all__ = ["main"]

_HEAVY = ("torch", "numpy", "starlette", "uvicorn", "matplotlib")
ROWS: dict[str, Callable[[dict[str, Any], Callable[[], None]], list[int | None]]] = {}


class _Holder:
    """``recv[v - 1]`` is when a version ``>= v`` was first held; versions skipped by a jump get the same time."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.held = 0
        self.recv: list[int | None] = [None] * n
        self.done = asyncio.Event() if _in_loop() else None

    def hold(self, version: int) -> None:
        if version <= self.held:
            return
        now = time.time_ns()
        for v in range(self.held + 1, min(version, self.n) + 1):
            self.recv[v - 1] = now
        self.held = version
        if version >= self.n and self.done is not None:
            self.done.set()


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _row(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        ROWS[name] = fn
        return fn

    return register


@_row("weightbus_mark_now")
@_row("weightbus")
def _weightbus(cmd: dict[str, Any], ready: Callable[[], None]) -> list[int | None]:
    from prometheus_client import CollectorRegistry

    from weightbus.bus import connect
    from weightbus.consumers import VersionTracker

    async def run() -> list[int | None]:
        holder = _Holder(cmd["n"])
        # The parent ensured the stream; a consumer needs no stream-management permission.
        bus = await connect(cmd["nats"], name="bench-tracker", ensure_stream=False)

        def on_change(change: Any) -> None:
            # The tracker holds the version from this call on (``tracker.current``), as the raw rows hold
            # theirs in their message callback.
            if change.version is not None:
                holder.hold(change.version)

        try:
            tracker = VersionTracker(
                bus, cmd["policy"], registry=CollectorRegistry(), on_change=on_change, freeze_heap=True
            )  # a long-running consumer process, as `weightbus follow` and `weightbus rollout` are
            async with tracker:
                await tracker.wait_ready(30)
                ready()
                await _wait(holder, cmd["timeout"])
        finally:
            await bus.aclose()
        return holder.recv

    return run_loop(run())


@_row("nats_core")
def _nats_core(cmd: dict[str, Any], ready: Callable[[], None]) -> list[int | None]:
    import nats

    async def run() -> list[int | None]:
        holder = _Holder(cmd["n"])
        nc = await nats.connect(cmd["nats"], name="bench-core")
        try:

            async def on_msg(msg: Any) -> None:
                holder.hold(int(msg.data))

            await nc.subscribe(cmd["subject"], cb=on_msg)
            await nc.flush()  # the server has the interest once the PONG is back
            ready()
            await _wait(holder, cmd["timeout"])
        finally:
            await nc.close()
        return holder.recv

    return run_loop(run())


def _follow_jetstream(
    cmd: dict[str, Any], ready: Callable[[], None], subject: str, stream: str, version_of: Callable[[bytes], int | None]
) -> list[int | None]:
    """A raw JetStream ordered consumer (deliver last per subject) holding ``version_of(payload)`` of each message."""
    import nats
    from nats.js.api import DeliverPolicy

    async def run() -> list[int | None]:
        holder = _Holder(cmd["n"])
        nc = await nats.connect(cmd["nats"], name="bench-js")
        try:

            async def on_msg(msg: Any) -> None:
                version = version_of(msg.data)
                if version is not None:
                    holder.hold(version)

            await nc.jetstream().subscribe(
                subject,
                cb=on_msg,
                stream=stream,
                ordered_consumer=True,
                idle_heartbeat=1.0,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            )
            ready()
            await _wait(holder, cmd["timeout"])
        finally:
            await nc.close()
        return holder.recv

    return run_loop(run())


@_row("jetstream")
def _jetstream(cmd: dict[str, Any], ready: Callable[[], None]) -> list[int | None]:
    return _follow_jetstream(cmd, ready, cmd["subject"], cmd["stream"], int)


@_row("jetstream_events")
def _jetstream_events(cmd: dict[str, Any], ready: Callable[[], None]) -> list[int | None]:
    import msgspec

    decoder = msgspec.json.Decoder()

    def version_of(data: bytes) -> int | None:
        event = decoder.decode(data)
        return event["version"] if event.get("type") == "weight.updated" else None

    return _follow_jetstream(cmd, ready, cmd["weights_subject"], cmd["weights_stream"], version_of)


async def _wait(holder: _Holder, timeout: float) -> None:
    assert holder.done is not None
    try:
        async with asyncio.timeout(timeout):
            await holder.done.wait()
    except TimeoutError:
        pass


@_row("redis")
def _redis(cmd: dict[str, Any], ready: Callable[[], None]) -> list[int | None]:
    import redis

    holder = _Holder(cmd["n"])
    client = redis.Redis(host="127.0.0.1", port=cmd["redis_port"])
    try:
        key = cmd["key"]
        newest = client.xrevrange(key, count=1)
        # Reading on from the id held now, not "$": nothing added after the ready line can be missed.
        last_id: bytes | str = newest[0][0] if newest else "0-0"
        ready()
        deadline = time.monotonic() + cmd["timeout"]
        while holder.held < holder.n:
            left_ms = int(1000 * (deadline - time.monotonic()))
            if left_ms <= 0:
                break
            for _stream, entries in client.xread({key: last_id}, block=left_ms) or []:
                for entry_id, fields in entries:
                    holder.hold(int(fields[b"v"]))
                    last_id = entry_id
    finally:
        client.close()
    return holder.recv


@_row("http_poll")
def _http_poll(cmd: dict[str, Any], ready: Callable[[], None]) -> list[int | None]:
    import http.client

    holder = _Holder(cmd["n"])
    ttl = cmd["ttl"]
    conn = http.client.HTTPConnection("127.0.0.1", cmd["http_port"], timeout=5)

    def fetch() -> int:
        conn.request("GET", "/model_info")
        response = conn.getresponse()
        return int(json.loads(response.read())["weight_version"])

    try:
        fetch()  # open the keep-alive connection before the trial
        ready()
        deadline = time.monotonic() + cmd["timeout"]
        # A 1 s TTL cache: the version a drain sees is the one fetched at most ttl seconds ago.
        while holder.held < holder.n and time.monotonic() < deadline:
            fetched_at = time.monotonic()
            holder.hold(fetch())
            time.sleep(max(0.0, fetched_at + ttl - time.monotonic()))
    finally:
        conn.close()
    return holder.recv


def main() -> None:
    """Serve trial commands from stdin until EOF."""
    # Warnings (a resubscribe, a slow consumer) go to this process's log, which the parent keeps for stalled trials.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if "--gc-freeze" in sys.argv[1:]:
        gc.collect()
        gc.freeze()
    print(json.dumps({"started": True}), flush=True)
    cpu_at_ready = [0.0]

    def ready() -> None:
        print(json.dumps({"ready": True}), flush=True)
        cpu_at_ready[0] = time.process_time()

    for line in sys.stdin:
        cmd = json.loads(line)

        try:
            recv = ROWS[cmd["row"]](cmd, ready)
            heavy = [m for m in _HEAVY if m in sys.modules]
            # CPU this process spent from ready to the last version (teardown included): the per-event cost.
            cpu = time.process_time() - cpu_at_ready[0]
            print(json.dumps({"recv": recv, "error": None, "heavy_imports": heavy, "cpu_s": cpu}), flush=True)
        except Exception as exc:  # reported to the parent, which records it in the row
            print(json.dumps({"recv": None, "error": repr(exc)}), flush=True)


if __name__ == "__main__":
    main()
