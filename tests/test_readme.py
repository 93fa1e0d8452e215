"""The README's code runs as written (only the example URLs, or the ports its shell block reads, are this test's)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from weightbus.embedded.server import free_port
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block(containing: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    matches = [b for b in blocks if containing in b]
    assert len(matches) == 1, f"expected one README python block with {containing!r}"
    return matches[0]


@pytest.mark.nats
def test_the_sync_publisher_example_runs_as_written(nats_url: str) -> None:
    code = python_block("SyncVersionPublisher(")
    state = EngineState()
    with ServedEngine(create_app(state)) as engine:
        code = code.replace("nats://127.0.0.1:4222", nats_url).replace("http://w1:30000", engine.url)
        # A fresh policy id per run: the session's server keeps what earlier tests published.
        code = code.replace('"policy-a"', f'"readme-{id(code)}"')
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the point is to run the README
    assert out.getvalue().strip() == "published v1"
    assert state.weight_version == "1"


def bash_block(marker: str) -> str:
    """The ```bash block right after ``<!-- readme-test: MARKER -->``."""
    found = re.findall(rf"<!-- readme-test: {re.escape(marker)} -->\n```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert len(found) == 1, f"expected one README bash block marked {marker!r}"
    return found[0]


def test_the_processes_block_names_its_nats_and_binds_loopback() -> None:
    block = bash_block("processes")
    assert "4222" not in block
    lines = block.splitlines()
    exported = next(n for n, line in enumerate(lines) if line.startswith("export WEIGHTBUS_NATS="))
    for n, line in enumerate(lines):
        if line.startswith("weightbus ") and not line.startswith("weightbus server"):
            assert n > exported or "--nats" in line, line
    router = block[block.index("sglang_router") :].split("&", 1)[0]
    # The demo's router flags (weightbus.process.demo): loopback only, quiet, its metrics port loopback too.
    for needle in (
        "--host 127.0.0.1",
        "--log-level warn",
        "--health-check-interval-secs 1",
        "--prometheus-host 127.0.0.1",
    ):
        assert needle in router


@pytest.mark.slow
@pytest.mark.nats
@pytest.mark.torch
def test_the_processes_block_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sglang_router")
    ports = {name: free_port() for name in ("E1", "E2", "ROUTER", "ROUTER_METRICS", "ROLLOUT_METRICS")}
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        **{name: str(port) for name, port in ports.items()},
        "RUN": str(tmp_path),
        "STEPS": "2",
        "VIRTUAL_ENV": sys.prefix,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        # Whatever the caller's shell points at must not matter: the block exports its own.
        "WEIGHTBUS_NATS": "nats://127.0.0.1:1",
        "NATS_URL": "nats://127.0.0.1:1",
    }
    proc = subprocess.Popen(
        ["bash", "-e", "-c", bash_block("processes")],
        cwd=README.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left behind
    assert proc.returncode == 0, out
    assert re.search(r"^trained 2 steps; last version v\d+$", out, flags=re.M), out
    steps = [json.loads(line) for line in (tmp_path / "train" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    # The router was told --log-level warn: the whole run prints a screenful, not its INFO stream.
    assert len(out.splitlines()) < 100, out
