"""docs/demo.md's "Running the processes yourself" block leaves nothing behind, and can run again at once.

The block runs as written (``bash -e -c``, its own session) on free ports: twice in a row on the same ports, and
once interrupted by Ctrl-C (SIGINT to its process group while the trainer runs) and then again. After each run
every port it used (the engines', the router's, both metrics ports, NATS's) is free and no process of its session
is alive. Before, Ctrl-C skipped the block's closing ``kill`` and left NATS, the engines, the router and the
rollout running, so the next run hung on ``Address already in use``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import weightbus
from tests.test_docs import ROOT, fenced_blocks
from weightbus.embedded.server import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a session's processes from /proc"),
]

_PORTS = ("E1", "E2", "ROUTER", "ROUTER_METRICS", "ROLLOUT_METRICS")
_RUN_S = 300.0


def _block() -> str:
    (block,) = [b for b in fenced_blocks(ROOT / "docs/demo.md") if "weightbus trainer" in b.code]
    return block.code


@pytest.fixture
def ports() -> dict[str, str]:
    pytest.importorskip("torch")
    pytest.importorskip("sglang_router")
    return {name: str(free_port()) for name in _PORTS}


def _env(run: Path, ports: dict[str, str], steps: int) -> dict[str, str]:
    src = str(Path(weightbus.__file__).resolve().parents[1])
    return {
        **os.environ,
        **ports,
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": sys.prefix,
        "RUN": str(run),
        "STEPS": str(steps),
        # The block starts its own NATS: an inherited URL must not be the one it uses.
        "WEIGHTBUS_NATS": "nats://127.0.0.1:1",
        "NATS_URL": "nats://127.0.0.1:1",
    }


def _session(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while listed
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _argvs(pids: list[int]) -> Iterator[list[str]]:
    for pid in pids:
        try:
            yield (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # exited while listed


def _trainer_runs(pids: list[int]) -> bool:
    # The weightbus process itself, not the bash whose -c argument names it.
    return any("trainer" in argv[1:3] for argv in _argvs(pids) if not argv[0].endswith("bash"))


def _taken(port: int) -> bool:
    try:
        with socket.create_server(("127.0.0.1", port)):
            return False
    except OSError:
        return True


class _Block:
    """One run of the block in its own session, its output in ``run/block.log``."""

    def __init__(self, tmp_path: Path, name: str, ports: dict[str, str], steps: int = 2) -> None:
        self.run = tmp_path / name
        self.run.mkdir()
        self.ports = ports
        self.log = self.run / "block.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                ["bash", "-e", "-c", _block()], cwd=ROOT, env=_env(self.run, ports, steps), stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text()

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=_RUN_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the block ran past {_RUN_S} s:\n{self.output()}")

    def kill(self) -> None:
        """Whatever is left, so a failing test leaves nothing either."""
        alive = [self.proc.pid] if self.proc.poll() is None else []
        for pid in [*alive, *_session(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        self.proc.wait(timeout=30)

    def used_ports(self) -> list[int]:
        nats = (self.run / "nats.url").read_text().strip()
        assert nats, f"the block never printed its NATS URL:\n{self.output()}"
        return [int(p) for p in self.ports.values()] + [int(nats.rsplit(":", 1)[1])]

    def assert_nothing_left(self) -> None:
        """No process of the block's session lives, and every port it used can be bound again."""
        left = _session(self.proc.pid)
        taken = [p for p in self.used_ports() if _taken(p)]
        assert not left and not taken, (list(_argvs(left)), taken, self.output())


def test_the_block_runs_twice_on_the_same_ports_and_leaves_nothing(tmp_path: Path, ports: dict[str, str]) -> None:
    for name in ("first", "second"):
        block = _Block(tmp_path, name, ports)
        try:
            code = block.wait()
            assert code == 0 and "trained 2 steps; last version v" in block.output(), (code, block.output())
            block.assert_nothing_left()
        finally:
            block.kill()


def test_ctrl_c_stops_every_process_of_the_block_and_it_runs_again(tmp_path: Path, ports: dict[str, str]) -> None:
    block = _Block(tmp_path, "interrupted", ports, steps=10_000)  # it trains until interrupted
    try:
        deadline = time.monotonic() + _RUN_S
        # The trainer is the block's foreground process, started once everything else is up; wait for a step.
        while not (_trainer_runs(_session(block.proc.pid)) and "trainer step=1/" in block.output()):
            assert block.proc.poll() is None, block.output()
            assert time.monotonic() < deadline, block.output()
            time.sleep(0.2)
        os.killpg(block.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        code = block.wait()
        assert code == 128 + signal.SIGINT, (code, block.output())
        block.assert_nothing_left()
    finally:
        block.kill()
    again = _Block(tmp_path, "again", ports)
    try:
        code = again.wait()
        assert code == 0 and "trained 2 steps; last version v" in again.output(), (code, again.output())
        again.assert_nothing_left()
    finally:
        again.kill()


def test_a_taken_port_ends_the_block_with_one_line_and_leaves_nothing(tmp_path: Path, ports: dict[str, str]) -> None:
    with socket.create_server(("127.0.0.1", int(ports["E2"]))):
        block = _Block(tmp_path, "taken", ports)
        try:
            started = time.monotonic()
            code = block.wait()
            assert code != 0 and time.monotonic() - started < 90, (code, block.output())
            assert f"error: cannot listen on 127.0.0.1:{ports['E2']}: Address already in use" in block.output()
            left = _session(block.proc.pid)
            others = [p for p in block.used_ports() if p != int(ports["E2"]) and _taken(p)]
            assert not left and not others, (list(_argvs(left)), others, block.output())
        finally:
            block.kill()
