"""The admission gate as a host uses it: waiting for a slot, the context manager and iterator forms, the modes,
a version source that cannot say, and a tracker moving on that frees the window."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests._builders import has_waiters, wait_until
from weightbus.consumers.admission import Admission
from weightbus.errors import TrackerNotReadyError


class _Tracker:
    def __init__(self, version: int | None) -> None:
        self.version = version
        self.ready = True

    @property
    def current(self) -> int | None:
        if not self.ready:
            raise TrackerNotReadyError("p", "deaf")
        return self.version


async def test_a_waiter_gets_the_slot_a_release_frees() -> None:
    gate = Admission("bounded", current=3, max_staleness=0, batch=2, poll_s=10.0)
    first, second = gate.try_acquire(), gate.try_acquire()
    assert first is not None and second is not None and gate.try_acquire() is None
    waiter = asyncio.create_task(gate.acquire())
    await wait_until(lambda: has_waiters(gate._changed), 5, "the acquire to wait")
    assert not waiter.done()
    first.release("aborted")
    slot = await asyncio.wait_for(waiter, 1.0)
    assert slot.version == 3 and gate.running == 2


async def test_leaving_the_context_releases_unless_accepted() -> None:
    gate = Admission("bounded", current=1, max_staleness=0, batch=2)
    async with gate.slot() as slot:
        slot.accept()
    with pytest.raises(RuntimeError):
        async with gate.slot():
            raise RuntimeError("generation failed")
    async with gate.slot():
        pass
    assert (gate.running, gate.ready) == (0, 1)
    assert gate.counts == {"accepted": 1, "finished": 1, "aborted": 1, "recycled": 0}


async def test_a_cancelled_wait_takes_nothing() -> None:
    gate = Admission("cap", cap=1, batch=1, poll_s=0.01)
    assert gate.try_acquire() is not None
    waiter = asyncio.create_task(gate.acquire())
    # Checked more often than the acquire polls (10 ms): a check in step with its polls would only see them.
    await wait_until(lambda: has_waiters(gate._changed), 5, "the acquire to wait", interval=0.003)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.running == 1


async def test_the_tracker_moving_on_frees_the_window() -> None:
    tracker = _Tracker(5)
    gate = Admission("bounded", current=tracker, max_staleness=0, batch=2, poll_s=0.01)
    slots = [gate.try_acquire(), gate.try_acquire()]
    for slot in slots:
        assert slot is not None
        slot.accept()
    gate.drained(2, at=5)
    assert gate.try_acquire() is None  # the batch at v5 fills the window
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.03)  # waited out (three polls): the point is that the waiter gets nothing meanwhile
    assert not waiter.done()
    tracker.version = 6  # no call to the gate: the poll sees it
    slot = await asyncio.wait_for(waiter, 1.0)
    assert slot.version == 6


async def test_a_tracker_that_cannot_say_admits_nothing() -> None:
    tracker = _Tracker(2)
    gate = Admission("bounded", current=tracker, max_staleness=1, batch=2)
    tracker.ready = False
    assert gate.capacity() == 0 and gate.try_acquire() is None
    tracker.ready = True
    assert gate.try_acquire() is not None


async def test_never_published_admits_one_batch() -> None:
    tracker = _Tracker(None)
    gate = Admission("bounded", current=tracker, max_staleness=3, batch=2)
    assert [gate.try_acquire() is not None for _ in range(3)] == [True, True, False]
    tracker.version = 1
    assert gate.capacity() == 4 * 2 - 2


async def test_the_iterator_and_the_modes() -> None:
    gate = Admission("off", batch=1)
    got = []
    async for slot in gate.slots():
        got.append(slot)
        if len(got) == 50:
            break
    assert gate.running == 50
    with pytest.raises(ValueError, match="cap"):
        Admission("cap", batch=1)
    with pytest.raises(ValueError, match="admission must be"):
        Admission("sometimes", batch=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Admission("bounded", current="7", batch=1)


async def test_follow_wakes_a_waiting_acquire_at_each_change() -> None:
    held = {"v": 1}
    # A poll of a minute: only a change can wake the waiter within the test's bound.
    gate = Admission("bounded", current=lambda: held["v"], max_staleness=0, batch=1, poll_s=60.0)
    gate.try_acquire().accept()  # v1's one slot is taken
    gate.drained(1, at=1)
    changed = asyncio.Event()
    subscriptions = 0

    async def changes() -> Any:
        nonlocal subscriptions
        subscriptions += 1
        await changed.wait()
        held["v"] = 2
        yield object()

    waiter = asyncio.create_task(gate.acquire())
    follower = asyncio.create_task(gate.follow(changes))
    await wait_until(
        lambda: subscriptions == 1 and has_waiters(gate._changed),
        5,
        "the follower to subscribe and the acquire to wait",
    )
    assert not waiter.done()  # v1's horizon is full
    changed.set()
    slot = await asyncio.wait_for(waiter, timeout=5)
    assert slot.version == 2 and subscriptions == 1
    await asyncio.wait_for(follower, timeout=5)  # the iterator ended: so does follow
