"""Benchmark: one policy's announcements fanned out to ~1,000 followers, by weightbus' tracker and by raw JetStream.

T followers of one policy (1,024 by default) hold its version; one ``VersionPublisher`` announces N versions
``--interval`` apart. Two layouts: **coroutines** (all T in one process on one shared connection) and
**processes** (``--processes`` processes, T / P followers each, one connection per process). Two rows, the same
publisher and the same events: ``weightbus`` (a ``VersionTracker`` per follower) and ``jetstream`` (a raw JetStream
ordered consumer of weightbus's own weights subject per follower, decoding each event's version). On a single
nats-server and on the 3-node cluster (``weightbus.embedded.EmbeddedCluster``, an R3 stream; each process's
connection goes to a node the client picks). Rows alternate within each repeat.

Measured per trial: delivery latency (``time.time_ns()`` when a follower first holds ``>= v`` minus the wall time
where the trainer's push ends, as ``bench/propagation.py``), p50/p99/max over every follower and version; versions
never delivered; the nats-server processes' CPU seconds (``/proc/<pid>/stat``) from the first announcement to the
last delivery, per 1,000 deliveries; the subscriber processes' CPU per delivery.
Results: ``bench/results/fanout.json`` and ``fanout.md``.

Usage: python bench/fanout.py [--trackers 1024] [--processes 64] [--versions 40] [--interval 0.1] [--repeats 2]
                              [--servers single,cluster] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from fleet import machine as fleet_machine  # noqa: E402  # one description of the machine for every benchmark
from propagation_rows import Workers, publish_weightbus, quantiles  # noqa: E402

from weightbus.bus import connect, subjects  # noqa: E402
from weightbus.bus.nats import DEFAULT_STREAM  # noqa: E402
from weightbus.bus.options import ConnectOptions  # noqa: E402
from weightbus.embedded import EmbeddedCluster, EmbeddedNats  # noqa: E402
from weightbus.process.eventloop import run as run_loop  # noqa: E402

WORKER = Path(__file__).parent / "fanout_worker.py"
ROWS = ("weightbus", "jetstream")
_TICK = os.sysconf("SC_CLK_TCK")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trackers", type=int, default=1024, help="followers of the policy per trial (default 1024)")
    p.add_argument("--processes", type=int, default=64, help="processes of the 'processes' layout (default 64)")
    p.add_argument("--versions", type=int, default=40, help="versions announced per trial (default 40)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between announcements (default 0.1)")
    p.add_argument("--repeats", type=int, default=2, help="repeats of every (server, layout, row) (default 2)")
    p.add_argument("--servers", default="single,cluster", help="single, cluster or both (default both)")
    p.add_argument("--layouts", default="coroutines,processes", help="coroutines, processes or both")
    p.add_argument("--quick", action="store_true", help="a small run: 64 followers, 8 processes, 10 versions")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="where results go")
    return p


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / _TICK


class _Servers:
    """The nats-server(s) of one kind, started for the whole run of that kind."""

    def __init__(self, kind: str, base: Path) -> None:
        self.kind = kind
        self.single: EmbeddedNats | None = None
        self.cluster: EmbeddedCluster | None = None
        if kind == "single":
            self.single = EmbeddedNats(store_dir=base / "single").start()
            self.url = self.single.url
        else:
            self.cluster = EmbeddedCluster(base / "cluster", startup_timeout=60).start()
            self.url = self.cluster.urls
        replicas = 1 if kind == "single" else 3

        async def ensure() -> None:
            bus = await connect(self.url, name="bench-setup", options=ConnectOptions(replicas=replicas))
            await bus.aclose()

        run_loop(ensure())

    @property
    def pids(self) -> list[int]:
        if self.single is not None:
            return [p for p in [self.single.pid] if p is not None]
        assert self.cluster is not None
        return [p for node in self.cluster.nodes.values() if (p := node.pid) is not None]

    def close(self) -> None:
        if self.single is not None:
            self.single.stop()
        if self.cluster is not None:
            self.cluster.stop()


def _trial(row: str, layout: str, servers: _Servers, workers: Workers, args: argparse.Namespace, tag: str) -> Any:
    procs = 1 if layout == "coroutines" else args.processes
    per = args.trackers // procs
    n = args.versions
    policy = f"fanout-{tag}"
    cmd = {
        "row": row,
        "k": per,
        "n": n,
        "timeout": n * args.interval + 60.0,
        "nats": servers.url,
        "policy": policy,
        "weights_subject": subjects.weights(policy),
        "weights_stream": DEFAULT_STREAM,
    }
    results = workers.logs[0].parent / "results"
    results.mkdir(exist_ok=True)
    record: dict[str, Any] = {"row": row, "layout": layout, "server": servers.kind, "followers": per * procs}
    record["processes"] = procs
    record["load_before"] = os.getloadavg()[0]
    started = time.monotonic()
    for i in range(procs):
        (results / f"{tag}-{i}.json").unlink(missing_ok=True)
    workers.command_each(procs, [{**cmd, "result_path": str(results / f"{tag}-{i}.json")} for i in range(procs)])
    record["ready_s"] = time.monotonic() - started
    cpu_before = _cpu_seconds(servers.pids)
    sent, _calls = run_loop(publish_weightbus(servers.url, policy, n, args.interval))
    received = workers.results(procs)
    cpu_after = _cpu_seconds(servers.pids)
    failures = sorted({r["error"] for r in received if r["error"]})
    if failures:
        record.update(error="; ".join(failures), load_after=os.getloadavg()[0])
        return record
    latencies: list[float] = []
    lost = 0
    for answer in received:
        for follower in json.loads(Path(answer["recv"]).read_text()):
            for v, t in enumerate(follower, start=1):
                if t is None:
                    lost += 1
                else:
                    latencies.append((t - sent[v - 1]) / 1e6)
    deliveries = per * procs * n
    record.update(quantiles(latencies))
    record.update(
        lost=lost,
        deliveries=deliveries,
        server_cpu_s=cpu_after - cpu_before,
        server_cpu_ms_per_1000=1000 * 1000 * (cpu_after - cpu_before) / deliveries,
        subscriber_cpu_us_per_delivery=1e6 * sum(r["cpu_s"] for r in received) / deliveries,
        load_after=os.getloadavg()[0],
        error=None,
    )
    return record


def _pool(trials: list[dict[str, Any]], key: str) -> float | None:
    values = [t[key] for t in trials if t.get(key) is not None]
    return statistics.median(values) if values else None


def _load_range(result: dict[str, Any]) -> str:
    loads = [t[k] for t in result["trials"] for k in ("load_before", "load_after") if t.get(k) is not None]
    return f"{min(loads):.2f}–{max(loads):.2f}" if loads else "n/a"


def _report(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"# Fan-out: one policy's announcements to {cfg['trackers']:,} followers",
        "",
        f"{cfg['trackers']} followers; {cfg['versions']} versions {cfg['interval'] * 1000:.0f} ms apart; "
        f"{cfg['repeats']} repeats, rows alternating. Layouts: coroutines (1 process, one connection) and "
        f"processes ({cfg['processes']} processes, {cfg['trackers'] // cfg['processes']} followers and one "
        f"connection each). Machine: {result['machine']}; 1-min load average {_load_range(result)} during the "
        f"trials. Whole run: {result['duration_s']:.0f} s.",
        "",
        "Median over repeats of each trial's p50 / p99 / max in ms (time.time_ns() when a follower first holds >= v "
        "minus the wall time where the push ends); lost = versions some follower never held; server CPU = the "
        "nats-server processes' CPU ms per 1,000 deliveries; subscriber CPU = µs per delivery:",
        "",
        "| server | layout | row | p50 | p99 | max | lost | server CPU | subscriber CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for t in result["trials"]:
        groups.setdefault((t["server"], t["layout"], t["row"]), []).append(t)

    def fmt(v: float | None, digits: int = 2) -> str:
        return "n/a" if v is None else f"{v:.{digits}f}"

    for (server, layout, row), trials in groups.items():
        errors = [t["error"] for t in trials if t.get("error")]
        if errors:
            lines.append(f"| {server} | {layout} | {row} | error: {errors[0][:80]} | | | | | |")
            continue
        lines.append(
            f"| {server} | {layout} | {row} | {fmt(_pool(trials, 'p50_ms'))} | {fmt(_pool(trials, 'p99_ms'))} | "
            f"{fmt(_pool(trials, 'max_ms'))} | {sum(t['lost'] for t in trials)} | "
            f"{fmt(_pool(trials, 'server_cpu_ms_per_1000'), 1)} | "
            f"{fmt(_pool(trials, 'subscriber_cpu_us_per_delivery'), 0)} |"
        )
    lines += ["", "weightbus ÷ raw JetStream, same server, layout and run:", ""]
    lines += ["| server | layout | p50 | p99 | server CPU |", "|---|---|---|---|---|"]
    for (server, layout, row), trials in groups.items():
        raw = groups.get((server, layout, "jetstream"))
        if row != "weightbus" or raw is None:
            continue
        cells = []
        for key in ("p50_ms", "p99_ms", "server_cpu_ms_per_1000"):
            a, b = _pool(trials, key), _pool(raw, key)
            cells.append("n/a" if a is None or not b else f"{a / b:.2f}×")
        lines.append(f"| {server} | {layout} | " + " | ".join(cells) + " |")
    lines += ["", "Raw data: fanout.json."]
    return "\n".join(lines) + "\n"


def _machine() -> str:
    m = fleet_machine()
    return f"{m['nproc']} CPUs ({m['cpu_model']}), {m['platform']}"


def main() -> None:
    args = _parser().parse_args()
    if args.quick:
        args.trackers, args.processes, args.versions = 64, 8, 10
    if args.trackers % args.processes:
        raise SystemExit(f"--trackers ({args.trackers}) must be a multiple of --processes ({args.processes})")
    args.out.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="weightbus-fanout-"))
    begun = time.monotonic()
    trials: list[dict[str, Any]] = []
    layouts = [x for x in args.layouts.split(",") if x]
    try:
        workers = Workers(args.processes, base, gc_freeze=False, worker=WORKER)
        try:
            for kind in [x for x in args.servers.split(",") if x]:
                servers = _Servers(kind, base / kind)
                try:
                    for repeat in range(args.repeats):
                        for layout in layouts:
                            rows = ROWS if repeat % 2 == 0 else tuple(reversed(ROWS))
                            for row in rows:
                                tag = f"{kind}-{layout}-{row}-{repeat}"
                                record = _trial(row, layout, servers, workers, args, tag)
                                record["repeat"] = repeat
                                trials.append(record)
                                print(json.dumps({k: v for k, v in record.items() if k != "stalled"}), flush=True)
                finally:
                    servers.close()
        finally:
            workers.close()
    except BaseException:
        print(f"fanout: the servers' stores and the workers' logs are kept in {base}", file=sys.stderr)
        raise
    else:
        shutil.rmtree(base, ignore_errors=True)
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": _machine(),
        "duration_s": time.monotonic() - begun,
        "trials": trials,
    }
    (args.out / "fanout.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "fanout.md").write_text(_report(result))
    print((args.out / "fanout.md").read_text())
    if any(t.get("error") or t.get("lost") for t in trials):
        raise SystemExit("fanout: some trial failed or lost versions (see the report)")


if __name__ == "__main__":
    main()
