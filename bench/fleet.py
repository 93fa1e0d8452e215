"""Benchmark: ``update()`` and convergence against fleets of N = 1, 8, 64, 256 engines, side by side in one run.

One process serves every engine (``bench/fake_sglang.py``: real HTTP on one port per engine, the 0.5.23 bodies,
each answer after ``--delay`` seconds, the injected engine latency); one ``VersionPublisher`` per N, each on its
own ``EngineFleet(urls)`` (the fleet's own shared, bounded HTTP client) and policy, all in this process, the Ns
taken in turn round by round (the order rotated) so they share the machine's conditions. Each round is
``async with pub.update() as v:`` (pause, read the labels, relabel ``pending:<v>``) around the trainer's push (one
``/update_weights_from_disk`` carrying ``weight_version=v`` per engine, at once), then stamp (a read-back),
announce, resume. A subscriber process records when the ``WeightUpdated`` and every ``WeightApplied`` arrive:
convergence is the last ``WeightApplied`` of ``v`` minus the announcement's ``published_at`` (one wall clock).

weightbus's control time is the update's wall time without the push; its own time subtracts the injected latency
on the critical path (one engine round trip for the pause, two for the label read and the relabel, one for the
read-back, one for the resume). Per phase: ``VersionUpdate.phases`` (``weightbus_update_phase_seconds``).
The fake server times and counts every request itself (arrival, answer, open connections, requests in flight).

Then, on the N = 256 fleet: one engine answering after ``--slow`` seconds, then one answering 500 to every route
(what the update does, and what the other 255 engines see), and the same fleet with ``max_in_flight=64``
(requests in flight bounded below the fleet: waves); before the rounds, one step of the biggest fleet through its
own clients and through one shared httpx pool. Results: ``bench/results/fleet.json`` and ``fleet.md``.

Usage: python bench/fleet.py [--sizes 1,8,64,256] [--rounds N] [--delay S] [--slow S] [--fault-rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from weightbus.bus import Deliver, connect, subjects
from weightbus.embedded.server import EmbeddedNats
from weightbus.engines.sglang import SGLangClient
from weightbus.errors import EngineError
from weightbus.process.eventloop import loop_name
from weightbus.process.eventloop import run as run_loop
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.producers.metrics import PublisherMetrics
from weightbus.schemas import WeightApplied, WeightUpdated

BENCH = Path(__file__).parent
RESULTS_DIR = BENCH / "results"
PHASES = ("take", "pause", "relabel", "push", "stamp", "announce", "resume")
#: Engine round trips on each phase's critical path (pending mode, a push that carries the version).
ROUND_TRIPS = {"take": 0, "pause": 1, "relabel": 2, "push": 1, "stamp": 1, "announce": 0, "resume": 1}
CONTROL_ROUND_TRIPS = sum(n for p, n in ROUND_TRIPS.items() if p != "push")


def machine() -> dict[str, Any]:
    """What the run ran on: CPUs, model, load, Python, loop."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "event_loop": loop_name(),
        "httpx": httpx.__version__,
        "sniffio": importlib.util.find_spec("sniffio") is not None,
    }


