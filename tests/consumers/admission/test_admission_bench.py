"""``bench/admission.py`` still runs against the current API and records what it claims (a small run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "admission.py"

pytestmark = [pytest.mark.slow, pytest.mark.nats]


def test_the_admission_bench_runs_and_never_exceeds_the_allowance(tmp_path: Path) -> None:
    args = [sys.executable, str(BENCH), "--n", "2000", "--seconds", "0.5", "--out", str(tmp_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "admission.json").read_text())
    assert set(result["in_process"]) == {
        "try_acquire_release_us",
        "noop_call_us",
        "async_with_slot_us",
        "async_with_noop_us",
    }
    for run in result["shared"].values():
        if isinstance(run, dict):
            assert run["groups"] > 0 and run["peak_used"] <= run["allowance"]
