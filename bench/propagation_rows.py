"""The propagation benchmark's rows: the services each row needs, its publisher, and one trial of it.

Used by ``bench/propagation.py`` (see its docstring for what each row measures). A trial commands M subscriber
processes (``bench/propagation_worker.py``, started once and kept), publishes N versions ``--interval`` apart,
and turns what each subscriber recorded into latencies (wall time when it first held ``>= v`` minus the wall
time before ``v`` was published) and the versions it never saw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from weightbus.bus import connect, subjects
from weightbus.bus.nats import DEFAULT_STREAM
from weightbus.embedded.server import free_port
from weightbus.process.eventloop import run as run_loop
from weightbus.producers import VersionPublisher
from weightbus.producers.publisher import MARK_DELAY

__all__ = [
    "POLL_TTL",
    "ROWS",
    "RedisServer",
    "VersionServer",
    "Workers",
    "ensure_raw_stream",
    "ensure_weightbus_stream",
    "publish_weightbus",
    "quantiles",
    "run_trial",
]

WORKER = Path(__file__).parent / "propagation_worker.py"
ROWS = ("weightbus", "weightbus_mark_now", "nats_core", "jetstream", "jetstream_events", "redis", "http_poll")
RAW_STREAM = "BENCH"
POLL_TTL = 1.0


# -- services ------------------------------------------------------------------------------------------------------


class VersionServer:
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

    def __enter__(self) -> VersionServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class RedisServer:
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

    def __enter__(self) -> RedisServer:
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


class Workers:
    """The subscriber processes (``worker``, the propagation benchmark's by default), started once; a trial uses
    the first M."""

    def __init__(self, count: int, log_dir: Path, gc_freeze: bool, worker: Path = WORKER) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.logs = [log_dir / f"worker-{i}.log" for i in range(count)]
        args = [sys.executable, str(worker)] + (["--gc-freeze"] if gc_freeze else [])
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
        self.command_each(m, [cmd] * m)

    def command_each(self, m: int, cmds: list[dict[str, Any]]) -> None:
        """Send ``cmds[i]`` to worker ``i`` of the first ``m`` and wait until each says it is subscribed."""
        for proc, cmd in zip(self.procs[:m], cmds, strict=True):
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


async def publish_weightbus(
    url: str, policy: str, n: int, interval: float, mark_delay: float = MARK_DELAY
) -> tuple[list[int], list[float]]:
    bus = await connect(url, name="bench-publisher")
    sent: list[int] = []
    calls: list[float] = []
    try:
        pub = await VersionPublisher(bus, policy, mark_delay=mark_delay).start()
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
        await bus.aclose()
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


def _publish_poll(server: VersionServer, n: int, interval: float) -> tuple[list[int], list[float]]:
    sent: list[int] = []
    start = time.monotonic()
    for i in range(n):
        time.sleep(_pace(start, i, interval))
        sent.append(time.time_ns())
        server.version = i + 1
    return sent, [0.0] * n


async def ensure_raw_stream(url: str) -> None:
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


def quantiles(values: list[float]) -> dict[str, float | int | None]:
    if len(values) < 2:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "samples": len(values)}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": q[49], "p99_ms": q[98], "max_ms": max(values), "samples": len(values)}


def run_trial(
    row: str, m: int, n: int, tag: str, args: argparse.Namespace, env: dict[str, Any]
) -> tuple[dict[str, Any], list[float]]:
    workers: Workers = env["workers"]
    redis_server: RedisServer = env["redis"]
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
        sent, calls = run_loop(publish_weightbus(env["nats"], cmd["policy"], n, args.interval))
    elif row == "weightbus_mark_now":
        # The counter's mark written right after each announcement (mark_delay=0), as before the delay.
        sent, calls = run_loop(publish_weightbus(env["nats"], cmd["policy"], n, args.interval, mark_delay=0.0))
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
    record.update(quantiles(latencies))
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


async def ensure_weightbus_stream(url: str) -> None:
    bus = await connect(url, name="bench-setup")
    await bus.aclose()
