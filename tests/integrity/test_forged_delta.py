"""A delta naming a base that was never announced, on a real nats-server: refused by every tracker, alerted once."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from weightbus.bus import NatsBus, subjects
from weightbus.consumers import VersionTracker
from weightbus.producers import VersionPublisher
from weightbus.schemas import VersionRejected, WeightArtifact, WeightUpdated, now

from .conftest import history

pytestmark = pytest.mark.nats


def _count(registry: CollectorRegistry, name: str, policy: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"policy": policy, **labels}) or 0.0


async def test_a_forged_delta_on_an_aborted_number_is_rejected_while_the_real_version_is_held(
    nats_bus: NatsBus, policy: str
) -> None:
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with pub.update(artifact=WeightArtifact(uri="/w1")):
        pass
    async with pub.update(artifact=WeightArtifact(uri="/d2", lineage="delta", base=1)):
        pass
    for _ in range(2):  # 3 and 4 are reserved and their pushes fail: no weights ever carried those numbers
        with pytest.raises(RuntimeError):
            async with pub.update():
                raise RuntimeError("push failed")
    assert pub.state.epoch is not None and pub.state.version == 2
    running_registry, fresh_registry = CollectorRegistry(), CollectorRegistry()
    async with VersionTracker(nats_bus, policy, registry=running_registry) as running:
        changes = running.changes(include_regressions=True)
        assert (await anext(changes)).version == 2
        # Someone with the owner's write rights (and identity) announces 4 as a delta on the aborted 3.
        forged = WeightUpdated(
            policy=policy,
            version=4,
            epoch=pub.state.epoch,
            trainer_id="t",
            published_at=now(),
            incarnation=pub.state.incarnation,
            artifact=WeightArtifact(uri="/evil", lineage="delta", base=3),
        )
        await nats_bus.publish(subjects.weights(policy), forged, msg_id=f"{policy}:forged-delta")
        async with asyncio.timeout(5):
            seen = await anext(changes)
        await changes.aclose()
        assert (seen.incoming, seen.version, seen.reason) == (4, 2, "unexplained_base")
        assert running.current == 2
        # A tracker that starts now replays the whole history and refuses it too.
        async with VersionTracker(nats_bus, policy, registry=fresh_registry) as fresh:
            assert fresh.current == 2
    for registry in (running_registry, fresh_registry):
        assert _count(registry, "weightbus_events_rejected_total", policy, reason="unexplained_base") == 1
        assert _count(registry, "weightbus_unverified_bases_total", policy) == 0
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert [(a.reason, a.event_type, a.incoming, a.current) for a in alerts if isinstance(a, VersionRejected)] == [
        ("unexplained_base", "WeightUpdated", 4, 2)
    ]


async def test_the_held_version_announced_again_for_other_bytes_is_rejected_and_alerted(
    nats_bus: NatsBus, policy: str
) -> None:
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with pub.update(artifact=WeightArtifact(uri="/w1", manifest_digest="sha256:" + "a" * 64)):
        pass
    assert pub.state.epoch is not None and pub.state.version == 1
    registry = CollectorRegistry()
    async with VersionTracker(nats_bus, policy, registry=registry) as running:
        changes = running.changes(include_regressions=True)
        assert (await anext(changes)).version == 1
        # A buggy trainer (the owner's identity) announces 1 again, for bytes it wrote later.
        again = WeightUpdated(
            policy=policy,
            version=1,
            epoch=pub.state.epoch,
            trainer_id="t",
            published_at=now(),
            incarnation=pub.state.incarnation,
            artifact=WeightArtifact(uri="/w1", manifest_digest="sha256:" + "b" * 64),
        )
        await nats_bus.publish(subjects.weights(policy), again, msg_id=f"{policy}:again")
        async with asyncio.timeout(5):
            seen = await anext(changes)
        await changes.aclose()
        assert (seen.incoming, seen.version, seen.reason) == (1, 1, "conflicting_artifact")
    assert _count(registry, "weightbus_events_rejected_total", policy, reason="conflicting_artifact") == 1
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert [(a.reason, a.incoming, a.current) for a in alerts if isinstance(a, VersionRejected)] == [
        ("conflicting_artifact", 1, 1)
    ]
