"""``ReplicaFollower`` on a ``MemoryBus``: ready after the history, histograms for live events only."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated, wait_until
from weightbus.bus import MemoryBus, subjects
from weightbus.bus.trace import REPLAYED_HEADER
from weightbus.consumers.replicas import ConvergenceMetrics, ReplicaFollower
from weightbus.schemas import WeightApplied

A, B = "http://a", "http://b"


def ack(version: int, engine: str, at: float) -> WeightApplied:
    return WeightApplied(policy="p", version=version, engine=engine, read_back=str(version), ok=True, published_at=at)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"policy": "p", **labels})


async def test_history_sets_the_view_and_gauges_but_observes_nothing() -> None:
    bus = MemoryBus()
    registry = CollectorRegistry()
    await bus.publish(subjects.weights("p"), updated(1, at=10.0, engines=(A, B)), msg_id="w1")
    await bus.publish(subjects.applied("p"), ack(1, A, 10.5), msg_id="a1")
    async with ReplicaFollower(bus, "p", metrics=ConvergenceMetrics(registry).for_policy("p")) as follower:
        view = await follower.wait_ready(5)
        assert view.engines[A].serving == 1
        assert sample(registry, "weightbus_replicas_serving_newest") == 1
        assert sample(registry, "weightbus_replicas_fleet") == 2
        assert sample(registry, "weightbus_unconverged_since_timestamp_seconds") == 10.0
        assert sample(registry, "weightbus_engine_activation_seconds_count") == 0
        # Live: B acknowledges; v1 converges 2 s after its announcement (the events' times, not the receipt's).
        await bus.publish(subjects.applied("p"), ack(1, B, 12.0), msg_id="b1")
        await wait_until(lambda: sample(registry, "weightbus_replicas_serving_newest") == 2)
        assert sample(registry, "weightbus_engine_activation_seconds_count") == 1
        assert sample(registry, "weightbus_engine_activation_seconds_sum") == pytest.approx(2.0)
        for share in ("1", "0.9"):
            assert sample(registry, "weightbus_version_convergence_seconds_sum", share=share) == pytest.approx(2.0)
        assert sample(registry, "weightbus_unconverged_since_timestamp_seconds") == 0
        found = await follower.wait_until(lambda v: v.serving(exact_version=1) or None, 1)
        assert found == (A, B)
    await bus.aclose()


async def test_republished_events_are_not_observed() -> None:
    bus = MemoryBus()
    registry = CollectorRegistry()
    async with ReplicaFollower(bus, "p", metrics=ConvergenceMetrics(registry).for_policy("p")) as follower:
        await follower.wait_ready(5)
        replayed = {REPLAYED_HEADER: "1"}
        await bus.publish(subjects.weights("p"), updated(1, at=10.0, engines=(A,)), msg_id="w1", headers=replayed)
        await bus.publish(subjects.applied("p"), ack(1, A, 10.5), msg_id="a1", headers=replayed)
        await wait_until(lambda: follower.view.engines.get(A) is not None)
        assert sample(registry, "weightbus_engine_activation_seconds_count") == 0
        assert sample(registry, "weightbus_version_convergence_seconds_count", share="1") == 0
        assert sample(registry, "weightbus_replicas_serving_newest") == 1
    await bus.aclose()


async def test_wait_until_times_out_when_nothing_satisfies() -> None:
    bus = MemoryBus()
    async with ReplicaFollower(bus, "p") as follower:
        with pytest.raises(TimeoutError):
            await follower.wait_until(lambda v: v.serving(min_version=1) or None, 0.2)
    await bus.aclose()


def test_shares_are_checked() -> None:
    with pytest.raises(ValueError):
        ConvergenceMetrics(CollectorRegistry(), shares=(1.5,))
