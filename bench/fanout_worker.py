"""Subscriber process of ``bench/fanout.py``: K followers of one policy in one process, on one shared connection.

Protocol (JSON lines, as ``bench/propagation_worker.py``): the parent writes one command per trial on stdin,
``{"row": "weightbus" | "jetstream", "k": K, "n": N, "nats": url, ...}``; the worker starts K followers (K
``VersionTracker`` on one ``connect()``, or K raw JetStream ordered consumers on one ``nats.connect()``), prints
``{"ready": true}`` once every one of them is subscribed, then ``{"recv": path, "error": null, "cpu_s": s}``, where the
file ``path`` (``result_path`` of the command) holds one list per follower, ``t_v`` the ``time.time_ns()`` when
that follower first held ``>= v``.

Usage (by the parent only): python bench/fanout_worker.py
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from propagation_worker import _Holder  # one holder rule for both benchmarks

from weightbus.process.eventloop import run as run_loop

__all__ = ["main"]


async def _wait_all(holders: list[_Holder], timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            for holder in holders:
                assert holder.done is not None
                await holder.done.wait()
    except TimeoutError:
        pass  # the parent counts what never arrived


async def _weightbus(cmd: dict[str, Any], ready: Any) -> list[list[int | None]]:
    from prometheus_client import CollectorRegistry

    from weightbus.bus import connect
    from weightbus.consumers import VersionTracker
    from weightbus.consumers.tracker.metrics import TrackerMetrics

    bus = await connect(cmd["nats"], name="bench-fanout", ensure_stream=False)
    holders = [_Holder(cmd["n"]) for _ in range(cmd["k"])]
    metrics = TrackerMetrics(CollectorRegistry())  # one registry per process, as a host process has
    trackers = []
    try:
        for holder in holders:

            def on_change(change: Any, holder: _Holder = holder) -> None:
                if change.version is not None:
                    holder.hold(change.version)

            trackers.append(VersionTracker(bus, cmd["policy"], metrics=metrics, on_change=on_change, ready_timeout=120))
        for tracker in trackers:
            await tracker.start()
        await asyncio.gather(*(t.wait_ready(120) for t in trackers))
        ready()
        await _wait_all(holders, cmd["timeout"])
    finally:
        for tracker in trackers:
            await tracker.aclose()
        await bus.aclose()
    return [h.recv for h in holders]


async def _jetstream(cmd: dict[str, Any], ready: Any) -> list[list[int | None]]:
    import msgspec
    import nats
    from nats.js.api import DeliverPolicy

    decoder = msgspec.json.Decoder()
    nc = await nats.connect(servers=cmd["nats"].split(","), name="bench-fanout-js")
    holders = [_Holder(cmd["n"]) for _ in range(cmd["k"])]
    try:
        js = nc.jetstream()
        for holder in holders:

            async def on_msg(msg: Any, holder: _Holder = holder) -> None:
                event = decoder.decode(msg.data)
                if event.get("type") == "weight.updated":
                    holder.hold(event["version"])

            await js.subscribe(
                cmd["weights_subject"],
                cb=on_msg,
                stream=cmd["weights_stream"],
                ordered_consumer=True,
                idle_heartbeat=5.0,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            )
        await nc.flush()
        ready()
        await _wait_all(holders, cmd["timeout"])
    finally:
        await nc.close()
    return [h.recv for h in holders]


ROWS = {"weightbus": _weightbus, "jetstream": _jetstream}


def main() -> None:
    """Serve trial commands from stdin until EOF."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps({"started": True}), flush=True)
    cpu_at_ready = [0.0]
    said_ready = [False]

    def ready() -> None:
        print(json.dumps({"ready": True}), flush=True)
        cpu_at_ready[0] = time.process_time()
        said_ready[0] = True

    for line in sys.stdin:
        cmd = json.loads(line)
        said_ready[0] = False
        try:
            recv = run_loop(ROWS[cmd["row"]](cmd, ready))
            cpu = time.process_time() - cpu_at_ready[0]
            # Into a file: a line of a million characters on a pipe the parent drains one worker at a time
            # came back cut (the loop leaves stdout non-blocking).
            Path(cmd["result_path"]).write_text(json.dumps(recv))
            print(json.dumps({"recv": cmd["result_path"], "error": None, "cpu_s": cpu}), flush=True)
        except Exception as exc:  # reported to the parent, which records it in the row
            if not said_ready[0]:  # the parent waits for a ready line before it publishes
                print(json.dumps({"ready": True, "error": repr(exc)}), flush=True)
            print(json.dumps({"recv": None, "error": repr(exc)}), flush=True)


if __name__ == "__main__":
    main()
