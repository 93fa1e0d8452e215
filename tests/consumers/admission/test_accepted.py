"""Slots settled by the drain engine: a group the drain routes frees its slot as it is routed (not when the drain
returns), a kept group counts where it trains, each slot exactly once, the same for every host of ``DrainWindow``."""

from __future__ import annotations

import asyncio

import pytest

from tests._builders import has_waiters, make_group, wait_until
from weightbus.consumers.admission import AcceptedGroups, Admission
from weightbus.consumers.drain import FullyAsyncBuffer, StalenessStage
from weightbus.errors import AdmissionError


async def test_a_slot_is_drained_once_and_only_when_accepted() -> None:
    gate = Admission("bounded", current=3, max_staleness=0, batch=2)
    slot = gate.try_acquire()
    assert slot is not None
    with pytest.raises(AdmissionError, match="accepted"):
        slot.drained(kept=True, at=3)  # still running
    slot.accept()
    slot.drained(kept=True, at=3)
    assert (gate.ready, gate.accepted) == (0, 1)  # kept at 3: still in the horizon of 3
    with pytest.raises(AdmissionError, match="once"):
        slot.drained(kept=False)


async def test_a_group_without_a_slot_here_settles_nothing() -> None:
    gate = Admission("bounded", current=3, max_staleness=0, batch=2)
    accepted = AcceptedGroups()
    mine, other = make_group(1, ["3"]), make_group(2, ["3"])
    slot = gate.try_acquire()
    assert slot is not None
    accepted.accept(slot, mine)
    assert mine in accepted and other not in accepted and len(accepted) == 1
    accepted.unused(other)
    accepted.kept([other], 3)
    assert gate.ready == 1
    accepted.unused(mine)
    accepted.unused(mine)  # seen again (handed back, judged again): nothing more to free
    assert (gate.ready, gate.used, len(accepted)) == (0, 0, 0)


async def test_a_drain_that_filters_a_whole_window_frees_those_slots_while_it_waits() -> None:
    # The demo's failover stall, on the buffer alone: a full window accepted at v9, the version jumps to v11,
    # and the drain for v11 must see the freed slots before it returns, or nothing fresh could be admitted.
    version = [9]
    gate = Admission("bounded", current=lambda: version[0], max_staleness=1, batch=2)
    accepted = AcceptedGroups()
    buffer = FullyAsyncBuffer(16, stage=StalenessStage(max_staleness=1, on_stale="recycle"), slots=accepted)
    for i in range(4):
        slot = gate.try_acquire()
        assert slot is not None
        group = make_group(i, ["9"])
        accepted.accept(slot, group)
        await buffer.put(group)
    assert gate.try_acquire() is None  # the horizon of v9 is full: (1 + 1) * 2
    version[0] = 11
    drain = asyncio.create_task(buffer.drain(2, lambda: version[0]))
    await wait_until(lambda: len(buffer) == 0 and has_waiters(buffer._changed), 5, "the drain to wait for fresh groups")
    assert not drain.done()  # every group was stale: it waits for fresh ones
    assert gate.ready == 0 and gate.capacity() == 4  # ... with the slots of what it filtered free again
    for i in range(2):
        slot = await asyncio.wait_for(gate.acquire(), 1.0)
        group = make_group(10 + i, ["11"])
        accepted.accept(slot, group)
        await buffer.put(group)
    result = await asyncio.wait_for(drain, 1.0)
    assert result.stats.kept == 2 and result.stats.recycled == 4
    assert (gate.ready, gate.accepted, gate.capacity()) == (0, 2, 2)  # kept at 11, where they train
