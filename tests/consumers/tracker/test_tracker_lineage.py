"""A tracker that cannot check a delta's base takes it, loudly; one that can and finds it unannounced refuses it."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated
from weightbus.bus import subjects
from weightbus.bus.protocol import Bus
from weightbus.consumers.tracker.tracker import VersionTracker
from weightbus.schemas import WeightArtifact


async def test_a_fresh_tracker_takes_a_delta_on_a_base_before_its_history_and_says_so(
    bus: Bus, policy: str, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    # The history begins at 9 (the rest evicted, or never kept): 9 is a delta on 8, which no one here saw.
    first = updated(9, policy=policy, artifact=WeightArtifact(uri="/d9", lineage="delta", base=8), reserves_next=True)
    await bus.publish(subjects.weights(policy), first, msg_id=f"{policy}:9")
    caplog.set_level(logging.WARNING, logger="weightbus.consumers")
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        # Holding 9 errs toward stale: refusing it would judge samples of 8 against 8, as fresh.
        assert tracker.current == 9
        second = updated(10, policy=policy, artifact=WeightArtifact(uri="/d10", lineage="delta", base=9))
        await bus.publish(subjects.weights(policy), second, msg_id=f"{policy}:10")
        assert await tracker.wait_for(10, timeout=5) == 10
    assert registry.get_sample_value("weightbus_unverified_bases_total", {"policy": policy}) == 1  # 9's; 10's checked
    assert [r.base for r in caplog.records if r.getMessage().startswith("delta taken")] == [8]  # type: ignore[attr-defined]
