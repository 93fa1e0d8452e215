"""Benchmark: how many groups per second the staleness stage judges, against miles' old per-group poll.

The stage judges N groups of 8 samples against an in-memory current version (labels pre-parsed when
the samples are built), through the drain engine (``DrainWindow``) as ``judge_groups`` does; the
``FullyAsyncBuffer`` line times one ``drain`` of the same groups already buffered (the engine's
per-group ``take``), for information. The old approach (miles before #2244) asked the router for the version with
one ``GET /model_info`` per drained group; here that is a sync ``httpx.Client`` with keep-alive
against a local stdlib ``ThreadingHTTPServer`` answering ``{"weight_version": "10"}``, plus the same
comparison. Results go to stdout and ``bench/results/drain.json``. Stdlib, weightbus and httpx only.

``--profile`` also writes ``drain-profile.txt``: cProfile's top functions for one ``judge`` and one buffer
``drain`` of the same groups (docs/benchmarks.md#staleness-stage says where the time goes).

Usage: python bench/drain.py [--groups N] [--http-groups M] [--repeat R] [--out DIR] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import math
import os
import platform
import pstats
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from fleet import machine as describe_machine  # one description of the machine for every benchmark
from prometheus_client import CollectorRegistry

from weightbus.consumers import FullyAsyncBuffer, StalenessMetrics, StalenessStage
from weightbus.consumers.drain.window import DrainWindow
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

SAMPLES_PER_GROUP = 8
CURRENT = 10
MAX_STALENESS = 2
RESULTS = Path(__file__).parent / "results" / "drain.json"


def build_groups(n: int) -> list[Group]:
    """``n`` completed groups of 8 two-turn samples; group ``i`` started at ``CURRENT - i % 4``.

    Staleness is 0 to 3, so a quarter of the groups exceed ``MAX_STALENESS`` and are dropped.
    """
    groups = []
    for i in range(n):
        base = CURRENT - i % 4
        samples = [
            Sample(
                index=i * SAMPLES_PER_GROUP + j,
                weight_versions=[str(base), str(min(CURRENT, base + j % 2))],
                status=SampleStatus.COMPLETED,
            )
            for j in range(SAMPLES_PER_GROUP)
        ]
        groups.append(Group(prompt_index=i, samples=samples, status=SampleStatus.COMPLETED))
    return groups


def bench_stage(n: int, repeat: int) -> dict[str, float]:
    groups = build_groups(n)
    metrics = StalenessMetrics(CollectorRegistry()).for_policy("bench")
    stage = StalenessStage(max_staleness=MAX_STALENESS, on_stale="drop", metrics=metrics)
    best = float("inf")
    kept = 0
    for _ in range(repeat):
        start = time.perf_counter()
        judgement = stage.judge(groups, CURRENT)
        best = min(best, time.perf_counter() - start)
        kept = judgement.stats.kept
    return {"groups": n, "seconds": best, "groups_per_s": n / best, "kept": kept}


def _walk(groups: list[Group]) -> None:
    for group in groups:
        for _ in group.samples:
            pass


def _labels_only(groups: list[Group]) -> None:
    # The drain's scan before the waste and bias accounts: the cached label summary of each sample.
    for group in groups:
        lo, hi, flags = math.inf, -1, 0
        for sample in group.samples:
            f, o, n = sample._v
            if o < lo:
                lo = o
            if n > hi:
                hi = n
            flags |= f


def _with_accounts(groups: list[Group]) -> None:
    # The scan with the accounts' inputs: response tokens and rewards (DrainTally.add_many's loop).
    for group in groups:
        lo, hi, flags, tokens, rewarded, reward_sum = math.inf, -1, 0, 0, 0, 0.0
        for sample in group.samples:
            f, o, n = sample._v
            if o < lo:
                lo = o
            if n > hi:
                hi = n
            flags |= f
            tokens += sample.response_length
            r = sample.reward
            if r is not None:
                reward_sum += r
                rewarded += 1


def scan_floor(n: int, repeat: int = 3) -> dict[str, float]:
    """ns per group (best of ``repeat``) of the bare loops the judgement cannot do without, beside ``judge``."""
    groups = build_groups(n)
    stage = StalenessStage(
        max_staleness=MAX_STALENESS, on_stale="drop", metrics=StalenessMetrics(CollectorRegistry()).for_policy("b")
    )

    def add_many(gs: list[Group]) -> None:  # the scan, and keeping or counting stale each group
        window = DrainWindow(stage)
        window.begin(CURRENT).add_many(gs)

    def take_many(gs: list[Group]) -> None:  # and routing the stale ones (their waste)
        window = DrainWindow(stage)
        window.take_many(window.begin(CURRENT), gs)

    def take_close(gs: list[Group]) -> None:  # and settling the kept ones (the bias account's buckets)
        window = DrainWindow(stage)
        tally = window.begin(CURRENT)
        window.take_many(tally, gs)
        window.close(tally)

    loops = {
        "walk_samples": _walk,
        "scan_labels": _labels_only,
        "scan_labels_tokens_rewards": _with_accounts,
        "tally_add_many": add_many,
        "window_take_many": take_many,
        "window_take_many_close": take_close,
        "judge": lambda gs: stage.judge(gs, CURRENT),
    }
    out: dict[str, float] = {}
    for name, loop in loops.items():
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            loop(groups)
            best = min(best, time.perf_counter() - start)
        out[f"{name}_ns_per_group"] = 1e9 * best / n
    return out


def profile(n: int, top: int = 20) -> str:
    """cProfile's top functions (by own time) for one ``judge`` and one buffer ``drain`` of ``n`` groups."""
    out = io.StringIO()
    groups = build_groups(n)
    stage = StalenessStage(
        max_staleness=MAX_STALENESS, on_stale="drop", metrics=StalenessMetrics(CollectorRegistry()).for_policy("b")
    )
    stage.judge(groups, CURRENT)  # warm
    prof = cProfile.Profile()
    prof.enable()
    stage.judge(groups, CURRENT)
    prof.disable()
    floor = scan_floor(n)
    out.write(f"## ns per group of {SAMPLES_PER_GROUP} samples, best of 3, side by side (no profiler)\n\n")
    for name, ns in floor.items():
        out.write(f"{name:>40}: {ns:8.0f} ns\n")
    out.write(f"\n## StalenessStage.judge of {n:,} groups of {SAMPLES_PER_GROUP}\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)

    async def drain_once() -> None:
        metrics = StalenessMetrics(CollectorRegistry()).for_policy("b")
        stage = StalenessStage(max_staleness=MAX_STALENESS, on_stale="drop", metrics=metrics)
        buffer = FullyAsyncBuffer(n, stage=stage)
        for group in build_groups(n):
            await buffer.put(group)
        prof.enable()
        await buffer.drain(n - n // 4, CURRENT)
        prof.disable()

    prof = cProfile.Profile()
    asyncio.run(drain_once())
    out.write(f"## FullyAsyncBuffer.drain of {n:,} buffered groups of {SAMPLES_PER_GROUP}\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    # Paths relative to the checkout, so the committed file does not name this machine's directories.
    root = str(Path(__file__).resolve().parents[1]) + "/"
    text = out.getvalue().replace(root, "")
    for prefix in {sys.prefix, sys.base_prefix}:
        text = text.replace(prefix + "/", "")
    return text


def bench_buffer(n: int, repeat: int) -> dict[str, float]:
    """One ``FullyAsyncBuffer.drain`` of every kept group, the ``n`` groups buffered beforehand (not timed)."""

    async def once() -> tuple[float, int]:
        groups = build_groups(n)
        metrics = StalenessMetrics(CollectorRegistry()).for_policy("bench")
        stage = StalenessStage(max_staleness=MAX_STALENESS, on_stale="drop", metrics=metrics)
        buffer = FullyAsyncBuffer(n, stage=stage)
        for group in groups:
            await buffer.put(group)
        kept = n - n // 4  # a quarter is stale (see build_groups)
        start = time.perf_counter()
        drain = await buffer.drain(kept, CURRENT)
        return time.perf_counter() - start, drain.stats.kept

    best = float("inf")
    kept = 0
    for _ in range(repeat):
        seconds, kept = asyncio.run(once())
        best = min(best, seconds)
    return {"groups": n, "seconds": best, "groups_per_s": n / best, "kept": kept}


class _ModelInfo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the router serves it
    # Headers and body go out in two writes; without TCP_NODELAY, Nagle plus delayed ACKs add
    # ~40 ms per request, which would flatter the comparison.
    disable_nagle_algorithm = True
    body = json.dumps({"weight_version": str(CURRENT), "model_path": "bench"}).encode()

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        return  # one line per request would dominate the measurement


def bench_http_poll(n: int) -> dict[str, float]:
    """miles' pre-#2244 drain: one GET /model_info per group, then the same staleness check."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ModelInfo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/model_info"
    groups = build_groups(n)
    kept = 0
    try:
        with httpx.Client() as client:
            client.get(url).raise_for_status()  # open the connection outside the timing
            start = time.perf_counter()
            for group in groups:
                current = int(client.get(url).json()["weight_version"])
                oldest = min(int(v) for s in group.samples for v in s.weight_versions if v.isdigit())
                if current - oldest <= MAX_STALENESS:
                    kept += 1
            seconds = time.perf_counter() - start
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    return {"groups": n, "seconds": seconds, "groups_per_s": n / seconds, "kept": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200_000)
    parser.add_argument("--http-groups", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS.parent, help="directory for drain.json")
    parser.add_argument("--profile", action="store_true", help="also write drain-profile.txt")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    stage = bench_stage(args.groups, args.repeat)
    buffer = bench_buffer(args.groups, min(args.repeat, 3))
    http = bench_http_poll(args.http_groups)
    ratio = stage["groups_per_s"] / http["groups_per_s"]
    print(f"stage (in-memory version, pre-parsed labels): {stage['groups_per_s']:>12,.0f} groups/s")
    print(f"FullyAsyncBuffer.drain (groups buffered):     {buffer['groups_per_s']:>12,.0f} groups/s")
    print(f"old   (GET /model_info per group, keep-alive): {http['groups_per_s']:>12,.0f} groups/s")
    print(f"ratio: {ratio:,.0f}x  (target for the stage: >= 300,000 groups/s)")
    print(f"1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after (2 cores: above 2 is shared)")
    result = {
        "samples_per_group": SAMPLES_PER_GROUP,
        "stage": stage,
        "buffer_drain": buffer,
        "http_poll": http,
        "ratio": ratio,
        "target_groups_per_s": 300_000,
        "meets_target": stage["groups_per_s"] >= 300_000,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu_model": describe_machine()["cpu_model"],
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / RESULTS.name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / RESULTS.name}")
    if args.profile:
        (args.out / "drain-profile.txt").write_text(profile(min(args.groups, 50_000)))
        print(f"wrote {args.out / 'drain-profile.txt'}")


if __name__ == "__main__":
    main()
