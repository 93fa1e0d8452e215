"""The loop weightbus's processes run on: uvloop by default, asyncio's on request, a clear error otherwise.

The bus round trip runs in a real child process on each loop, against the test's nats-server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from weightbus.cli import app
from weightbus.errors import EventLoopError
from weightbus.process import eventloop
from weightbus.process.eventloop import EVENT_LOOP_ENV, loop_factory, loop_name

uvloop = pytest.importorskip("uvloop")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "uvloop"), ("auto", "uvloop"), ("UVLOOP", "uvloop"), ("asyncio", "asyncio"), (" asyncio ", "asyncio")],
)
def test_the_environment_picks_the_loop(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: str) -> None:
    if value is None:
        monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    else:
        monkeypatch.setenv(EVENT_LOOP_ENV, value)
    assert loop_name() == expected
    factory = loop_factory()
    assert (factory is uvloop.new_event_loop) if expected == "uvloop" else factory is None


def test_an_unknown_loop_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(EventLoopError, match="expected one of auto, uvloop, asyncio"):
        loop_factory()


def test_uvloop_missing_falls_back_unless_it_was_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert loop_factory() is None
    monkeypatch.setenv(EVENT_LOOP_ENV, "uvloop")
    with pytest.raises(EventLoopError, match="uvloop does not import"):
        loop_factory()


def test_run_closes_the_coroutine_it_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "nope")

    async def never() -> None:
        raise AssertionError("must not run")

    coro = never()
    with pytest.raises(EventLoopError):
        eventloop.run(coro)
    # Closed, not left for the collector to report as "never awaited"; sending into it now fails.
    assert coro.cr_frame is None
    with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
        coro.send(None)


def test_a_command_with_an_unknown_loop_says_so_in_one_line() -> None:
    result = CliRunner().invoke(app, ["status", "--policy", "p"], env={EVENT_LOOP_ENV: "trio"})
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {EVENT_LOOP_ENV}='trio': expected one of auto, uvloop, asyncio"]


@pytest.mark.nats
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_tracker_process_follows_versions_on_either_loop(nats_url: str, policy: str, loop: str) -> None:
    script = f"""
import asyncio, sys
from prometheus_client import CollectorRegistry
from weightbus.bus import connect
from weightbus.consumers import VersionTracker
from weightbus.process.eventloop import run
from weightbus.producers import VersionPublisher

async def main():
    bus = await connect(sys.argv[1])
    try:
        publisher = await VersionPublisher(bus, {policy!r}).start()
        async with VersionTracker(bus, {policy!r}, registry=CollectorRegistry()) as tracker:
            for _ in range(3):
                async with publisher.update() as version:
                    pass
                await tracker.wait_for(version, timeout=10)
            print(type(asyncio.get_running_loop()).__module__.split(".")[0], tracker.current, flush=True)
    finally:
        await bus.aclose()

run(main())
"""
    out = subprocess.run(
        [sys.executable, "-c", script, nats_url],
        env={**os.environ, EVENT_LOOP_ENV: loop},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [loop, "3"]


def test_asyncio_run_is_untouched() -> None:
    # Library code never installs a policy: a host's asyncio.run still gets asyncio's own loop.
    async def kind() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert asyncio.run(kind()).startswith("asyncio")
