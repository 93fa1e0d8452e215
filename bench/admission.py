"""Benchmark: the admission check's cost per submission, and the bus round trips per group when shared.

In process: ``Admission.try_acquire`` + ``Slot.release`` (the check, the count and the release of one
submission, version read from a tracker-like ``.current`` property), and the ``async with
admission.slot()`` form, each side by side with a no-op baseline of the same shape (a plain call, an empty
async context manager). The target is < 5 µs per submission.

Shared: three ``SharedBudget`` holders of one policy, each gating four producers whose "generation" is a
short sleep, a trainer advancing the version every ``--step-ms``, each holder draining its share at each
version. Every bus call a budget makes (conditional publish, ``last``, ``last_seq``) is counted; the target
is at most one round trip per group. Run on the in-process bus and, when a ``nats-server`` binary is found,
on a real one (``EmbeddedNats`` on a free port). Results go to stdout and ``bench/results/admission.json``.

Usage: python bench/admission.py [--n N] [--seconds S] [--step-ms MS] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from weightbus.bus import MemoryBus, connect
from weightbus.consumers.admission import Admission, SharedBudget

RESULTS = Path(__file__).parent / "results" / "admission.json"
BATCH = 12
ETA = 1


class _Tracker:
    """A stand-in for ``VersionTracker``: ``current`` is a property, as there."""

    def __init__(self) -> None:
        self._v = 10

    @property
    def current(self) -> int:
        return self._v


class _NoopSlot:
    def release(self, outcome: str = "finished") -> None:
        pass


class _NoopGate:
    def try_acquire(self) -> _NoopSlot:
        return _NoopSlot()


class _NoopContext:
    async def __aenter__(self) -> _NoopSlot:
        return _NoopSlot()

    async def __aexit__(self, *exc: object) -> None:
        return None


def _best(fn: Any, n: int, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn(n)
        best = min(best, time.perf_counter() - t)
    return best / n * 1e6


def bench_in_process(n: int) -> dict[str, float]:
    gate = Admission("bounded", current=_Tracker(), max_staleness=ETA, batch=BATCH)
    noop = _NoopGate()

    def check(k: int) -> None:
        acquire = gate.try_acquire
        for _ in range(k):
            acquire().release()  # type: ignore[union-attr]

    def baseline(k: int) -> None:
        acquire = noop.try_acquire
        for _ in range(k):
            acquire().release()

    async def ctx(k: int, make: Any) -> None:
        for _ in range(k):
            async with make():
                pass

    def run_ctx(make: Any) -> Any:
        return lambda k: asyncio.run(ctx(k, make))

    return {
        "try_acquire_release_us": _best(check, n),
        "noop_call_us": _best(baseline, n),
        "async_with_slot_us": _best(run_ctx(gate.slot), n),
        "async_with_noop_us": _best(run_ctx(_NoopContext), n),
    }


class _Counting:
    """Counts the round trips a budget makes through the bus it wraps."""

    def __init__(self, bus: Any) -> None:
        self._bus = bus
        self.calls: dict[str, int] = {"publish": 0, "last": 0, "last_seq": 0}

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["publish"] += 1
        return await self._bus.publish(*args, **kwargs)

    async def last(self, subject: str) -> Any:
        self.calls["last"] += 1
        return await self._bus.last(subject)

    async def last_seq(self, subject: str) -> int:
        self.calls["last_seq"] += 1
        return await self._bus.last_seq(subject)

    def subscribe(self, *args: Any, **kwargs: Any) -> Any:
        return self._bus.subscribe(*args, **kwargs)


async def bench_shared(buses: list[Any], seconds: float, step_ms: float) -> dict[str, Any]:
    version = [1]
    counted = [_Counting(bus) for bus in buses]
    budgets = [
        SharedBudget(c, "bench-admission", name=f"r{i}", lease_s=10.0, grant=BATCH // 3) for i, c in enumerate(counted)
    ]
    gates = [
        Admission("bounded", current=lambda: version[0], max_staleness=ETA, batch=BATCH, budget=b, poll_s=0.005)
        for b in budgets
    ]
    admitted = [0] * len(gates)
    peak = [0]

    async def produce(i: int, gate: Admission) -> None:
        while True:
            slot = await gate.acquire()
            admitted[i] += 1
            peak[0] = max(peak[0], sum(g.used for g in gates))
            await asyncio.sleep(0.002)
            slot.accept()

    async def drain(gate: Admission) -> None:
        seen = None
        while True:
            await asyncio.sleep(0.001)
            if version[0] != seen:
                seen = version[0]
                gate.drained(min(gate.ready, BATCH // 3), at=seen)

    async def trainer() -> None:
        while True:
            await asyncio.sleep(step_ms / 1000)
            version[0] += 1

    for b in budgets:
        await b.start()
    tasks = [asyncio.create_task(produce(i, g)) for i, g in enumerate(gates) for _ in range(4)]
    tasks += [asyncio.create_task(drain(g)) for g in gates] + [asyncio.create_task(trainer())]
    await asyncio.sleep(seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    calls = {k: sum(c.calls[k] for c in counted) for k in counted[0].calls}
    for b in budgets:
        await b.aclose()
    total = sum(calls.values())
    return {
        "groups": sum(admitted),
        # Each process is as busy as the others: a fair split admits about a third each (none starved).
        "groups_by_process": admitted,
        "versions": version[0] - 1,
        "bus_calls": calls,
        "conflicts": sum(b.conflicts for b in budgets),
        "round_trips_per_group": round(total / max(1, sum(admitted)), 4),
        "peak_used": peak[0],
        "allowance": (ETA + 1) * BATCH,
    }


async def _shared_runs(seconds: float, step_ms: float) -> dict[str, Any]:
    memory = MemoryBus(history=100_000)
    out: dict[str, Any] = {"memory": await bench_shared([memory, memory, memory], seconds, step_ms)}
    try:
        from weightbus.embedded.server import EmbeddedNats
        from weightbus.errors import NatsServerNotFound
    except ImportError:  # pragma: no cover - the package is part of weightbus
        return out
    try:
        server = EmbeddedNats().start()
    except (NatsServerNotFound, OSError) as exc:
        out["nats"] = f"skipped: {exc}"
        return out
    try:
        buses = [await connect(server.url, name=f"bench-admission-{i}") for i in range(3)]
        try:
            out["nats"] = await bench_shared(buses, seconds, step_ms)
        finally:
            for bus in buses:
                await bus.aclose()
    finally:
        server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="submissions per in-process timing")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each shared run")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the trainer's time per version")
    parser.add_argument("--out", type=Path, default=RESULTS.parent)
    args = parser.parse_args()
    result = {
        "benchmark": "admission",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "batch": BATCH,
        "max_staleness": ETA,
        "in_process": bench_in_process(args.n),
        "shared": asyncio.run(_shared_runs(args.seconds, args.step_ms)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "admission.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