def _rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Server:
    """The fake fleet's process and its control port."""

    def __init__(self, engines: int, delay: float) -> None:
        cmd = [sys.executable, str(BENCH / "fake_sglang.py"), "--engines", str(engines), "--delay", str(delay)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        hello = json.loads(self.proc.stdout.readline() or "{}")
        if "control" not in hello:
            self.close()
            raise RuntimeError("the fake SGLang fleet did not start")
        self.control = f"http://127.0.0.1:{hello['control']}"
        self.ports: list[int] = hello["ports"]
        self.http = httpx.AsyncClient(base_url=self.control, timeout=30)
        self.seen = 0

    async def records(self) -> list[tuple[int, str, float, float, int]]:
        """The requests answered since the last call."""
        got = (await self.http.get("/_records", params={"since": self.seen})).json()
        self.seen = got["next"]
        return [tuple(r) for r in got["records"]]  # type: ignore[misc]

    async def stats(self) -> dict[str, int]:
        stats: dict[str, int] = (await self.http.get("/_stats")).json()
        return stats

    async def reset_peaks(self) -> None:
        (await self.http.post("/_reset")).raise_for_status()

    async def behave(self, ports: list[int], *, delay: float, fail: bool = False) -> None:
        (await self.http.post("/_behave", json={"ports": ports, "delay": delay, "fail": fail})).raise_for_status()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Subscriber:
    """A process that records when each ``WeightUpdated`` and ``WeightApplied`` arrives (``--subscribe``)."""

    def __init__(self, nats_url: str, path: Path) -> None:
        cmd = [sys.executable, str(Path(__file__)), "--subscribe", nats_url, "--receipts", str(path)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.path = path
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            self.close()
            raise RuntimeError("the receipt subscriber did not start")

    def close(self) -> list[dict[str, Any]]:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


async def _subscribe(nats_url: str, path: Path) -> None:
    bus = await connect(nats_url, name="bench-fleet-receipts")
    out = path.open("w")
    try:
        sub = bus.subscribe(f"{subjects.PREFIX}.>", deliver=Deliver.NEW)

        async def record() -> None:
            async for env in sub:
                event = env.event
                if isinstance(event, WeightUpdated | WeightApplied):
                    row = {
                        "kind": "applied" if isinstance(event, WeightApplied) else "updated",
                        "policy": event.policy,
                        "version": event.version,
                        "published_at": event.published_at,
                        "received_at": env.received_at,
                        "ok": getattr(event, "ok", True),
                    }
                    out.write(json.dumps(row) + "\n")

        task = asyncio.create_task(record())
        await asyncio.sleep(0.5)  # the ordered consumer's creation has no ack here; the warm-up rounds cover it
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
        await asyncio.sleep(0.5)  # the last round's read-backs are in flight: let them land
        task.cancel()
        await sub.aclose()
    finally:
        out.close()
        await bus.aclose()


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


async def _one_update(pub: VersionPublisher, fleet: EngineFleet, server: _Server) -> dict[str, Any]:
    """One update; its phases, and what the server saw of it."""
    await server.records()  # everything before this round
    server_cpu = (await server.stats())["cpu_s"]
    update = pub.update()
    cpu, push_cpu = time.process_time(), 0.0
    started = time.monotonic()
    error: str | None = None
    pushed = (0.0, 0.0)
    try:
        async with update as version:
            push_start, push_cpu = time.monotonic(), time.process_time()
            await asyncio.gather(
                *(c.update_weights_from_disk(f"/ckpt/step-{version}", weight_version=version) for c in fleet.clients)
            )
            pushed, push_cpu = (push_start, time.monotonic()), time.process_time() - push_cpu
    except EngineError as exc:
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    ended = time.monotonic()
    cpu = time.process_time() - cpu - push_cpu
    server_cpu = (await server.stats())["cpu_s"] - server_cpu
    rows = await server.records()
    control = [(a, b) for _, path, a, b, _ in rows if path != "/update_weights_from_disk"]
    wall = ended - started
    push = pushed[1] - pushed[0]
    return {
        "version": update.version,
        "error": error,
        "announced": update.event is not None,
        "quarantined": None if update.quarantined is None else update.quarantined.label,
        "wall_s": wall,
        "control_s": wall - push,
        "phases": dict(update.phases),
        "engine_busy_s": _union(control),  # control requests held by the server (at least one)
        "publisher_cpu_s": cpu,  # this process, the update without the trainer's push
        "server_cpu_s": server_cpu,  # the fake fleet's process, every request of the update (the push's too)
        "requests": len(rows),
        "by_path": {p: sum(1 for r in rows if r[1] == p) for p in sorted({r[1] for r in rows})},
        "rows": rows,
    }


def _peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one moment."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def _paused_windows(rows: list[tuple[int, str, float, float, int]], skip: set[int]) -> list[float]:
    """Per engine (but ``skip``): from its pause's answer to its resume's arrival, the time it generated nothing."""
    paused: dict[int, float] = {}
    windows: list[float] = []
    for port, path, arrived, answered, status in sorted(rows, key=lambda r: r[2]):
        if port in skip or status != 200:
            continue
        if path == "/pause_generation":
            paused[port] = answered
        elif path == "/continue_generation" and port in paused:
            windows.append(arrived - paused.pop(port))
    return windows


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": float("nan"), "p90_ms": float("nan"), "max_ms": float("nan")}
    ordered = sorted(values)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p90_ms": 1000 * ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))],
        "max_ms": 1000 * ordered[-1],
    }


async def _run(args: argparse.Namespace, nats_url: str, server: _Server, receipts: Path) -> dict[str, Any]:
    sizes: list[int] = args.sizes
    bus = await connect(nats_url, name="bench-fleet")
    registry = CollectorRegistry()
    metrics = PublisherMetrics(registry)
    out: dict[str, Any] = {"sizes": sizes}
    try:
        urls_all = [f"http://127.0.0.1:{p}" for p in server.ports]
        fleets: dict[int, EngineFleet] = {}
        pubs: dict[int, VersionPublisher] = {}
        offset = 0
        rss0, t0 = _rss_mib(), time.perf_counter()
        for n in sizes:
            fleets[n] = EngineFleet(urls_all[offset : offset + n], timeout=30)
            offset += n
        out["shared_client"] = {
            "engines": offset,
            "build_s": time.perf_counter() - t0,
            "rss_added_mib": _rss_mib() - rss0,
        }
        for n in sizes:
            pub = VersionPublisher(bus, f"fleet-{n}", fleet=fleets[n], pause="retract", metrics=metrics)
            pubs[n] = await pub.start()
        # Before the rounds, in a fresh process (the rounds' records make a large heap).
        out["clients"] = await _clients(fleets[max(sizes)], args.shared_repeats)
        records: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
        before: dict[str, int] = {}
        for i in range(args.warmup + args.rounds):
            if i == args.warmup:
                # After the warm-up: connections idle longer than httpx's keep-alive expiry (5 s) reopen there.
                await server.reset_peaks()
                before = await server.stats()
            order = sizes[i % len(sizes) :] + sizes[: i % len(sizes)]
            for n in order:
                record = await _one_update(pubs[n], fleets[n], server)
                if record["error"] is not None:
                    raise RuntimeError(f"a healthy update failed at N={n}: {record['error']}")
                if i >= args.warmup:
                    record["paused_window"] = _ms(_paused_windows(record.pop("rows"), set()))
                    records[n].append(record)
                else:
                    record.pop("rows")
        after = await server.stats()
        out["connections"] = {
            "engines": offset,
            "peak_open": after["peak_connections"],
            "accepted_during_rounds": after["accepted"] - before["accepted"],
            "peak_requests_in_flight": after["peak_in_flight"],
            "rss_mib": _rss_mib(),
        }
        out["healthy"] = records

        big = max(sizes)
        fleet, pub = fleets[big], pubs[big]
        ports = [int(url.rsplit(":", 1)[1]) for url in fleet.urls]
        faults: dict[str, Any] = {}
        # One slow engine among the biggest fleet.
        await server.behave([ports[0]], delay=args.slow)
        slow = []
        for _ in range(args.fault_rounds):
            record = await _one_update(pub, fleet, server)
            rows = record.pop("rows")
            record["paused_window_others"] = _ms(_paused_windows(rows, {ports[0]}))
            slow.append(record)
        await server.behave([ports[0]], delay=args.delay)
        faults["slow"] = {"engine": fleet.urls[0], "answer_s": args.slow, "rounds": slow}
        # One failing engine (500 on every route): the update fails; what the others see.
        await server.behave([ports[1]], delay=args.delay, fail=True)
        failing = []
        for _ in range(args.fault_rounds):
            record = await _one_update(pub, fleet, server)
            rows = record.pop("rows")
            record["paused_window_others"] = _ms(_paused_windows(rows, {ports[1]}))
            record["resumed_others"] = sum(1 for r in rows if r[1] == "/continue_generation" and r[0] != ports[1])
            record["relabelled_others"] = sum(1 for r in rows if r[1] == "/update_weight_version" and r[0] != ports[1])
            failing.append(record)
        await server.behave([ports[1]], delay=args.delay)
        recovered = await _one_update(pub, fleet, server)
        recovered.pop("rows")
        faults["failing"] = {"engine": fleet.urls[1], "rounds": failing, "next_update_after_repair": recovered}
        out["faults"] = faults

        # Requests in flight bounded below the fleet: a fresh fleet on the same engines, at most a quarter at once.
        limit = max(1, big // 4)
        async with EngineFleet(list(fleet.urls), max_in_flight=limit) as narrow:
            narrow_pub = await VersionPublisher(bus, f"fleet-{big}-narrow", fleet=narrow, pause="retract").start()
            await narrow.read_versions()  # its connections open outside the rounds
            await server.reset_peaks()
            bounded = []
            for _ in range(args.fault_rounds):
                record = await _one_update(narrow_pub, narrow, server)
                rows = record.pop("rows")
                # The trainer's push goes through the clients directly, beside the fleet's bound.
                control = [(a, b) for _, path, a, b, _ in rows if path != "/update_weights_from_disk"]
                record["peak_control_in_flight"] = _peak_overlap(control)
                bounded.append(record)
        out["bounded"] = {"engines": big, "max_in_flight": limit, "rounds": bounded}
        out["peak_rss_mib"] = _peak_rss_mib()
        # After the peak was read: one httpx.AsyncClient (one pool, one TLS context) per engine, as the previous
        # EngineFleet(urls) built them.
        rss0, t0 = _rss_mib(), time.perf_counter()
        per_engine = [SGLangClient(u) for u in urls_all[:big]]
        out["client_per_engine"] = {
            "engines": len(per_engine),
            "build_s": time.perf_counter() - t0,
            "rss_added_mib": _rss_mib() - rss0,
        }
        await asyncio.gather(*(c.aclose() for c in per_engine))
        out["update_phase_seconds_count"] = sum(
            s.value
            for family in registry.collect()
            if family.name == "weightbus_update_phase_seconds"
            for s in family.samples
            if s.name.endswith("_count") and s.labels.get("phase") == "pause"
        )
        for f in fleets.values():
            await f.aclose()
    finally:
        await bus.aclose()
    return out


async def _clients(fleet: EngineFleet, repeats: int) -> dict[str, Any]:
    """What one engine request costs this process, and one step of the fleet through one shared httpx pool.

    The fleet's own clients (a small pool per engine) and one ``httpx.AsyncClient`` for every engine, its pool as
    large as the fleet, take one ``read_versions`` step each, in turn; the process's CPU time is read around each.
    """
    n = len(fleet.urls)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    own: list[dict[str, float]] = []
    shared: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        pooled = EngineFleet([SGLangClient(u, http=http) for u in fleet.urls])
        await pooled.read_versions()  # its connections open outside the timing
        await fleet.read_versions()
        for _ in range(repeats):
            for target, rows in ((fleet, own), (pooled, shared)):
                c0, t0 = cpu(), time.perf_counter()
                labels = await target.read_versions()
                failed = sum(isinstance(v, EngineError) for v in labels.values())
                rows.append({"wall_s": time.perf_counter() - t0, "cpu_us_per_request": 1e6 * (cpu() - c0) / n})
                rows[-1]["failed"] = failed
    return {"engines": n, "own_pools": own, "one_shared_pool": shared}


def _convergence(receipts: list[dict[str, Any]], policy: str, version: int, engines: int) -> dict[str, Any]:
    updated = [r for r in receipts if r["kind"] == "updated" and r["policy"] == policy and r["version"] == version]
    applied = [r for r in receipts if r["kind"] == "applied" and r["policy"] == policy and r["version"] == version]
    if not updated or len(applied) < engines:
        return {"complete": False, "applied": len(applied)}
    announced = updated[0]["published_at"]
    return {
        "complete": True,
        "applied": len(applied),
        "announcement_s": updated[0]["received_at"] - announced,
        "first_applied_s": min(r["received_at"] for r in applied) - announced,
        "last_applied_s": max(r["received_at"] for r in applied) - announced,
    }


def _summarise(raw: dict[str, Any], receipts: list[dict[str, Any]], delay: float) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for n, records in raw["healthy"].items():
        conv = [_convergence(receipts, f"fleet-{n}", r["version"], int(n)) for r in records]
        done = [c for c in conv if c["complete"]]
        row: dict[str, Any] = {
            "rounds": len(records),
            "update_wall_p50_ms": 1000 * statistics.median(r["wall_s"] for r in records),
            "control_p50_ms": 1000 * statistics.median(r["control_s"] for r in records),
            "control_own_p50_ms": 1000
            * statistics.median(r["control_s"] - CONTROL_ROUND_TRIPS * delay for r in records),
            "engine_busy_p50_ms": 1000 * statistics.median(r["engine_busy_s"] for r in records),
            "publisher_cpu_p50_ms": 1000 * statistics.median(r["publisher_cpu_s"] for r in records),
            "publisher_cpu_per_engine_p50_us": 1e6 * statistics.median(r["publisher_cpu_s"] for r in records) / int(n),
            "server_cpu_p50_ms": 1000 * statistics.median(r["server_cpu_s"] for r in records),
            "requests_per_update": records[0]["by_path"],
            "paused_window_p50_ms": statistics.median(r["paused_window"]["p50_ms"] for r in records),
            "converged": f"{len(done)}/{len(conv)}",
            "convergence_p50_ms": 1000 * statistics.median(c["last_applied_s"] for c in done) if done else None,
            "announcement_p50_ms": 1000 * statistics.median(c["announcement_s"] for c in done) if done else None,
            "phases": {},
        }
        for phase in PHASES:
            wall = [r["phases"].get(phase, 0.0) for r in records]
            row["phases"][phase] = {
                "wall_p50_ms": 1000 * statistics.median(wall),
                "injected_ms": 1000 * ROUND_TRIPS[phase] * delay,
                "own_p50_ms": 1000 * statistics.median(w - ROUND_TRIPS[phase] * delay for w in wall),
            }
        summary[str(n)] = row
    small, big = summary[str(min(raw["sizes"]))], summary[str(max(raw["sizes"]))]
    ratios: dict[str, float | None] = {
        "update_wall": big["update_wall_p50_ms"] / small["update_wall_p50_ms"],
        "control": big["control_p50_ms"] / small["control_p50_ms"],
        "control_own": big["control_own_p50_ms"] / small["control_own_p50_ms"],
        "publisher_cpu": big["publisher_cpu_p50_ms"] / small["publisher_cpu_p50_ms"],
        "publisher_cpu_per_engine": big["publisher_cpu_per_engine_p50_us"] / small["publisher_cpu_per_engine_p50_us"],
        "server_cpu": big["server_cpu_p50_ms"] / small["server_cpu_p50_ms"],
    }
    for phase in PHASES:
        a, b = small["phases"][phase]["own_p50_ms"], big["phases"][phase]["own_p50_ms"]
        ratios[f"{phase}_own"] = b / a if a > 0 else None
    if small["convergence_p50_ms"] and big["convergence_p50_ms"]:
        ratios["convergence"] = big["convergence_p50_ms"] / small["convergence_p50_ms"]
    return {"by_size": summary, "ratio_biggest_over_smallest": ratios}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _markdown(result: dict[str, Any]) -> str:
    m, cfg, s = result["machine"], result["config"], result["summary"]
    sizes = [str(n) for n in cfg["sizes"]]
    small, big = sizes[0], sizes[-1]
    lines = [
        f"# update() against fleets of {', '.join(sizes)} engines (one fake SGLang process, real HTTP)",
        "",
        f"{cfg['rounds']} rounds per N after {cfg['warmup']} warm-up, the Ns taken in turn. Machine: {m['nproc']} "
        f"× {m['cpu_model']}, Python {m['python']}, {m['event_loop']}, httpx {m['httpx']} (sniffio "
        f"{'installed' if m['sniffio'] else 'missing'}). 1-min load average "
        f"{result['load_before']:.2f} before, {result['load_after']:.2f} after. Injected engine latency "
        f"{1000 * cfg['delay']:.0f} ms per answer ({CONTROL_ROUND_TRIPS} round trips on the control path).",
        "",
        "## Per phase, p50 ms (weightbus's own: wall minus the injected latency)",
        "",
        "| phase | " + " | ".join(f"N = {n}" for n in sizes) + f" | N = {big} / N = {small} |",
        "|---|" + "---|" * (len(sizes) + 1),
    ]
    ratios = s["ratio_biggest_over_smallest"]
    for phase in PHASES:
        cells = [
            f"{_fmt(cell['own_p50_ms'])} ({_fmt(cell['wall_p50_ms'])})"
            for cell in (s["by_size"][n]["phases"][phase] for n in sizes)
        ]
        ratio = ratios.get(f"{phase}_own")
        lines.append(f"| {phase} | " + " | ".join(cells) + f" | {_fmt(ratio)}× |")
    rows = [
        ("**control** (update wall minus the push)", "control_p50_ms", "control"),
        ("**control, own** (minus the injected latency)", "control_own_p50_ms", "control_own"),
        ("publisher CPU per update, control (without the push)", "publisher_cpu_p50_ms", "publisher_cpu"),
        ("publisher CPU per engine per update, µs", "publisher_cpu_per_engine_p50_us", "publisher_cpu_per_engine"),
        ("fake fleet's CPU per update (same cores; push included)", "server_cpu_p50_ms", "server_cpu"),
        ("whole update wall (with the push)", "update_wall_p50_ms", "update_wall"),
        ("convergence: announcement → last WeightApplied", "convergence_p50_ms", "convergence"),
    ]
    for label, key, rkey in rows:
        cells = [_fmt(s["by_size"][n][key]) for n in sizes]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_fmt(ratios.get(rkey))}× |")
    lines += [
        "",
        "Cells: own (wall). `take` overlaps `pause`; `push` is the trainer's; `resume` has the `WeightApplied` "
        "read-backs and the counter's mark beside it. Convergence is measured by a separate subscriber process.",
        "",
        "| N | engine requests per update | engines' paused window p50 ms | converged rounds |",
        "|---|---|---|---|",
    ]
    for n in sizes:
        row = s["by_size"][n]
        reqs = ", ".join(f"{p.lstrip('/')} ×{c}" for p, c in row["requests_per_update"].items())
        lines.append(f"| {n} | {reqs} | {_fmt(row['paused_window_p50_ms'])} | {row['converged']} |")
    raw = result["raw"]
    conn, cpe, sc = raw["connections"], raw["client_per_engine"], raw["shared_client"]
    lines += [
        "",
        "## Connections and memory",
        "",
        f"* {conn['engines']} engines over the {len(sizes)} fleets: peak {conn['peak_open']} open connections, "
        f"{conn['accepted_during_rounds']} accepted during the measured rounds (keep-alive: each engine's "
        f"connection is reused), peak {conn['peak_requests_in_flight']} requests in flight at the server.",
        f"* Building the {len(sizes)} fleets (`EngineFleet(urls)`: a small pool per engine, one TLS context): "
        f"{1000 * sc['build_s']:.1f} ms, +{sc['rss_added_mib']:.1f} MiB. One `httpx.AsyncClient` with its own "
        f"TLS context per engine (the previous `EngineFleet(urls)`), {cpe['engines']} engines: "
        f"{1000 * cpe['build_s']:,.0f} ms, +{cpe['rss_added_mib']:.1f} MiB.",
        f"* Peak RSS of the publisher process: {raw['peak_rss_mib']:.1f} MiB.",
    ]
    cl = raw["clients"]

    def steps(rows: list[dict[str, float]]) -> str:
        return ", ".join(
            f"{1000 * r['wall_s']:,.0f} ms ({r['cpu_us_per_request']:.0f} µs CPU a request, {r['failed']:.0f} failed)"
            for r in rows
        )

    lines += [
        f"* One `read_versions` step of {cl['engines']} engines through the fleet's own clients: "
        f"{steps(cl['own_pools'])}; through one `httpx.AsyncClient` whose pool holds {cl['engines']} "
        f"connections: {steps(cl['one_shared_pool'])}.",
    ]
    b = raw["bounded"]
    pause = [r["phases"]["pause"] for r in b["rounds"]]
    lines += [
        f"* N = {b['engines']} with `max_in_flight={b['max_in_flight']}`: at most "
        f"{max(r['peak_control_in_flight'] for r in b['rounds'])} control requests held by the server at once; "
        f"pause phase p50 {1000 * statistics.median(pause):.1f} ms (waves of {b['max_in_flight']}), control p50 "
        f"{1000 * statistics.median(r['control_s'] for r in b['rounds']):.1f} ms.",
        "",
        f"## One slow and one failing engine among {big}",
        "",
        "| case | update | wall ms | control ms | pause ms | others' paused window p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    faults = raw["faults"]
    for case, data in (("slow", faults["slow"]), ("failing", faults["failing"])):
        for r in data["rounds"]:
            outcome = "announced" if r["announced"] else f"failed ({(r['error'] or '').split(':')[0]})"
            if r.get("quarantined"):
                outcome += f", quarantined {r['quarantined']}"
            lines.append(
                f"| {case} | {outcome} | {_fmt(1000 * r['wall_s'], 1)} | {_fmt(1000 * r['control_s'], 1)} | "
                f"{_fmt(1000 * r['phases'].get('pause', 0.0), 1)} | {_fmt(r['paused_window_others']['p50_ms'], 1)} |"
            )
    rec = faults["failing"]["next_update_after_repair"]
    lines += [
        "",
        f"slow: {faults['slow']['engine']} answers every request after {faults['slow']['answer_s']:g} s. failing: "
        f"{faults['failing']['engine']} answers 500 to every route; the others were resumed "
        f"({', '.join(str(r['resumed_others']) for r in faults['failing']['rounds'])} continue_generation) and "
        f"relabelled {', '.join(str(r['relabelled_others']) for r in faults['failing']['rounds'])} times. The "
        f"next update once it answers again: {'announced' if rec['announced'] else 'failed'} "
        f"(v{rec['version']}, {1000 * rec['wall_s']:.1f} ms).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: sorted(int(x) for x in s.split(",")), default=[1, 8, 64, 256])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.005, help="seconds every engine takes to answer")
    parser.add_argument("--slow", type=float, default=2.0, help="seconds the slow engine takes to answer")
    parser.add_argument("--fault-rounds", type=int, default=2)
    parser.add_argument("--shared-repeats", type=int, default=3, help="steps through one shared httpx pool")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--subscribe", help=argparse.SUPPRESS)
    parser.add_argument("--receipts", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subscribe:
        run_loop(_subscribe(args.subscribe, args.receipts))
        return
    load_before = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    receipts_path = args.out / ".fleet-receipts.jsonl"
    with EmbeddedNats() as nats:
        server = _Server(sum(args.sizes), args.delay)
        subscriber = None
        try:
            subscriber = _Subscriber(nats.url, receipts_path)
            raw = run_loop(_run(args, nats.url, server, receipts_path))
        finally:
            receipts = subscriber.close() if subscriber is not None else []
            server.close()
    receipts_path.unlink(missing_ok=True)
    raw["healthy"] = {str(n): rows for n, rows in raw["healthy"].items()}
    result = {
        "config": {
            "sizes": args.sizes,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "delay": args.delay,
            "slow": args.slow,
            "fault_rounds": args.fault_rounds,
        },
        "machine": machine(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "summary": _summarise(raw, receipts, args.delay),
        "raw": raw,
    }
    (args.out / "fleet.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "fleet.md").write_text(_markdown(result))
    print(_markdown(result))
    print(f"wrote {args.out}/fleet.json, .md")


if __name__ == "__main__":
    main()
