"""A long-running command never waits for ever on a port or a dependency: one ``error:`` line, a non-zero exit.

Each command runs as a real process (``python -m weightbus``) with a timeout: a port another socket holds, a NATS
that is not there, a router that never answers. Before, an engine whose port was taken could log uvicorn's bind
error and keep running, and a rollout retried a dead router for ever.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightbus.embedded.server import free_port

#: Seconds a failing command may take (the trainer imports torch before it reads its options' ports).
_LIMIT_S = 30.0


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port held by a listening socket for the test's duration."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def _run(*args: str) -> tuple[int, list[str], float]:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "weightbus", *args], capture_output=True, text=True, timeout=_LIMIT_S + 30
    )
    lines = [line for line in run.stderr.splitlines() if line.strip() and not line.startswith("{")]
    return run.returncode, lines, time.monotonic() - started


def _one_line(args: list[str], code: int, *needles: str) -> None:
    returncode, lines, took = _run(*args)
    assert returncode == code, (returncode, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert took < _LIMIT_S, took


def _dead_nats() -> str:
    return f"nats://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(
    "command",
    [
        ["engine", "--token-delay", "0", "--port"],
        ["server", "--port"],
        ["follow", "--policy", "p", "--metrics-port"],
        ["rollout", "--router", "http://127.0.0.1:9", "--policy", "p", "--metrics-port"],
        ["trainer", "--router", "http://127.0.0.1:9", "--policy", "p", "--run-dir", "RUN", "--metrics-port"],
    ],
    ids=lambda c: c[0],
)
def test_a_taken_port_is_one_line_and_exit_2(command: list[str], taken: int, tmp_path: Path) -> None:
    if command[0] == "trainer":
        pytest.importorskip("torch")
    args = [str(tmp_path) if a == "RUN" else a for a in command] + [str(taken)]
    if command[0] in {"follow", "rollout", "trainer"}:
        args += ["--nats", _dead_nats()]  # the port is refused before anything connects
    _one_line(args, 2, f"127.0.0.1:{taken}", "in use")


@pytest.mark.parametrize("command", ["rollout", "trainer"])
def test_nats_that_never_comes_up_is_exit_5(command: str, tmp_path: Path) -> None:
    if command == "trainer":
        pytest.importorskip("torch")
    args = [command, "--router", "http://127.0.0.1:9", "--policy", "p", "--nats", _dead_nats()]
    if command == "trainer":
        args += ["--run-dir", str(tmp_path)]
    _one_line(args, 5, "cannot connect to NATS")


@pytest.mark.nats
def test_a_router_that_never_answers_ends_the_rollout(nats_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    args = ["rollout", "--router", dead, "--policy", "p", "--nats", nats_url, "--router-wait", "1"]
    _one_line(args, 1, dead, "no answer within 1 s")


def test_serve_forever_refuses_a_taken_port_at_once(taken: int) -> None:
    from weightbus.refengine.reference import EngineState, create_app
    from weightbus.refengine.serve import serve_forever

    async def serve() -> None:
        async with asyncio.timeout(10):
            await serve_forever(create_app(EngineState()), "127.0.0.1", taken)

    with pytest.raises(OSError, match="in use"):
        asyncio.run(serve())
