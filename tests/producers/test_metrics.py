"""The trainer side's metrics: each update's phases once, labelled by how it ended, and the counter's state."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from weightbus.bus.protocol import Bus
from weightbus.errors import FencedError
from weightbus.producers import EngineFleet, SyncVersionPublisher, VersionPublisher
from weightbus.producers.metrics import PublisherMetrics

from .conftest import Engines


def _count(registry: CollectorRegistry, policy: str, phase: str, outcome: str) -> float:
    labels = {"policy": policy, "phase": phase, "outcome": outcome}
    return registry.get_sample_value("weightbus_update_phase_seconds_count", labels) or 0.0


def _gauge(registry: CollectorRegistry, name: str, policy: str) -> float | None:
    return registry.get_sample_value(f"weightbus_publisher_{name}", {"policy": policy})


def _phases(registry: CollectorRegistry, policy: str, outcome: str) -> dict[str, float]:
    found = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "weightbus_update_phase_seconds_count" and sample.labels["policy"] == policy:
                if sample.labels["outcome"] == outcome and sample.value:
                    found[sample.labels["phase"]] = sample.value
    return found


async def test_an_update_records_each_phase_once_and_the_gauges_follow_the_state(
    bus: Bus, policy: str, engines: Engines
) -> None:
    registry = CollectorRegistry()
    fleet = EngineFleet([engines.add("a"), engines.add("b")])
    pub = await VersionPublisher(bus, policy, fleet=fleet, pause="retract", registry=registry).start()
    update = pub.update()
    async with update as version:
        await fleet.read_versions()  # stands for the push: the engines keep their pending label for the stamp
    phases = _phases(registry, policy, "announced")
    assert phases == dict.fromkeys(("take", "pause", "relabel", "push", "stamp", "announce", "resume"), 1.0)
    assert set(update.phases) == set(phases) and all(s >= 0 for s in update.phases.values())
    total = registry.get_sample_value(
        "weightbus_update_phase_seconds_sum", {"policy": policy, "phase": "push", "outcome": "announced"}
    )
    assert total == pytest.approx(update.phases["push"])
    state = pub.state
    assert _gauge(registry, "version", policy) == state.version == version
    assert _gauge(registry, "next_version", policy) == state.next_version
    assert _gauge(registry, "issued", policy) == state.issued
    assert _gauge(registry, "epoch", policy) == state.epoch == 0
    assert _gauge(registry, "fenced", policy) == 0
    async with pub.update():
        pass
    assert _count(registry, policy, "push", "announced") == 2  # no double count, and the gauges moved on
    assert _gauge(registry, "version", policy) == pub.state.version == version + 1


async def test_a_failed_push_records_pause_and_push_but_no_announce(bus: Bus, policy: str, engines: Engines) -> None:
    registry = CollectorRegistry()
    fleet = EngineFleet([engines.add("a")])
    pub = await VersionPublisher(bus, policy, fleet=fleet, pause="retract", registry=registry).start()
    with pytest.raises(RuntimeError, match="push broke"):
        async with pub.update():
            raise RuntimeError("push broke")
    phases = _phases(registry, policy, "failed")
    assert {"pause", "push", "quarantine", "resume"} <= set(phases)
    assert "announce" not in phases and "stamp" not in phases
    assert all(n == 1 for n in phases.values())
    assert not _phases(registry, policy, "announced")
    assert _gauge(registry, "version", policy) is None  # nothing announced yet


async def test_a_fenced_publisher_shows_fenced_and_its_refused_update_records_nothing_twice(
    bus: Bus, policy: str
) -> None:
    metrics = PublisherMetrics(CollectorRegistry())
    old = await VersionPublisher(bus, policy, trainer_id="old", metrics=metrics).start()
    async with old.update():
        pass
    await VersionPublisher(bus, policy, trainer_id="new").start()  # another registry: not exported here
    with pytest.raises(FencedError):
        async with old.update():
            pass
    registry = metrics.registry
    assert _gauge(registry, "fenced", policy) == 1 == int(old.state.fenced is not None)
    assert _count(registry, policy, "take", "failed") == 1
    assert _count(registry, policy, "take", "announced") == 1
    assert _count(registry, policy, "announce", "failed") == 0


def test_the_sync_publisher_exports_on_the_given_registry(policy: str) -> None:
    from weightbus.bus import MemoryBus

    registry = CollectorRegistry()
    mem = MemoryBus()

    async def factory() -> Bus:
        return mem

    with SyncVersionPublisher(policy, bus_factory=factory, registry=registry) as pub:
        with pub.update():
            pass
        assert _phases(registry, policy, "announced") == {"take": 1.0, "push": 1.0, "announce": 1.0}
        assert _gauge(registry, "version", policy) == pub.state.version
