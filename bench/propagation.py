"""Benchmark: how fast a new weight version reaches M subscriber processes, by weightbus and by what users pick instead.

One publisher bumps a version N times, ``--interval`` apart (10 ms); M subscriber processes
(``bench/propagation_worker.py``, M = 1, 8, 64) each record when they first hold a version ``>= v``.
Latency of ``v`` at one subscriber = that moment minus the wall time (``time.time_ns``, CLOCK_REALTIME, shared by
every process on the machine) just before the publish call of ``v``. Rows, interleaved within each repeat (the
order rotates between repeats), 3 repeats:

* ``weightbus``: ``VersionPublisher(bus, policy).start()`` then ``async with pub.update(): pass`` (no engines) →
  a ``VersionTracker`` in each subscriber, which holds the version when its ``on_change`` callback runs (as
  the raw rows hold theirs in their message callback). The clock starts at the end of the block, where a
  trainer's push ends: the announcement is the critical path; the fence read on entering runs beside the
  pause, before the push (it is timed in ``bench/update.py``);
* ``nats_core``: raw NATS core publish → plain subscription;
* ``jetstream``: raw JetStream publish (acknowledged) → ordered push consumer, deliver last per subject;
* ``jetstream_events``: weightbus's publisher (as in ``weightbus``) → the same raw ordered consumer on the weights
  subject, decoding each event's JSON for its version. It separates the transport's cost of weightbus's events
  (their ~250-byte JSON and the two headers the integrity protocol needs, ``Nats-Msg-Id`` and the expected
  subject sequence, which nats-py parses per delivery) from the tracker's own work;
* ``redis``: Redis Streams ``XADD`` → ``XREAD BLOCK`` (``redis-server`` started here on a free port with
  ``--save "" --appendonly no``; the row says so when the binary or the ``redis`` client is absent);
* ``http_poll``: the trainer sets the version on a local HTTP ``/model_info`` server; each subscriber keeps a
  1 s TTL cache of it (miles' approach before the bus).

Workers are started once, and are subscribed and ready (a line on their stdout) before each trial publishes.
Results: ``bench/results/propagation.json``, ``.md`` (table and ratios) and ``.png``; the machine's 1-minute load
average is recorded before and after each trial.

Usage: python bench/propagation.py [--versions N] [--subscribers 1,8,64] [--repeats 3] [--quick] [--replot]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from fleet import machine as describe_machine  # one description of the machine for every benchmark
from propagation_report import fmt, ratios, summarise, write_reports
from propagation_rows import (
    POLL_TTL,
    ROWS,
    RedisServer,
    VersionServer,
    Workers,
    ensure_raw_stream,
    ensure_weightbus_stream,
    run_trial,
)

from weightbus.embedded.server import EmbeddedNats
from weightbus.process.eventloop import EVENT_LOOP_ENV, loop_name

RESULTS_DIR = Path(__file__).parent / "results"
# Versions per trial for each M, so that 3 repeats x 6 rows x 3 M (with drain and update) stay under 15 minutes on
# 2 cores: at M = 64 each version is 64 deliveries, and the subscribers share the 2 cores with the server.
DEFAULT_VERSIONS = {1: 500, 8: 500, 64: 500}
_LATENCY = "time.time_ns() when a subscriber first holds >= v, minus time.time_ns() before publishing v"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, help="versions per trial at every M (default: 500 at every M)")
    parser.add_argument("--subscribers", default="1,8,64", help="comma-separated M values")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.010, help="seconds between publishes")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    parser.add_argument("--quick", action="store_true", help="100 versions, 1 repeat (a smoke run)")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() in every subscriber after imports")
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="the event loop of every asyncio process (the publisher and the NATS rows' subscribers); the "
        "weightbus CLI's default is uvloop",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--replot", action="store_true", help="rewrite the .md and .png from the .json in --out")
    return parser


def _show(record: dict[str, Any], repeat: int, repeats: int) -> None:
    shown = record["error"] or (
        f"p50 {fmt(record['p50_ms'])} p99 {fmt(record['p99_ms'])} max {fmt(record['max_ms'])} ms"
        f"{'  lost ' + str(record['lost']) if record['lost'] else ''}"
    )
    print(f"[{repeat + 1}/{repeats}] M={record['M']:<3} {record['row']:10s} load {record['load_before']:5.2f}  {shown}")


class _Run:
    """The trials of one run, their pooled latencies per (row, M), and what the machine and servers were."""

    def __init__(self, args: argparse.Namespace, ms: list[int], rows: list[str], versions: dict[int, int]) -> None:
        self.args, self.ms, self.rows, self.versions = args, ms, rows, versions
        self.trials: list[dict[str, Any]] = []
        self.pooled: dict[tuple[str, int], list[float]] = {}
        self.nats_version = ""
        self.redis_version: str | None = None

    def run(self) -> None:
        """Start the servers and the subscriber processes once, then every trial, rows rotated per repeat."""
        args, ms = self.args, self.ms
        started = time.monotonic()
        with contextlib.ExitStack() as stack:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="weightbus-bench-")))
            server = stack.enter_context(EmbeddedNats())
            redis_server = stack.enter_context(RedisServer())
            http = stack.enter_context(VersionServer())
            asyncio.run(ensure_raw_stream(server.url))
            # The weightbus stream is created once here, as an operator would; trackers then only read it.
            asyncio.run(ensure_weightbus_stream(server.url))
            workers = Workers(max(ms), log_dir, args.gc_freeze)
            stack.callback(workers.close)
            env = {"nats": server.url, "redis": redis_server, "http": http, "workers": workers}
            took = time.monotonic() - started
            print(f"{max(ms)} subscriber processes ready in {took:.1f} s; versions per trial {self.versions}")
            for repeat in range(args.repeats):
                for m in ms:
                    order = self.rows[repeat % len(self.rows) :] + self.rows[: repeat % len(self.rows)]
                    for row in order:
                        tag = f"r{repeat}m{m}{row.replace('_', '')}"
                        record, latencies = run_trial(row, m, self.versions[m], tag, args, env)
                        record["repeat"] = repeat
                        self.trials.append(record)
                        self.pooled.setdefault((row, m), []).extend(latencies)
                        _show(record, repeat, args.repeats)
            self.nats_version = subprocess.run(
                [server.binary, "--version"], capture_output=True, text=True
            ).stdout.strip()
            self.redis_version = redis_server.version or redis_server.absent

    def result(self, load_at_start: float, duration_s: float) -> dict[str, Any]:
        """The run as ``propagation.json`` holds it."""
        args, ms = self.args, self.ms
        loads = [t[k] for t in self.trials for k in ("load_before", "load_after")]
        result: dict[str, Any] = {
            "config": {
                "subscribers": ms,
                "versions": {str(m): n for m, n in self.versions.items()},
                "repeats": args.repeats,
                "interval_s": args.interval,
                "rows": self.rows,
                "poll_ttl_s": POLL_TTL,
                "gc_freeze_in_subscribers": args.gc_freeze,
                "event_loop": loop_name(),
                "latency": _LATENCY,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "cpu_model": describe_machine()["cpu_model"],
                "python": platform.python_version(),
                "platform": platform.platform(),
                "nats_server": self.nats_version,
                "redis_server": self.redis_version,
                "load_min": min(loads),
                "load_max": max(loads),
                "load_at_start": load_at_start,
                "note": f"load {load_at_start:.2f} before the run started (other jobs); during a trial the M "
                "subscriber processes themselves count in the load average.",
            },
            "summary": summarise(self.pooled, self.trials, ms),
            "trials": self.trials,
            "duration_s": duration_s,
        }
        result["ratios"] = ratios(result["summary"], ms)
        return result


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.replot:
        result = json.loads((args.out / "propagation.json").read_text())
        # Ratios from the stored latencies, so an older file gets the columns added since.
        result["ratios"] = ratios(result["summary"], result["config"]["subscribers"])
        write_reports(result, args.out)
        return
    ms = [int(x) for x in args.subscribers.split(",")]
    rows = [r for r in args.rows.split(",") if r]
    if unknown := set(rows) - set(ROWS):
        parser.error(f"unknown rows: {sorted(unknown)}")
    if args.quick:
        args.versions, args.repeats = args.versions or 100, 1
    versions = {m: args.versions or DEFAULT_VERSIONS.get(m, 300) for m in ms}
    # Workers inherit it: every row that runs an event loop runs the same one.
    os.environ[EVENT_LOOP_ENV] = args.loop
    load_at_start = os.getloadavg()[0]
    started = time.monotonic()
    run = _Run(args, ms, rows, versions)
    run.run()
    result = run.result(load_at_start, time.monotonic() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "propagation.json").write_text(json.dumps(result, indent=2) + "\n")
    write_reports(result, args.out)


if __name__ == "__main__":
    main()
