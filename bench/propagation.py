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
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from weightbus.bus import connect, subjects
from weightbus.bus.nats import DEFAULT_STREAM
from weightbus.embedded.server import EmbeddedNats, free_port
from weightbus.process.eventloop import EVENT_LOOP_ENV, loop_name
from weightbus.process.eventloop import run as run_loop
from weightbus.producers import VersionPublisher

RESULTS_DIR = Path(__file__).parent / "results"
WORKER = Path(__file__).parent / "propagation_worker.py"
ROWS = ("weightbus", "nats_core", "jetstream", "jetstream_events", "redis", "http_poll")
LABELS = {
    "weightbus": "weightbus VersionPublisher → VersionTracker",
    "nats_core": "raw NATS core pub/sub",
    "jetstream": "raw JetStream ordered consumer (last per subject)",
    "jetstream_events": "raw JetStream ordered consumer of weightbus's own events",
    "redis": "Redis Streams XADD → XREAD BLOCK",
    "http_poll": "HTTP /model_info poll, 1 s TTL",
}
RAW_STREAM = "BENCH"
POLL_TTL = 1.0
# Versions per trial for each M, so that 3 repeats x 6 rows x 3 M (with drain and update) stay under 15 minutes on
# 2 cores: at M = 64 each version is 64 deliveries, and the subscribers share the 2 cores with the server.
DEFAULT_VERSIONS = {1: 500, 8: 500, 64: 500}
TARGETS = {
    "weightbus_over_jetstream_p50_max": 1.3,
    "poll_over_weightbus_p50_min": 250.0,
}


# -- services ------------------------------------------------------------------------------------------------------


