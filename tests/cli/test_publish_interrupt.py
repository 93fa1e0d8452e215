"""Interrupting ``weightbus publish --pause retract`` (a real subprocess) never leaves the engine paused."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

from weightbus.bus import connect, subjects
from weightbus.bus.protocol import Deliver
from weightbus.engines.sglang import SGLangClient
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import WeightUpdated

pytestmark = pytest.mark.nats


async def _weights_events(url: str, policy: str) -> list[Any]:
    bus = await connect(url)
    try:
        last = await bus.last(subjects.weights(policy))
        if last is None:
            return []
        out = []
        async with bus.subscribe(subjects.weights(policy), deliver=Deliver.ALL) as sub:
            async for env in sub:
                out.append(env.event)
                if env.seq >= last.seq:
                    return out
        return out
    finally:
        await bus.aclose()


async def _generate(url: str) -> str:
    async with SGLangClient(url, timeout=5) as client:
        out = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        return out.meta_info.finish_reason.type


@pytest.mark.parametrize("slow", ["/pause_generation", "/update_weight_version"])
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_the_pause_or_the_stamp_resumes_the_engine_and_publishes_nothing(
    nats_url: str, policy: str, sig: signal.Signals, code: int, slow: str
) -> None:
    state = EngineState()
    inner = create_app(state)
    stamping, release = threading.Event(), threading.Event()

    async def slow_answer(scope: Any, receive: Any, send: Any) -> None:
        # The engine applies the request, then its answer hangs until the test has interrupted the command.
        if scope["type"] != "http" or scope["path"] != slow:
            await inner(scope, receive, send)
            return
        held: list[Any] = []

        async def hold(message: Any) -> None:
            held.append(message)

        await inner(scope, receive, hold)
        stamping.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        for message in held:
            await send(message)

    with ServedEngine(slow_answer) as engine:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightbus", "publish", "--policy", policy, "--nats", nats_url,
             "--engine", engine.url, "--pause", "retract", "--engine-timeout", "30"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert stamping.wait(30), f"the command never reached {slow}"
            assert state.pause_mode == "retract"  # paused by the command, its request still unanswered
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=30)
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == code, err.decode()
        assert b"Traceback" not in err and out == b""
        assert state.pause_mode is None
        assert [r.path for r in state.recorded("/continue_generation")] == ["/continue_generation"]
        assert asyncio.run(_generate(engine.url)) in ("length", "stop")
    events = asyncio.run(_weights_events(nats_url, policy))
    assert events and not any(isinstance(e, WeightUpdated) for e in events)
