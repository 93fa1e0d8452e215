"""A cancel that nats-py swallows is raised anyway: by ``honouring_cancel``, and by the guard of every JetStream call.

The swallowing is the one of CPython 3.11's ``asyncio.wait_for`` (a cancel landing as the reply arrives returns
the reply); ``_swallows`` reproduces it deterministically: it catches the cancel and returns a value.
"""

from __future__ import annotations

import asyncio

import pytest

from weightbus.bus._cancel import honouring_cancel
from weightbus.bus._denials import Denials


async def _swallows(started: asyncio.Event) -> str:
    started.set()
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        return "the reply"  # what wait_for does when the reply is already there
    return "never"


async def _cancel_while(run: object) -> asyncio.Task[str]:
    started = asyncio.Event()
    task = asyncio.ensure_future(run(_swallows(started)))  # type: ignore[operator]
    await started.wait()
    task.cancel()
    await asyncio.wait({task})
    return task


@pytest.mark.parametrize("how", ["bare", "guard"])
async def test_a_swallowed_cancel_still_cancels_the_caller(how: str) -> None:
    denials = Denials()
    if how == "bare":
        run = honouring_cancel
    else:

        def run(op: object) -> object:
            return denials.guard(lambda action, subject: False, op)  # type: ignore[arg-type]

    assert (await _cancel_while(lambda op: op)).result() == "the reply"  # unguarded: the cancel is lost
    assert (await _cancel_while(run)).cancelled()


async def test_a_swallowed_timeout_is_a_timeout_and_a_call_left_alone_returns() -> None:
    started = asyncio.Event()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await honouring_cancel(_swallows(started))

    async def answers() -> int:
        await asyncio.sleep(0)
        return 7

    assert await honouring_cancel(answers()) == 7