class _VersionServer:
    """``GET /model_info`` answers the version the trainer set last, as a router would."""

    def __init__(self) -> None:
        self.version = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes; Nagle would add ~40 ms

            def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
                body = json.dumps({"weight_version": str(outer.version)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
                return

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256  # 64 subscribers connect at once; the default backlog of 5 drops SYNs

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _VersionServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class _Redis:
    """A throwaway ``redis-server`` on a free loopback port, persistence off; ``absent`` says why there is none."""

    def __init__(self) -> None:
        self.absent: str | None = None
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.version: str | None = None
        self.binary = shutil.which("redis-server")
        try:
            import redis  # noqa: F401
        except ImportError:
            self.absent = "the redis client is not installed (pip install -e '.[bench]')"
        if self.binary is None:
            self.absent = "redis-server not found (Debian: apt-get install redis-server)"

    def __enter__(self) -> _Redis:
        if self.absent is not None:
            return self
        import redis

        assert self.binary is not None
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                self.version = str(client.info("server")["redis_version"])
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.absent = f"redis-server did not start on port {self.port}"
                    break
                time.sleep(0.02)  # polling the port: redis-server has no readiness signal of its own
            finally:
                client.close()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


class _Workers:
    """The subscriber processes, started once; a trial uses the first M."""

    def __init__(self, count: int, log_dir: Path, gc_freeze: bool) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.logs = [log_dir / f"worker-{i}.log" for i in range(count)]
        args = [sys.executable, str(WORKER)] + (["--gc-freeze"] if gc_freeze else [])
        try:
            for i in range(count):
                with open(self.logs[i], "w") as log:
                    self.procs.append(
                        subprocess.Popen(
                            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1
                        )
                    )
            for proc in self.procs:
                self._expect(proc, "started")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _expect(proc: subprocess.Popen[str], key: str) -> dict[str, Any]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"subscriber process {proc.pid} exited (code {proc.wait()}); see its log")
        message: dict[str, Any] = json.loads(line)
        if key not in message:
            raise RuntimeError(f"subscriber process {proc.pid}: {message.get('error')}")
        return message

    def command(self, m: int, cmd: dict[str, Any]) -> None:
        """Send ``cmd`` to the first ``m`` workers and wait until each says it is subscribed."""
        for proc in self.procs[:m]:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        for proc in self.procs[:m]:
            self._expect(proc, "ready")

    def results(self, m: int) -> list[dict[str, Any]]:
        return [self._expect(proc, "recv") for proc in self.procs[:m]]

    def close(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- publishers: each returns the wall time (ns) just before the publish call of v, and each call's duration -------


def _pace(start: float, i: int, interval: float) -> float:
    return max(0.0, start + i * interval - time.monotonic())


async def _publish_weightbus(url: str, policy: str, n: int, interval: float) -> tuple[list[int], list[float]]:
    bus = await connect(url, name="bench-publisher")
    sent: list[int] = []
    calls: list[float] = []
    try:
        pub = await VersionPublisher(bus, policy).start()
        start = time.monotonic()
        for i in range(n):
            await asyncio.sleep(_pace(start, i, interval))
            async with pub.update() as version:
                # The clock starts where a trainer's push ends: what follows (ownership, stamps, the
                # announcement) is the update's critical path; the reservation overlaps the pause and push.
                t = time.time_ns()
                t0 = time.perf_counter()
            calls.append(time.perf_counter() - t0)
            if version != i + 1:
                raise RuntimeError(f"the publisher gave version {version}, expected {i + 1}")
            sent.append(t)
    finally:
        await bus.close()
    return sent, calls


async def _publish_nats(
    url: str, subject: str, n: int, interval: float, jetstream: bool
) -> tuple[list[int], list[float]]:
    import nats

    nc = await nats.connect(url, name="bench-publisher-raw")
    sent: list[int] = []
    calls: list[float] = []
    try:
        js = nc.jetstream()
        start = time.monotonic()
        for i in range(n):
            await asyncio.sleep(_pace(start, i, interval))
            payload = str(i + 1).encode()
            t = time.time_ns()
            t0 = time.perf_counter()
            if jetstream:
                await js.publish(subject, payload, stream=RAW_STREAM)
            else:
                await nc.publish(subject, payload)
            calls.append(time.perf_counter() - t0)
            sent.append(t)
        await nc.flush()
    finally:
        await nc.close()
    return sent, calls


def _publish_redis(port: int, key: str, n: int, interval: float) -> tuple[list[int], list[float]]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    sent: list[int] = []
    calls: list[float] = []
    try:
        start = time.monotonic()
        for i in range(n):
            time.sleep(_pace(start, i, interval))
            t = time.time_ns()
            t0 = time.perf_counter()
            client.xadd(key, {"v": i + 1}, maxlen=1000, approximate=True)
            calls.append(time.perf_counter() - t0)
            sent.append(t)
    finally:
        client.close()
    return sent, calls


def _publish_poll(server: _VersionServer, n: int, interval: float) -> tuple[list[int], list[float]]:
    sent: list[int] = []
    start = time.monotonic()
    for i in range(n):
        time.sleep(_pace(start, i, interval))
        sent.append(time.time_ns())
        server.version = i + 1
    return sent, [0.0] * n


async def _ensure_raw_stream(url: str) -> None:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(url)
    try:
        # Same storage and per-subject history as weightbus's own stream, so only the client side differs.
        await nc.jetstream().add_stream(
            StreamConfig(name=RAW_STREAM, subjects=["bench.>"], storage=StorageType.FILE, max_msgs_per_subject=64)
        )
    finally:
        await nc.close()


# -- one trial ----------------------------------------------------------------------------------------------------


def _quantiles(values: list[float]) -> dict[str, float | int | None]:
    if len(values) < 2:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "samples": len(values)}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": q[49], "p99_ms": q[98], "max_ms": max(values), "samples": len(values)}


def _trial(
    row: str, m: int, n: int, tag: str, args: argparse.Namespace, env: dict[str, Any]
) -> tuple[dict[str, Any], list[float]]:
    workers: _Workers = env["workers"]
    redis_server: _Redis = env["redis"]
    record: dict[str, Any] = {"row": row, "M": m, "versions": n, "load_before": os.getloadavg()[0]}
    trial_start = time.monotonic()
    if row == "redis" and redis_server.absent is not None:
        record.update(error=f"absent: {redis_server.absent}", load_after=os.getloadavg()[0])
        return record, []
    timeout = n * args.interval + 30.0
    cmd: dict[str, Any] = {"row": row, "n": n, "timeout": timeout, "nats": env["nats"]}
    cmd.update(
        policy=f"bench-{tag}",
        weights_subject=subjects.weights(f"bench-{tag}"),
        weights_stream=DEFAULT_STREAM,
        subject=f"bench.{tag}.version",
        stream=RAW_STREAM,
        key=f"bench:{tag}",
        redis_port=redis_server.port,
        http_port=env["http"].port,
        ttl=POLL_TTL,
    )
    env["http"].version = 0  # before the subscribers' first poll: a fresh trial starts from nothing
    workers.command(m, cmd)
    if row in ("weightbus", "jetstream_events"):
        sent, calls = run_loop(_publish_weightbus(env["nats"], cmd["policy"], n, args.interval))
    elif row in ("nats_core", "jetstream"):
        sent, calls = run_loop(_publish_nats(env["nats"], cmd["subject"], n, args.interval, row == "jetstream"))
    elif row == "redis":
        sent, calls = _publish_redis(redis_server.port, cmd["key"], n, args.interval)
    else:
        sent, calls = _publish_poll(env["http"], n, args.interval)
    received = workers.results(m)
    failures = sorted({r["error"] for r in received if r["error"]})
    if failures:
        record.update(error="; ".join(failures), load_after=os.getloadavg()[0])
        return record, []
    latencies: list[float] = []
    lost = 0
    stalled = []
    for i, answer in enumerate(received):
        missing = 0
        for v, t in enumerate(answer["recv"], start=1):
            if t is None:
                missing += 1
            else:
                latencies.append((t - sent[v - 1]) / 1e6)
        if missing:
            # Which process stopped where, and what it logged: a lost version is a finding, not noise.
            held = max((v for v, t in enumerate(answer["recv"], start=1) if t is not None), default=0)
            log_tail = workers.logs[i].read_text(errors="replace")[-2000:]
            stalled.append({"worker": i, "held": held, "missing": missing, "log_tail": log_tail})
        lost += missing
    record.update(_quantiles(latencies))
    record.update(
        lost=lost,
        stalled=stalled,
        duration_s=time.monotonic() - trial_start,
        publish_call_p50_ms=1000 * statistics.median(calls),
        heavy_imports=sorted({m for r in received for m in r["heavy_imports"]}),
        subscriber_cpu_us_per_version=1e6 * statistics.median(r["cpu_s"] for r in received) / n,
        load_after=os.getloadavg()[0],
        error=None,
    )
    return record, latencies


# -- report -------------------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _summary(pooled: dict[tuple[str, int], list[float]], trials: list[dict[str, Any]], ms: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in ROWS:
        out[row] = {}
        for m in ms:
            mine = [t for t in trials if t["row"] == row and t["M"] == m]
            errors = sorted({t["error"] for t in mine if t.get("error")})
            stats = _quantiles(pooled.get((row, m), []))
            stats.update(
                lost=sum(t.get("lost", 0) for t in mine),
                trial_p50_ms=[t.get("p50_ms") for t in mine],
                subscriber_cpu_us_per_version=_median([t.get("subscriber_cpu_us_per_version") for t in mine]),
                load=[t["load_before"] for t in mine],
                error="; ".join(errors) or None,
            )
            out[row][str(m)] = stats
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratios(summary: dict[str, Any], ms: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in ms:
        key = str(m)
        wb, js, rd, poll = (summary[r][key] for r in ("weightbus", "jetstream", "redis", "http_poll"))
        out[key] = {
            "weightbus_over_jetstream_p50": _ratio(wb["p50_ms"], js["p50_ms"]),
            "weightbus_over_redis_p50": _ratio(wb["p50_ms"], rd["p50_ms"]),
            "weightbus_over_redis_p99": _ratio(wb["p99_ms"], rd["p99_ms"]),
            "poll_over_weightbus_p50": _ratio(poll["p50_ms"], wb["p50_ms"]),
        }
        r = out[key]
        out[key]["targets_met"] = {
            "p50 <= 1.3x jetstream": _le(
                r["weightbus_over_jetstream_p50"], TARGETS["weightbus_over_jetstream_p50_max"]
            ),
            "p50 below redis": _lt(r["weightbus_over_redis_p50"], 1.0),
            "p99 below redis": _lt(r["weightbus_over_redis_p99"], 1.0),
            "poll p50 >= 250x": _ge(r["poll_over_weightbus_p50"], TARGETS["poll_over_weightbus_p50_min"]),
        }
    return out


def _le(x: float | None, y: float) -> bool | None:
    return None if x is None else x <= y


def _lt(x: float | None, y: float) -> bool | None:
    return None if x is None else x < y


def _ge(x: float | None, y: float) -> bool | None:
    return None if x is None else x >= y


def _fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


def _markdown(result: dict[str, Any]) -> str:
    ms = result["config"]["subscribers"]
    summary, ratios = result["summary"], result["ratios"]
    lines = [
        "# Propagation: publish call → subscriber holds the version",
        "",
        f"{result['config']['repeats']} repeats, rows interleaved; one publisher, a version every "
        f"{1000 * result['config']['interval_s']:g} ms; versions per trial by M: "
        + ", ".join(f"M={m}: {n}" for m, n in result["config"]["versions"].items())
        + f". Machine: {result['machine']['cpus']} CPUs, 1-min load average {result['machine']['load_min']:.2f}"
        f"–{result['machine']['load_max']:.2f} during the trials; {result['machine']['note']} Event loop of the "
        f"publisher and every NATS row's subscribers: {result['config'].get('event_loop', 'asyncio')}; the Redis "
        "row's client blocks on its socket, the poll row sleeps.",
        "",
        "p50 / p99 / max in ms, pooled over every subscriber, version and repeat:",
        "",
        "| row | " + " | ".join(f"M = {m}" for m in ms) + " |",
        "|---|" + "---|" * len(ms),
    ]
    for row in ROWS:
        cells = []
        for m in ms:
            s = summary[row][str(m)]
            if s["p50_ms"] is None:
                cells.append(s["error"] or "no data")
            else:
                lost = f" ({s['lost']} lost)" if s["lost"] else ""
                cells.append(f"{_fmt(s['p50_ms'])} / {_fmt(s['p99_ms'])} / {_fmt(s['max_ms'])}{lost}")
        lines.append(f"| {LABELS[row]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Ratios (targets: weightbus p50 ≤ 1.3× JetStream, p50 and p99 below Redis, poll ≥ 250× weightbus):",
        "",
    ]
    lines += [
        "| M | weightbus / JetStream p50 | weightbus / Redis p50 | weightbus / Redis p99 | poll / weightbus p50 |"
    ]
    lines += ["|---|---|---|---|---|"]
    for m in ms:
        r = ratios[str(m)]
        cells = [
            _fmt(r[k]) + ("×" if r[k] is not None else "")
            for k in (
                "weightbus_over_jetstream_p50",
                "weightbus_over_redis_p50",
                "weightbus_over_redis_p99",
                "poll_over_weightbus_p50",
            )
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU one subscriber process spends per version, µs (median over processes and repeats; the HTTP poll "
        "spends it per poll, not per version):",
        "",
        "| row | " + " | ".join(f"M = {m}" for m in ms) + " |",
        "|---|" + "---|" * len(ms),
    ]
    for row in ROWS:
        cells = [_fmt(summary[row][str(m)]["subscriber_cpu_us_per_version"]) for m in ms]
        lines.append(f"| {LABELS[row]} | " + " | ".join(cells) + " |")
    lines += ["", f"Whole run: {result['duration_s']:.0f} s. Raw data: propagation.json; plot: propagation.png.", ""]
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no plot"
    ms = result["config"]["subscribers"]
    fig, ax = plt.subplots(figsize=(9, 5.6))
    width = 0.8 / len(ROWS)
    for i, row in enumerate(ROWS):
        xs = [j + (i - (len(ROWS) - 1) / 2) * width for j in range(len(ms))]
        p50 = [result["summary"][row][str(m)]["p50_ms"] or 0 for m in ms]
        p99 = [result["summary"][row][str(m)]["p99_ms"] or 0 for m in ms]
        bars = ax.bar(xs, p50, width, label=LABELS[row])
        ax.scatter(xs, p99, marker="_", s=200, color=bars.patches[0].get_facecolor(), zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(range(len(ms)), [f"M = {m} subscribers" for m in ms])
    ax.set_ylabel("publish → held, ms (bar: p50, tick: p99)")
    ax.set_title("Version propagation, same run, interleaved")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, frameon=False)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _print_ratios(result: dict[str, Any]) -> None:
    for m, r in result["ratios"].items():
        print(
            f"M={m:>3}: weightbus/JetStream p50 {_fmt(r['weightbus_over_jetstream_p50'])}x   "
            f"weightbus/Redis p50 {_fmt(r['weightbus_over_redis_p50'])}x p99 {_fmt(r['weightbus_over_redis_p99'])}x   "
            f"poll/weightbus p50 {_fmt(r['poll_over_weightbus_p50'])}x"
        )


# -- main ---------------------------------------------------------------------------------------------------------


def main() -> None:
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
    args = parser.parse_args()
    if args.replot:
        _write_reports(json.loads((args.out / "propagation.json").read_text()), args.out)
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
    trials: list[dict[str, Any]] = []
    pooled: dict[tuple[str, int], list[float]] = {}
    with contextlib.ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="weightbus-bench-")))
        server = stack.enter_context(EmbeddedNats())
        redis_server = stack.enter_context(_Redis())
        http = stack.enter_context(_VersionServer())
        asyncio.run(_ensure_raw_stream(server.url))
        # The weightbus stream is created once here, as an operator would; trackers then only read it.
        asyncio.run(_ensure_weightbus_stream(server.url))
        workers = _Workers(max(ms), log_dir, args.gc_freeze)
        stack.callback(workers.close)
        env = {"nats": server.url, "redis": redis_server, "http": http, "workers": workers}
        print(
            f"{max(ms)} subscriber processes ready in {time.monotonic() - started:.1f} s; versions per trial {versions}"
        )
        for repeat in range(args.repeats):
            for m in ms:
                order = rows[repeat % len(rows) :] + rows[: repeat % len(rows)]
                for row in order:
                    tag = f"r{repeat}m{m}{row.replace('_', '')}"
                    record, latencies = _trial(row, m, versions[m], tag, args, env)
                    record["repeat"] = repeat
                    trials.append(record)
                    pooled.setdefault((row, m), []).extend(latencies)
                    shown = record["error"] or (
                        f"p50 {_fmt(record['p50_ms'])} p99 {_fmt(record['p99_ms'])} max {_fmt(record['max_ms'])} ms"
                        f"{'  lost ' + str(record['lost']) if record['lost'] else ''}"
                    )
                    print(
                        f"[{repeat + 1}/{args.repeats}] M={m:<3} {row:10s} load {record['load_before']:5.2f}  {shown}"
                    )
        nats_version = subprocess.run([server.binary, "--version"], capture_output=True, text=True).stdout.strip()
    loads = [t[k] for t in trials for k in ("load_before", "load_after")]
    result: dict[str, Any] = {
        "config": {
            "subscribers": ms,
            "versions": {str(m): n for m, n in versions.items()},
            "repeats": args.repeats,
            "interval_s": args.interval,
            "rows": rows,
            "poll_ttl_s": POLL_TTL,
            "gc_freeze_in_subscribers": args.gc_freeze,
            "event_loop": loop_name(),
            "latency": "time.time_ns() when a subscriber first holds >= v, minus time.time_ns() before publishing v",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "nats_server": nats_version,
            "redis_server": redis_server.version or redis_server.absent,
            "load_min": min(loads),
            "load_max": max(loads),
            "load_at_start": load_at_start,
            "note": f"load {load_at_start:.2f} before the run started (other jobs); during a trial the M "
            "subscriber processes themselves count in the load average.",
        },
        "summary": _summary(pooled, trials, ms),
        "trials": trials,
        "duration_s": time.monotonic() - started,
    }
    result["ratios"] = _ratios(result["summary"], ms)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "propagation.json").write_text(json.dumps(result, indent=2) + "\n")
    _write_reports(result, args.out)


def _write_reports(result: dict[str, Any], out: Path) -> None:
    (out / "propagation.md").write_text(_markdown(result))
    problem = _plot(result, out / "propagation.png")
    print(_markdown(result))
    _print_ratios(result)
    if problem:
        print(problem)
    print(f"wrote {out}/propagation.json, .md" + ("" if problem else ", .png"))


async def _ensure_weightbus_stream(url: str) -> None:
    bus = await connect(url, name="bench-setup")
    await bus.close()


if __name__ == "__main__":
    main()
