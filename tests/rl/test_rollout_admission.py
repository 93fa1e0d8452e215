"""The rollout's admission and its drains: a drain that filters groups frees their slots as it filters them.

The demo stalled after its trainer failover ("no training step for 120 s"): while the replacement trainer started,
the producers filled the whole bounded window at v9 (16 groups accepted, ready in the buffer); the new trainer's claim
moved the version to v11, where every one of them is stale. The drain for v11 recycled all 16, but the gate counted
them as accepted until the drain returned, so it admitted nothing, and the drain waited for fresh groups for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import make_group
from weightbus.bus.memory import MemoryBus
from weightbus.rl import rollout as rollout_module
from weightbus.rl.batches import BatchRequest
from weightbus.rl.rollout import RolloutConfig, _Rollout
from weightbus.rl.task import ReverseDigits
from weightbus.schemas.rollouts import Group, SampleStatus


class _Tracker:
    """What the rollout reads of a tracker: ``current``, ``wait_for`` and ``latest_changes``."""

    def __init__(self, current: int) -> None:
        self.current = current

    async def wait_for(self, version: int, timeout: float | None = None) -> int:
        async with asyncio.timeout(timeout):
            while self.current < version:
                await asyncio.sleep(0.01)
        return self.current

    async def _changes(self) -> AsyncIterator[object]:
        await asyncio.Event().wait()  # the gate's poll sees the version move
        yield None

    def latest_changes(self) -> AsyncIterator[object]:
        return self._changes()


@pytest.mark.parametrize("on_stale", ["recycle", "drop"])
async def test_a_drain_that_filters_a_full_window_still_gets_its_batch(
    monkeypatch: pytest.MonkeyPatch, on_stale: str
) -> None:
    tracker = _Tracker(9)

    async def generate(
        http: Any, config: RolloutConfig, task: Any, group: Group, prompt: str, *args: Any, **kwargs: Any
    ) -> Group:
        await asyncio.sleep(0.001)
        group.samples = make_group(group.prompt_index, [str(tracker.current)], n=config.group_size).samples
        group.status = SampleStatus.COMPLETED
        group.metadata["prompt"] = prompt
        return group

    monkeypatch.setattr(rollout_module, "generate_group", generate)
    config = RolloutConfig(
        router_url="http://127.0.0.1:9",
        policy="p",
        group_size=2,
        batch=8,
        in_flight=4,
        max_staleness=1,
        on_stale=on_stale,  # type: ignore[arg-type]
        early_abort=False,
    )
    rollout = _Rollout(config, ReverseDigits(3), MemoryBus(), CollectorRegistry(), None)
    running = asyncio.create_task(rollout.run(tracker))  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(10):
            while rollout.admission.ready < 16:  # the whole window of v9: (1 + 1) * 8 groups
                await asyncio.sleep(0.01)
        tracker.current = 11  # a new trainer's claim skips a number: every group of v9 is stale now
        async with asyncio.timeout(10):
            reply = await rollout.handle(tracker, BatchRequest(size=8, min_version=11))  # type: ignore[arg-type]
        assert reply.error is None and reply.kept == 8
        assert reply.recycled + reply.dropped == 16
        assert all(s.oldest_version == 11 for g in reply.groups for s in g.samples)
        # The kept groups stay in the window of v11; the 16 filtered ones left it.
        assert rollout.admission.ready + rollout.admission.running <= 8
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_a_drain_past_the_trainers_patience_puts_its_groups_back_instead_of_losing_them() -> None:
    # The trainer gives up on an answer after its patience; a drain that went on would send its batch to nobody,
    # and the batch's slots would count against the window of a batch never trained.
    config = RolloutConfig(router_url="http://127.0.0.1:9", policy="p", group_size=2, batch=3, max_staleness=1)
    rollout = _Rollout(config, ReverseDigits(3), MemoryBus(), CollectorRegistry(), None)
    groups = [make_group(i, ["5"]) for i in range(3)]
    for group in groups[:2]:
        rollout.accepted.accept(rollout.admission.try_acquire(), group)  # type: ignore[arg-type]
        await rollout.buffer.put(group)
    reply = await rollout.handle(5, BatchRequest(size=3, patience_s=0.2))  # type: ignore[arg-type]
    assert reply.error is not None and "put back" in reply.error and reply.groups == []
    assert len(rollout.buffer) == 2 and rollout.admission.ready == 2  # back in the buffer, still accepted
    rollout.accepted.accept(rollout.admission.try_acquire(), groups[2])  # type: ignore[arg-type]
    await rollout.buffer.put(groups[2])
    reply = await rollout.handle(5, BatchRequest(size=3, patience_s=0.2))  # type: ignore[arg-type]
    assert reply.error is None and sorted(g.prompt_index for g in reply.groups) == [0, 1, 2]
    assert rollout.admission.ready == 0 and len(rollout.accepted) == 0  # settled: kept where they train
