"""Benchmark: the share of a training step spent in weightbus, from a real ``weightbus demo`` run.

Runs ``weightbus demo`` (NATS, 2 reference engines, the SGLang router, rollout, trainer, recorder: separate
processes) and keeps, from its ``report.json``, each step's time split as the trainer measured it (see
``weightbus.rl.trainer``): weightbus's own time (``update()`` less its engine HTTP and the push, plus the rollout's
wait for its tracker and the drain's own run time), the engines' HTTP time inside ``update()``, and the trainer's
push. Results: ``bench/results/demo-overhead.json`` and ``demo-overhead.md`` (target: weightbus's own share < 1 %).

Usage: python bench/demo_overhead.py [--steps N] [--seed S] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"
#: Per-step fields of the demo's report.json kept here, in seconds there and in milliseconds here.
STEP_FIELDS = (
    "step_s",
    "weightbus_s",
    "engine_http_s",
    "update_s",
    "update_own_s",
    "push_s",
    "rollout_wait_s",
    "drain_s",
    "batch_wait_s",
)
SUMMARY_FIELDS = (
    "steps",
    "final_version",
    "reward_first",
    "reward_last",
    "wall_s",
    "weightbus_share",
    "engine_http_share",
    "push_share",
    "step_ms_mean",
    "weightbus_ms_mean",
    "weightbus_ms_p50",
    "weightbus_ms_p99",
    "engine_http_ms_mean",
    "update_ms_mean",
    "update_own_ms_mean",
    "push_ms_mean",
    "rollout_wait_ms_mean",
    "drain_ms_mean",
)


def _markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        "# weightbus demo: where a training step's time goes",
        "",
        f"`{' '.join(result['command'])}`: {s['steps']} steps in {s['wall_s']:.0f} s, reward "
        f"{s['reward_first']:.3f} → {s['reward_last']:.3f} (first → last quarter); {result['cpus']} CPUs, 1-min load "
        f"average {result['load_before']:.2f} before, {result['load_after']:.2f} after; invariants "
        f"{'held' if result['ok'] else 'BROKEN'}.",
        "",
        "| per step | mean ms | share of step time |",
        "|---|---|---|",
        f"| whole step | {s['step_ms_mean']:.1f} | 100 % |",
        f"| **weightbus's own** | {s['weightbus_ms_mean']:.2f} | **{s['weightbus_share'] * 100:.2f} %** |",
        f"| … in update() (fence read beside the pause, WeightUpdated, WeightApplied beside the resume, Python) | "
        f"{s['update_own_ms_mean']:.2f} | |",
        f"| … rollout: wait for the tracker to hold the new version | {s['rollout_wait_ms_mean']:.2f} | |",
        f"| … rollout: the drain's own run time | {s['drain_ms_mean']:.2f} | |",
        f"| engines' HTTP inside update() (pause, labels, stamp read-back, resume) | {s['engine_http_ms_mean']:.2f} | "
        f"{s['engine_http_share'] * 100:.1f} % |",
        f"| the trainer's push (write weights, /update_weights_from_disk) | {s['push_ms_mean']:.2f} | "
        f"{s['push_share'] * 100:.1f} % |",
        "",
        f"weightbus's own time per step: p50 {s['weightbus_ms_p50']:.2f} ms, p99 {s['weightbus_ms_p99']:.2f} ms.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    # A clean run: the faults' recoveries (a failover's redone step, a NATS restart) are not a step's normal cost.
    command = ["weightbus", "demo", "--steps", str(args.steps), "--seed", str(args.seed), "--no-faults"]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="weightbus-demo-overhead-") as tmp:
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "weightbus.cli", *command[1:], "--out", tmp], capture_output=True, text=True
        )
        took = time.monotonic() - started
        report_path = Path(tmp) / "report.json"
        if not report_path.exists():
            sys.exit(f"weightbus demo wrote no report (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        report = json.loads(report_path.read_text())
    summary = report["summary"]
    result = {
        "command": command,
        "exit_code": proc.returncode,
        "ok": report["ok"],
        "problems": {name: p for name, p in report["problems"].items() if p},
        "run_s": took,
        "summary": {key: summary.get(key) for key in SUMMARY_FIELDS},
        "printed": proc.stdout.strip().splitlines()[-5:],
        "steps": [
            {"step": row["step"], **{f"{key[:-2]}_ms": (row.get(key) or 0.0) * 1000 for key in STEP_FIELDS}}
            for row in report["steps"]
        ],
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo-overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "demo-overhead.md").write_text(_markdown(result))
    print(_markdown(result))
    print(f"wrote {args.out}/demo-overhead.json, .md")
    if proc.returncode != 0:
        sys.exit(f"weightbus demo exited {proc.returncode}: {result['problems']}")


if __name__ == "__main__":
    main()
