"""The embedded nats-server, bounded connects, reconnects, and the subject scheme."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests._builders import updated, wait_until
from weightbus.bus import Deliver, connect, subjects
from weightbus.embedded.cluster import EmbeddedCluster
from weightbus.embedded.server import EmbeddedNats, find_nats_server, free_port
from weightbus.errors import BusConnectError, InvalidPolicyError, NatsServerStartError


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


@pytest.mark.nats
def test_a_config_with_its_own_store_dir_leaves_nothing_beside_a_given_store(tmp_path: Path) -> None:
    """The rewritten config copy lives in a temporary directory of its own, removed at stop; the store stays."""
    given = tmp_path / "given"
    given.mkdir()
    store = given / "store"
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    conf = conf_dir / "server.conf"
    conf.write_text('jetstream { store_dir: "/nonexistent/elsewhere" }\n')
    server = EmbeddedNats(store_dir=store, config=conf).start()
    try:
        assert sorted(p.name for p in given.iterdir()) == ["store"], list(given.iterdir())
        assert sorted(p.name for p in conf_dir.iterdir()) == ["server.conf"]
        running = server.command()[server.command().index("-c") + 1]
        assert Path(running).parent not in (given, conf_dir, tmp_path), running
        assert Path(running).exists()
    finally:
        server.stop()
    assert sorted(p.name for p in given.iterdir()) == ["store"], list(given.iterdir())
    assert store.is_dir() and any(store.iterdir())  # a given store is kept
    assert not Path(running).parent.exists(), running
    assert conf.read_text() == 'jetstream { store_dir: "/nonexistent/elsewhere" }\n'  # the original untouched


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
    assert proc.returncode == 143, err  # every command's SIGTERM code, after a clean stop
    assert "nats-server stopped" in err
    assert (tmp_path / "js" / "jetstream").exists()  # a store given by the user is kept


@pytest.mark.slow
@pytest.mark.nats
async def test_subscription_and_publisher_survive_a_server_restart(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "store").start()
    try:
        bus = await connect(server.url)
        w = subjects.weights("restart")

        await bus.publish(w, updated(1, policy="restart", epoch=0), msg_id="restart:1")
        sub = bus.subscribe(w, deliver=Deliver.LAST_PER_SUBJECT)
        first = await asyncio.wait_for(sub.__anext__(), 5)
        assert first.event.version == 1  # type: ignore[union-attr]
        server.kill()
        await wait_until(lambda: not bus.client.is_connected, 5, "the client to notice the dead server")
        server.start()
        # The publish retries with the same Nats-Msg-Id until the reconnect; it lands once.
        ack = await bus.publish(w, updated(2, policy="restart", epoch=0), msg_id="restart:2")
        again = await bus.publish(w, updated(2, policy="restart", epoch=0), msg_id="restart:2")
        assert again.duplicate and again.seq == ack.seq
        got = await asyncio.wait_for(sub.__anext__(), 15)
        assert got.event.version == 2  # type: ignore[union-attr]
        await sub.aclose()
        await bus.aclose()
    finally:
        server.stop()


def test_port_in_use_is_reported_with_its_reason() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = EmbeddedNats(port=port)
        with pytest.raises(NatsServerStartError) as info:
            server.start()
        assert "address already in use" in info.value.reason
        assert not server.store_dir.exists()
        # The CLI says the same in one line, with exit code 2 (the port cannot be bound: a bad argument).
        out = subprocess.run(
            [sys.executable, "-m", "weightbus.cli", "server", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2 and "address already in use" in out.stderr.lower() and "Traceback" not in out.stderr


def test_ready_means_the_server_said_so_not_a_tcp_probe() -> None:
    """A foreign listener on the port satisfies a TCP probe; start() must still fail, not report ready."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as impostor:
        impostor.bind(("127.0.0.1", 0))
        impostor.listen()
        server = EmbeddedNats(port=impostor.getsockname()[1], startup_timeout=5)
        with pytest.raises(NatsServerStartError):
            server.start()


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM])
def test_cli_server_never_leaks_its_nats_server(sig: signal.Signals) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "weightbus.cli", "server"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            url = proc.stdout.readline().strip()
            assert url.startswith("nats://127.0.0.1:")
            info = proc.stderr.readline()  # "nats-server pid N, store DIR; Ctrl-C to stop"
            child = int(info.split("pid ", 1)[1].split(",", 1)[0])
            store = Path(info.split("store ", 1)[1].split(";", 1)[0])
            assert _alive(child) and store.exists()
            proc.send_signal(sig)
            proc.wait(timeout=15)
        finally:
            proc.kill()
            proc.wait()
    assert _wait_gone(child), f"nats-server {child} outlived its parent after {sig.name}"
    deadline = time.monotonic() + 10
    while store.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store.exists(), f"temporary store left behind after {sig.name}"
    if sig != signal.SIGKILL:
        assert proc.returncode == 128 + sig  # 129 SIGHUP, 143 SIGTERM: stopped cleanly by that signal


def test_without_a_port_nats_server_picks_one_and_parallel_starts_never_race() -> None:
    """No port is picked by weightbus and bound later: each server binds its own (``-p -1``) and reports it."""
    servers = [EmbeddedNats() for _ in range(6)]
    assert all(s.port is None and s.command()[s.command().index("-p") + 1] == "-1" for s in servers)
    with pytest.raises(NatsServerStartError, match="no port until start"):
        _ = servers[0].url
    errors: list[BaseException] = []

    def start(server: EmbeddedNats) -> None:
        try:
            server.start()
        except BaseException as exc:  # reported below, by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        ports = [s.port for s in servers]
        assert len(set(ports)) == len(servers) and all(isinstance(p, int) and p > 0 for p in ports), ports
        for s in servers:
            assert s.url == f"nats://127.0.0.1:{s.port}"
            with socket.create_connection(("127.0.0.1", s.port), timeout=2) as sock:
                assert sock.recv(4096).startswith(b"INFO "), s.url  # a NATS server answers there
    finally:
        for s in servers:
            s.stop()


@pytest.mark.nats
async def test_a_server_that_picked_its_port_comes_back_on_it(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "js").start()
    try:
        first = server.port
        server.kill()
        server.start()
        assert server.port == first
        bus = await connect(server.url, connect_timeout=3)
        await bus.aclose()
    finally:
        server.stop()


def test_a_cluster_picks_beforehand_only_the_route_ports_its_nodes_must_share(tmp_path: Path) -> None:
    cluster = EmbeddedCluster(tmp_path / "cluster")
    try:
        for node in cluster.nodes.values():
            assert node.port is None and node.command()[node.command().index("-p") + 1] == "-1"
            assert node.env["WEIGHTBUS_CLIENT_LISTEN"] == node.env["WEIGHTBUS_HTTP_LISTEN"] == "127.0.0.1:-1"
            assert not node.env["WEIGHTBUS_CLUSTER_LISTEN"].endswith(":-1")
    finally:
        cluster.stop()
