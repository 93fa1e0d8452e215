"""SIGINT ends every long-running command with 130 and SIGTERM with 143, in a real process, after its cleanup.

Each command is started as the operator starts it, signalled once it shows it is running (a line it
prints, a file it opens, a port it listens on), and must exit with the shared code and no traceback.
``weightbus demo`` is interrupted by ``tests/demo/test_demo.py``; ``publish`` by ``test_publish_interrupt.py``.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._builders import updated
from weightbus.bus import connect, subjects
from weightbus.embedded.server import free_port

pytestmark = pytest.mark.nats


def _publish_one(url: str, policy: str) -> None:
    async def go() -> None:
        bus = await connect(url, connect_timeout=5)
        try:
            event = updated(1, policy=policy)
            await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:1")
        finally:
            await bus.aclose()

    asyncio.run(go())


def _run_until(args: list[str], ready: Callable[[str, str], bool], timeout: float = 90) -> subprocess.Popen[bytes]:
    """Start ``weightbus ARGS``; return it once ``ready(stdout so far, stderr so far)`` holds."""
    proc = subprocess.Popen([sys.executable, "-m", "weightbus", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    seen = {proc.stdout: b"", proc.stderr: b""}
    with selectors.DefaultSelector() as selector:
        for stream in seen:
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while not ready(seen[proc.stdout].decode(errors="replace"), seen[proc.stderr].decode(errors="replace")):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{args[0]} never got ready (rc {proc.poll()}): {seen}")
            for key, _ in selector.select(0.1):
                seen[key.fileobj] += key.fileobj.read() or b""  # type: ignore[union-attr, operator]
    for stream in seen:
        os.set_blocking(stream.fileno(), True)
    return proc


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def _stop(proc: subprocess.Popen[bytes], sig: signal.Signals) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err.decode(errors="replace")


COMMANDS = ["server", "engine", "watch", "follow", "record", "rollout", "trainer"]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_signal_ends_each_command_with_the_shared_code(
    command: str, sig: signal.Signals, code: int, nats_url: str, policy: str, tmp_path: Path
) -> None:
    dead_router = f"http://127.0.0.1:{free_port()}"
    # Accepts connections (the kernel's backlog) and never answers: the trainer waits on its /workers.
    silent_router = socket.create_server(("127.0.0.1", 0))
    silent = f"http://127.0.0.1:{silent_router.getsockname()[1]}"
    engine_port = free_port()
    if command in ("watch", "rollout"):
        _publish_one(nats_url, policy)  # watch prints it; the rollout generates once a version exists
    args, ready = {
        "server": (["server"], lambda out, err: "nats://" in out),
        "engine": (["engine", "--port", str(engine_port), "--token-delay", "0"], lambda o, e: _listening(engine_port)),
        "watch": (["watch", "--nats", nats_url, "--policy", policy, "--json"], lambda out, err: '"subject"' in out),
        "follow": (["follow", "--nats", nats_url, "--policy", policy], lambda out, err: "no version" in out),
        "record": (["record", "--nats", nats_url, "--out", str(tmp_path / "r.jsonl")], lambda o, e: "recording" in e),
        "rollout": (
            ["rollout", "--nats", nats_url, "--router", dead_router, "--policy", policy],
            lambda out, err: "waiting for the router" in err,  # it waits --router-wait (30 s) for one to answer
        ),
        "trainer": (
            ["trainer", "--nats", nats_url, "--router", silent, "--policy", policy, "--run-dir", str(tmp_path)],
            lambda out, err: (tmp_path / "steps.jsonl").exists(),
        ),
    }[command]
    if command == "trainer":
        pytest.importorskip("torch")
    returncode, err = _stop(_run_until(args, ready), sig)
    silent_router.close()
    assert returncode == code, err
    assert "Traceback" not in err
