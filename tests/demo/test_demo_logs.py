"""The demo is the terminal's one writer: each child's output goes to ``OUT/logs/<name>.log``.

A short clean run prints nothing but the supervisor's own lines (no router or uvicorn line, no child's progress
line, nothing interleaved); a failed child's last lines are printed by the supervisor, with its log's path.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from weightbus.demo.children import Process
from weightbus.demo.supervisor import _show_failures
from weightbus.process.logs import LOG_LEVEL_ENV, choose_logging

_NUM = r"-?[\d.]+"
#: Every line the supervisor prints in a clean run, whole (a child's text spliced in would break the match).
_SUPERVISOR = [
    r"nats nats://127\.0\.0\.1:\d+  engines http://127\.0\.0\.1:\d+ http://127\.0\.0\.1:\d+  router http://\S+",
    r"training 2 steps, max_staleness 1, on_stale recycle, admission bounded, early abort on",
    r"faults: none \(--no-faults\)",
    r"logs: (?P<logs>\S+) \(one <name>\.log per process\)",
    rf"step +\d+  v\d+ +reward {_NUM}  staleness avg ({_NUM}|-) max (\d+|-) \(judged max (\d+|-)\)  "
    rf"kept \d+ recycled \d+ dropped \d+  "
    rf"lag ({_NUM}|-) ms  step \d+ ms \(weightbus {_NUM} ms, engines {_NUM} ms\)",
    r"",
    r"reward .+ \(first quarter\) -> .+ \(last quarter\); final v\d+; .+ not trained on; \d+ s",
    r"groups filtered for a non-version label .+; regression alerts for the rogue v1: \d+",
    r"step time: weightbus's own .+",
    r"report: \S+report\.json, \S+report\.png",
    r"held: [a-z_, ]+",
    r"vacuous \(not exercised by this run\): [a-z_, ]+",
]


def _supervisor_line(line: str) -> re.Match[str] | None:
    return next((m for m in (re.fullmatch(p, line) for p in _SUPERVISOR) if m is not None), None)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("sglang_router") is None,
    reason="the demo needs torch and sglang_router",
)
def test_a_short_demo_prints_only_the_supervisors_lines_and_logs_each_child_to_a_file(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "weightbus.cli", "demo", "--steps", "2", "--no-faults", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    strangers = [line for line in lines if _supervisor_line(line) is None]
    assert strangers == [], "\n".join(strangers)
    named = [m["logs"] for m in map(_supervisor_line, lines) if m is not None and m.re.pattern.startswith("logs")]
    assert named == [str(out / "logs")]
    logs = out / "logs"
    expected = {"engine-0", "engine-1", "router", "rollout-0", "trainer-0", "recorder", "nats"}
    assert {p.stem for p in logs.glob("*.log")} == expected
    assert "trainer step=2/2" in (logs / "trainer-0.log").read_text()
    assert "rollout batch=" in (logs / "rollout-0.log").read_text()
    assert "reference engine" in (logs / "engine-0.log").read_text()


def test_a_failed_childs_last_lines_are_printed_with_its_log(tmp_path: Path) -> None:
    script = "import sys\nfor i in range(30): print(f'line {i}')\nsys.exit(3)"
    failed = Process("engine-0", [sys.executable, "-c", script], tmp_path, log_dir=tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    ok = Process("recorder", [sys.executable, "-c", "print('fine')"], tmp_path, log_dir=tmp_path / "logs")
    for proc in (failed, ok):
        proc.start()
        assert proc.popen is not None
        proc.popen.wait(30)
    lines: list[str] = []
    _show_failures({"engine-0": failed, "recorder": ok}, lines.append, fallback=())
    assert lines[0] == f"engine-0: last 10 lines of {tmp_path / 'logs' / 'engine-0.log'}"
    assert lines[1:] == [f"  engine-0 | line {i}" for i in range(20, 30)]


def test_a_stall_shows_the_fallback_childs_lines(tmp_path: Path) -> None:
    proc = Process("trainer-0", [sys.executable, "-c", "print('waiting for a batch')"], tmp_path).start()
    assert proc.popen is not None
    proc.popen.wait(30)
    lines: list[str] = []
    _show_failures({"trainer": proc}, lines.append, fallback=("trainer", "rollout"))
    assert lines == [f"trainer-0: last 1 lines of {tmp_path / 'trainer-0.log'}", "  trainer-0 | waiting for a batch"]


def test_the_demos_log_choice_reaches_its_children(tmp_path: Path) -> None:
    try:
        choose_logging("debug")
        assert Process("x", ["true"], tmp_path).env[LOG_LEVEL_ENV] == "debug"
    finally:
        choose_logging()
