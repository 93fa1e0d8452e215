"""Benchmark: where the time of one ``update()`` goes, with 2 reference engines over real HTTP.

An embedded nats-server and two ``weightbus engine`` processes (hash model, no token delay) on free ports.
``VersionPublisher(bus, policy, fleet=EngineFleet(urls, http=client), pause="retract")``; each round runs
``async with pub.update(...) as v:`` around the trainer's push (``update_weights_from_disk`` to both engines at
once). Three modes, taken in turn round by round in the same run, so they share the machine's conditions:

* ``labels``: ``update(labels=True)``, the push carries ``weight_version=v``: no relabel, no stamp call;
* ``pending``: ``update()`` with the same push: the engines are relabelled ``pending:<v>`` after the pause and
  before the push (what closes the zombie window); the difference from ``labels`` is that relabel's cost;
* ``pending_stamp``: ``update()``, the push carries no version (as a LoRA load): the pending relabel and the
  stamp call after the push.

The fleet's ``httpx.AsyncClient`` carries ``OverheadMeter.http_hooks()``, so every engine request is timed from
outside weightbus, by path. Phases per round, on one clock:

* ``pause``: entering ``update()`` until the body runs (``/pause_generation`` with the fence read beside it, the
  label read, the pending relabel);
* ``push``: the trainer's ``/update_weights_from_disk`` calls (the body);
* ``stamp``: leaving the body until the last ``/update_weight_version`` or ``/model_info`` answer (zero when the
  stamp travels with the push);
* ``announce``: from there until the first ``/continue_generation`` request (``WeightUpdated``);
* ``resume``: from there until ``update()`` returns (``/continue_generation``, with ``WeightApplied`` beside it).

Each phase is split into engine HTTP time (requests in flight) and weightbus's own time (the rest: bus round trips
and Python); ``pending_relabel`` is the span of the pending relabel's requests. Results:
``bench/results/update.json`` (top-level ``summary`` is the ``labels`` mode; ``modes`` has all three) and ``update.md``.

Usage: python bench/update.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from weightbus.bus import connect
from weightbus.embedded.server import EmbeddedNats, free_port
from weightbus.process.eventloop import loop_name
from weightbus.process.eventloop import run as run_loop
from weightbus.process.overhead import OverheadMeter
from weightbus.producers import EngineFleet, VersionPublisher

RESULTS_DIR = Path(__file__).parent / "results"
PHASES = ("pause", "push", "stamp", "announce", "resume")
MODES = ("labels", "pending", "pending_stamp")
STAMP_PATHS = {"/update_weight_version", "/model_info"}
RESUME_PATH = "/continue_generation"


class _Engines:
    """``weightbus engine`` processes on free ports, ready once ``/health`` answers."""

    def __init__(self, count: int) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        cli = [sys.executable, "-m", "weightbus.cli", "engine", "--token-delay", "0"]
        for _ in range(count):
            port = free_port()
            self.procs.append(
                subprocess.Popen([*cli, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            self.urls.append(f"http://127.0.0.1:{port}")

    def __enter__(self) -> _Engines:
        deadline = time.monotonic() + 30
        for proc, url in zip(self.procs, self.urls, strict=True):
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"the reference engine at {url} did not start")
                time.sleep(0.05)  # the engine has no readiness signal but its /health route
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=10)


async def _rounds(nats_url: str, engine_urls: list[str], rounds: int, warmup: int) -> dict[str, list[dict[str, Any]]]:
    meter = OverheadMeter()
    bus = await connect(nats_url, name="bench-update")
    out: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        async with httpx.AsyncClient(event_hooks=meter.http_hooks(), timeout=30) as http:
            fleet = EngineFleet(engine_urls, http=http)
            pub = await VersionPublisher(bus, "bench-update", fleet=fleet, pause="retract").start()
            for i in range(warmup + rounds):
                for mode in MODES:
                    first_call = len(meter.http_calls)
                    t0 = meter.now()
                    async with pub.update(labels=mode == "labels") as version:
                        t1 = meter.now()
                        # The label travels with the load, as miles sends it, except in pending_stamp; whether the
                        # publisher still needs its own stamp call afterwards shows in the stamp phase.
                        label = None if mode == "pending_stamp" else version
                        await asyncio.gather(
                            *(
                                c.update_weights_from_disk(f"/checkpoints/step-{version}", weight_version=label)
                                for c in fleet.clients
                            )
                        )
                        t2 = meter.now()
                    t5 = meter.now()
                    if i >= warmup:
                        out[mode].append(_phases(meter, first_call, t0, t1, t2, t5))
    finally:
        await bus.aclose()
    return out


def _phases(meter: OverheadMeter, first_call: int, t0: float, t1: float, t2: float, t5: float) -> dict[str, Any]:
    calls = meter.http_calls[first_call:]
    stamp_ends = [c.end for c in calls if c.path in STAMP_PATHS and c.start >= t2]
    t3 = max(stamp_ends, default=t2)
    resumes = [c.start for c in calls if c.path == RESUME_PATH and c.start >= t3]
    t4 = min(resumes, default=t5)
    bounds = dict(zip(PHASES, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)], strict=True))
    record: dict[str, Any] = {"total_s": t5 - t0, "http_requests": [c.path for c in calls]}
    for name, (start, end) in bounds.items():
        http = meter.http_time(start, end)
        record[name] = {"wall_s": end - start, "engine_http_s": http, "own_s": end - start - http}
    record["engine_http_s"] = meter.http_time(t0, t5)
    record["own_s"] = record["total_s"] - record["engine_http_s"]
    relabels = [c for c in calls if c.path == "/update_weight_version" and c.start < t1]
    record["pending_relabel_s"] = max(c.end for c in relabels) - min(c.start for c in relabels) if relabels else 0.0
    return record


def _p50_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def _p99_ms(values: list[float]) -> float:
    return 1000 * statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else 1000 * values[0]


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name in (*PHASES, None):
        rows = [r[name] for r in records] if name else records
        wall = [r["wall_s"] if name else r["total_s"] for r in rows]
        summary[name or "update"] = {
            "wall_p50_ms": _p50_ms(wall),
            "wall_p99_ms": _p99_ms(wall),
            "engine_http_p50_ms": _p50_ms([r["engine_http_s"] for r in rows]),
            "own_p50_ms": _p50_ms([r["own_s"] for r in rows]),
            "own_p99_ms": _p99_ms([r["own_s"] for r in rows]),
        }
    return summary


def _requests(records: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in records[0]["http_requests"]:
        counts[path] = counts.get(path, 0) + 1
    return counts


def _compare(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    base = modes["labels"]["summary"]["update"]
    out: dict[str, dict[str, float]] = {}
    for mode, m in modes.items():
        whole = m["summary"]["update"]
        out[mode] = {
            "update_wall_p50_ms": whole["wall_p50_ms"],
            "update_wall_p99_ms": whole["wall_p99_ms"],
            "pause_wall_p50_ms": m["summary"]["pause"]["wall_p50_ms"],
            "stamp_wall_p50_ms": m["summary"]["stamp"]["wall_p50_ms"],
            "pending_relabel_p50_ms": m["pending_relabel_p50_ms"],
            "added_p50_ms": whole["wall_p50_ms"] - base["wall_p50_ms"],
        }
    return out


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# update(): where the time goes (2 reference engines over HTTP)",
        "",
        f"{result['rounds']} rounds of each mode after {result['warmup']} warm-up, the modes taken in turn. "
        f"1-min load average {result['load_before']:.2f} before, {result['load_after']:.2f} after; event loop "
        f"{result.get('event_loop', 'asyncio')}.",
        "",
        "## The pending relabel, side by side",
        "",
        "| mode | engine requests per update | whole update p50 ms | p99 ms | pause phase p50 ms | "
        "pending relabel p50 ms | stamp phase p50 ms | added p50 ms (vs labels) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, c in result["comparison"].items():
        reqs = ", ".join(f"{p.lstrip('/')} ×{n}" for p, n in result["modes"][mode]["requests_per_update"].items())
        lines.append(
            f"| {mode} | {reqs} | {c['update_wall_p50_ms']:.2f} | {c['update_wall_p99_ms']:.2f} | "
            f"{c['pause_wall_p50_ms']:.2f} | {c['pending_relabel_p50_ms']:.2f} | {c['stamp_wall_p50_ms']:.2f} | "
            f"{c['added_p50_ms']:+.2f} |"
        )
    lines += [
        "",
        "labels: `update(labels=True)`, the push carries `weight_version`; pending: `update()` with the same push "
        "(the engines are relabelled `pending:<v>` before it); pending_stamp: `update()`, a push without a version "
        "(relabel before, stamp after).",
    ]
    for mode in MODES:
        lines += [
            "",
            f"## Phases: {mode}",
            "",
            "| phase | wall p50 ms | wall p99 ms | engine HTTP p50 ms | weightbus own p50 ms | own p99 ms |",
            "|---|---|---|---|---|---|",
        ]
        for name, s in result["modes"][mode]["summary"].items():
            label = "**whole update**" if name == "update" else name
            lines.append(
                f"| {label} | {s['wall_p50_ms']:.2f} | {s['wall_p99_ms']:.2f} | {s['engine_http_p50_ms']:.2f} | "
                f"{s['own_p50_ms']:.2f} | {s['own_p99_ms']:.2f} |"
            )
    lines += [
        "",
        "Phase medians are taken separately, so they need not add up to the whole update's median. Engine HTTP = "
        "time with at least one engine request in flight (timed by httpx event hooks on the fleet's client); own = "
        "the rest (bus round trips and Python).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with EmbeddedNats() as server, _Engines(2) as engines:
        records = run_loop(_rounds(server.url, engines.urls, args.rounds, args.warmup))
    modes = {
        mode: {
            "requests_per_update": _requests(rows),
            "summary": _summary(rows),
            "pending_relabel_p50_ms": _p50_ms([r["pending_relabel_s"] for r in rows]),
        }
        for mode, rows in records.items()
    }
    result = {
        "rounds": args.rounds,
        "warmup": args.warmup,
        "engines": 2,
        "requests_per_update": modes["labels"]["requests_per_update"],
        "summary": modes["labels"]["summary"],
        "modes": modes,
        "comparison": _compare(modes),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "event_loop": loop_name(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "update.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "update.md").write_text(_markdown(result))
    print(_markdown(result))
    print(f"wrote {args.out}/update.json, .md")


if __name__ == "__main__":
    main()
