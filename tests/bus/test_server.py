"""The embedded nats-server, bounded connects, reconnects, and the subject scheme."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightbus.bus import Deliver, EmbeddedNats, connect, subjects
from weightbus.bus.server import find_nats_server, free_port
from weightbus.errors import BusConnectError, InvalidPolicyError
from weightbus.schemas import WeightUpdated


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_embedded_server_starts_on_loopback_and_stops_by_pid() -> None:
    server = EmbeddedNats().start()
    pid, store = server.pid, server.store_dir
    assert pid is not None and _alive(pid)
    assert server.url == f"nats://127.0.0.1:{server.port}"
    server.stop()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert not store.exists()


def test_find_nats_server_prefers_the_venv_binary() -> None:
    assert Path(find_nats_server()).parent == Path(sys.executable).parent


@pytest.mark.parametrize("policy", ["", "a.b", "has space", "*", ">", "x" * 65, "ünï"])
def test_invalid_policy_ids_are_refused(policy: str) -> None:
    with pytest.raises(InvalidPolicyError) as info:
        subjects.weights(policy)
    assert repr(policy) in str(info.value) or policy == ""


def test_subject_scheme() -> None:
    assert subjects.weights("qwen3-8b_grpo") == "weightbus.qwen3-8b_grpo.weights"
    assert subjects.alerts("p") == "weightbus.p.alerts"
    assert subjects.policy_pattern(None) == "weightbus.>"
    assert subjects.policy_of("weightbus.p.drains") == "p"
    assert subjects.policy_of("weightbus.p.other") is None
    assert subjects.matches("weightbus.*.weights", "weightbus.p.weights")
    assert not subjects.matches("weightbus.*.weights", "weightbus.p.q.weights")
    assert subjects.matches("weightbus.>", "weightbus.p.q.r")
    assert not subjects.matches("weightbus.>", "weightbus")


async def test_connect_to_nothing_fails_fast_naming_the_url() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BusConnectError) as info:
        await connect(url, connect_timeout=1.0)
    assert time.monotonic() - started < 3
    assert info.value.url == url and url in str(info.value)


def test_cli_server_prints_url_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightbus.cli", "server", "--port", str(port), "--store", str(tmp_path / "js")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == f"nats://127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "nats-server stopped" in err
    assert (tmp_path / "js" / "jetstream").exists()  # a store given by the user is kept


@pytest.mark.slow
@pytest.mark.nats
async def test_subscription_and_publisher_survive_a_server_restart(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "store").start()
    try:
        bus = await connect(server.url)
        w = subjects.weights("restart")

        def wu(v: int) -> WeightUpdated:
            return WeightUpdated(policy="restart", version=v, epoch=0, trainer_id="t", published_at=time.time())

        await bus.publish(w, wu(1), msg_id="restart:1")
        sub = bus.subscribe(w, deliver=Deliver.LAST_PER_SUBJECT)
        first = await asyncio.wait_for(sub.__anext__(), 5)
        assert first.event.version == 1  # type: ignore[union-attr]
        server.kill()
        await asyncio.sleep(0.5)
        server.start()
        # The publish retries with the same Nats-Msg-Id until the reconnect; it lands once.
        ack = await bus.publish(w, wu(2), msg_id="restart:2")
        again = await bus.publish(w, wu(2), msg_id="restart:2")
        assert again.duplicate and again.seq == ack.seq
        got = await asyncio.wait_for(sub.__anext__(), 15)
        assert got.event.version == 2  # type: ignore[union-attr]
        await sub.close()
        await bus.close()
    finally:
        server.stop()
