"""``VersionTracker.latest_changes``: the coalescing iterator that a slow reader cannot overflow."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from weightbus.bus import MemoryBus, subjects
from weightbus.consumers.tracker.changes import ChangeFeed, VersionChange
from weightbus.consumers.tracker.tracker import VersionTracker
from weightbus.errors import SlowConsumerError, VersionRegressionError
from weightbus.schemas import WeightUpdated

TIMEOUT = 10.0
FLOOD = 300


def _change(version: int) -> VersionChange:
    return VersionChange(
        policy="p",
        action="advanced",
        previous=version - 1,
        version=version,
        incoming=version,
        epoch=1,
        publisher="t",
        published_at=0.0,
        received_at=0.0,
        lag=None,
        replayed=False,
    )


async def test_a_slow_reader_under_a_flood_gets_no_error_and_ends_on_the_latest_version(
    policy: str, registry: CollectorRegistry
) -> None:
    bus = MemoryBus()
    tracker = VersionTracker(bus, policy, registry=registry, max_pending_changes=4)
    await tracker.start()
    await tracker.wait_ready(TIMEOUT)

    async def slow(changes: object) -> list[int | None]:
        seen: list[int | None] = []
        async for change in changes:  # type: ignore[attr-defined]
            seen.append(change.version)
            await asyncio.sleep(0.002)
        return seen

    coalesced = asyncio.create_task(slow(tracker.latest_changes()))
    queued = asyncio.create_task(slow(tracker.changes()))  # the bounded iterator, for contrast
    await asyncio.sleep(0.01)
    for v in range(FLOOD):
        event = WeightUpdated(policy=policy, version=v, epoch=1, trainer_id="t", published_at=time.time())
        await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:{v}")
        if v % 10 == 0:
            await asyncio.sleep(0)  # let the tracker fold some while the readers sleep
    assert await tracker.wait_for(FLOOD - 1, TIMEOUT) == FLOOD - 1
    await asyncio.sleep(0.05)
    await tracker.aclose()
    seen = await asyncio.wait_for(coalesced, TIMEOUT)
    assert seen[-1] == FLOOD - 1
    assert len(seen) < FLOOD  # it did fall behind: the flood was coalesced
    assert seen == sorted(seen)
    with pytest.raises(SlowConsumerError):
        await asyncio.wait_for(queued, TIMEOUT)
    await bus.aclose()


async def test_the_newest_change_comes_before_the_end_or_the_error() -> None:
    feed = ChangeFeed("weightbus.p.weights", limit=1)
    feed.push(_change(1), changed=True)
    reader = feed.latest()
    assert (await anext(reader)).version == 1  # registered now
    for v in range(2, 50):
        feed.push(_change(v), changed=True)  # far past the limit of a queued iterator
    feed.push(_change(7), changed=False)  # a held event is not state: it is not handed over
    assert (await anext(reader)).version == 49
    feed.push(_change(50), changed=True)
    feed.close()
    assert [c.version async for c in reader] == [50]
    assert [c.version async for c in feed.latest()] == [50]  # a late reader: the last state, then the end

    failing = ChangeFeed("weightbus.p.weights", limit=1)
    reader = failing.latest()
    failing.push(_change(1), changed=True)
    assert (await anext(reader)).version == 1  # registered now
    failing.push(_change(2), changed=True)
    failing.fail(VersionRegressionError("p", 2, 1, "t"))
    assert (await anext(reader)).version == 2
    with pytest.raises(VersionRegressionError):
        await anext(reader)
