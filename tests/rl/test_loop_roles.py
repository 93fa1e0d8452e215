"""The RL loop under the shipped least-privilege roles (ops/nats/auth.conf): it trains, and a refusal is one exit.

The rollout and trainer processes run as the ``rollout-policy-a`` and ``trainer-policy-a`` users (the roles are
per policy), against a reference engine behind the real SGLang router, for a few steps: the trainer must finish
and neither log may carry a permission warning.
A user that may not serve the batch subject gets the permission exit code (77, not 5: NATS is reachable) and one
``error:`` line at once, instead of a warning per attempt and a loop that never trains.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.roles import PASSWORDS, roles_server
from weightbus.bus import ConnectOptions, connect
from weightbus.embedded.server import EmbeddedNats, free_port
from weightbus.errors import PermissionDeniedError
from weightbus.rl.batches import BatchRequest, batch_subject, request_batch
from weightbus.rl.config import RolloutConfig, dump_config

pytestmark = pytest.mark.nats


def _as(role: str) -> dict[str, str]:
    return {"WEIGHTBUS_USER": role, "WEIGHTBUS_PASSWORD": PASSWORDS[role]}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with roles_server(tmp_path / "js") as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.torch
def test_the_loop_trains_under_the_shipped_roles_without_a_permission_warning(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sglang_router")
    from weightbus.demo import DemoConfig
    from weightbus.demo.children import Layout, Process, http_ok, router_argv, router_workers, wait_until

    config = DemoConfig(steps=3, batch=2, group_size=4, in_flight=2, out_dir=None, faults=False, policy="policy-a")
    layout = Layout(tmp=tmp_path, nats_url=server.url, engine_ports=[free_port()], router_port=free_port())
    layout.run_dir.mkdir()
    procs = [layout.engine(config, 0).start()]
    try:
        wait_until(lambda: http_ok(f"{layout.engines[0]}/health"), "engine", procs)
        procs.append(Process("router", router_argv(layout.router_port, layout.engines, free_port()), tmp_path).start())
        wait_until(lambda: router_workers(layout.router) == 1, "router", procs)
        rollout, trainer = layout.rollout(config, 0), layout.trainer(config, 0)
        rollout.env.update(_as("rollout-policy-a"))
        trainer.env.update(_as("trainer-policy-a"))
        procs += [rollout.start(), trainer.start()]
        assert trainer.popen is not None
        trainer.popen.wait(timeout=180)
        logs = {p.name: p.log_path.read_text(errors="replace") for p in (rollout, trainer)}
        assert trainer.popen.returncode == 0, logs
        assert rollout.alive(), logs
        for name, text in logs.items():
            assert "permission" not in text.lower(), (name, text[-3000:])
        # The progress lines are there by default, plain (no terminal): one per step and one per batch served.
        assert logs["trainer-0"].count("trainer step=") == 3, logs["trainer-0"]
        assert "rollout batch=1 " in logs["rollout-0"], logs["rollout-0"]
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_rollout_refused_its_batch_subject_exits_with_one_line(server: EmbeddedNats, tmp_path: Path) -> None:
    # The monitor role reads the stream (so the tracker starts) but may not serve batches.
    # A mixed-case policy: the error names the subject as weightbus spells it (nats-py lower-cases the server's text).
    config = RolloutConfig(router_url="http://127.0.0.1:9", nats_url=server.url, policy="Roles-Mixed")
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "weightbus", "rollout", "--config", str(dump_config(config, tmp_path / "r.json"))],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **_as("monitor")},
    )
    assert run.returncode == 77, run.stderr  # denied, not unreachable (5)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: permission denied"), run.stderr
    assert batch_subject("Roles-Mixed") in lines[0], lines[0]
    assert time.monotonic() - started < 30


async def test_a_trainer_refused_the_batch_subject_gets_the_typed_error_not_a_timeout(server: EmbeddedNats) -> None:
    bus = await connect(server.url, options=ConnectOptions(user="monitor", password=PASSWORDS["monitor"]))
    try:
        started = time.monotonic()
        with pytest.raises(PermissionDeniedError) as info:
            await request_batch(bus, "roles", BatchRequest(size=1), timeout=10)
        assert info.value.subject == batch_subject("roles") and info.value.action == "publish"
        assert time.monotonic() - started < 5
    finally:
        await bus.aclose()
