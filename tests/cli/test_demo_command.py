"""``weightbus demo`` as a user runs it: it reads WEIGHTBUS_NATS and leaves nothing in the temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightbus.bus import EmbeddedNats

pytestmark = [pytest.mark.slow, pytest.mark.nats]


def test_demo_reads_weightbus_nats_and_leaves_no_temporary_directory(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with EmbeddedNats(store_dir=tmp_path / "store") as server:
        env = {**os.environ, "TMPDIR": str(tmp), "WEIGHTBUS_NATS": server.url}
        run = subprocess.run(
            [sys.executable, "-m", "weightbus", "demo", "--model", "hash", "--steps", "2"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "embedded nats-server" not in run.stdout and "claimed policy 'demo-" in run.stdout
    assert list(tmp.iterdir()) == []
    # With no NATS given, the embedded server's store goes into the private directory too.
    run = subprocess.run(
        [sys.executable, "-m", "weightbus", "demo", "--model", "hash", "--steps", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp), "WEIGHTBUS_NATS": ""},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "embedded nats-server" in run.stdout
    assert list(tmp.iterdir()) == []
