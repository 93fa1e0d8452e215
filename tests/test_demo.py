"""The main job end to end: engines, trainer, tracker, buffer and NATS together (what `make demo` runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weightbus.demo import DemoConfig, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.nats]


async def test_demo_holds_every_invariant_on_the_session_nats(nats_url: str) -> None:
    lines: list[str] = []
    config = DemoConfig(steps=5, model="hash", nats_url=nats_url, failover_at=2, lora_at=4)
    result = await run_demo(config, emit=lines.append)
    assert result.problems == []
    assert [r.pushed for r in result.rows] == [2, 3, 4, 5, 6]
    assert [r.trainer for r in result.rows] == ["cell-0", "cell-1", "cell-1", "cell-1", "cell-1"]
    assert [r.push_kind for r in result.rows][3] == "lora"
    assert result.final_version == result.tracker_version == 6
    assert result.regressions == 1
    assert all(r.kept == config.batch for r in result.rows)
    # Every drain judged against a known version, never with the filter off.
    assert all(r.judged_at is not None for r in result.rows)
    assert any("FencedError" in line for line in lines)


def test_demo_command_exits_zero_and_narrates() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "weightbus.cli", "demo", "--model", "hash", "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "every invariant held" in run.stdout
    assert "cell-1 resumed at v" in run.stdout and "next version v" in run.stdout
