"""Version-constrained requests: picks from the live replica view, the typed error after the bound (``MemoryBus``)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated
from weightbus.bus import MemoryBus
from weightbus.consumers.replicas import ReplicaFollower, RequestMetrics, VersionConstraint, VersionRouter
from weightbus.errors import VersionUnavailableError
from weightbus.schemas import FleetQuarantined, WeightApplied

A, B, C = "http://a", "http://b", "http://c"


def ack(version: int, engine: str, at: float | None = None) -> WeightApplied:
    at = time.time() if at is None else at
    return WeightApplied(policy="p", version=version, engine=engine, read_back=str(version), ok=True, published_at=at)


async def _publish(bus: MemoryBus, *events: object) -> None:
    for n, event in enumerate(events):
        family = "applied" if isinstance(event, WeightApplied) else "alerts"
        if not isinstance(event, WeightApplied | FleetQuarantined):
            family = "weights"
        await bus.publish(f"weightbus.p.{family}", event, msg_id=f"{family}:{n}:{time.time_ns()}")  # type: ignore[arg-type]


async def test_a_constraint_no_engine_meets_raises_the_typed_error_after_the_bound() -> None:
    bus = MemoryBus()
    registry = CollectorRegistry()
    await _publish(bus, updated(3, engines=(A, B)), ack(3, A), ack(3, B))
    async with ReplicaFollower(bus, "p") as follower:
        router = VersionRouter(follower, wait_s=0.3, metrics=RequestMetrics(registry).for_policy("p"))
        started = time.monotonic()
        with pytest.raises(VersionUnavailableError) as caught:
            await router.pick(VersionConstraint(min_version=4))
        assert time.monotonic() - started >= 0.3
        err = caught.value
        assert err.retryable and (err.min_version, err.exact_version, err.newest) == (4, None, 3)
        assert err.serving == {A: 3, B: 3} and "v4 or newer" in str(err)
        with pytest.raises(VersionUnavailableError):
            await router.pick(VersionConstraint(exact_version=2))
    for kind in ("min", "exact"):
        labels = {"policy": "p", "constraint": kind}
        assert registry.get_sample_value("weightbus_request_version_unavailable_total", labels) == 1
    await bus.aclose()


async def test_an_exact_version_goes_only_to_the_engine_that_acknowledged_it() -> None:
    bus = MemoryBus()
    registry = CollectorRegistry()
    await _publish(bus, ack(3, A), ack(4, B), updated(5, engines=(A, B, C)), ack(5, C))
    async with ReplicaFollower(bus, "p") as follower:
        router = VersionRouter(
            follower, wait_s=1, rng=random.Random(0), metrics=RequestMetrics(registry).for_policy("p")
        )
        picks = [await router.pick(VersionConstraint(exact_version=4)) for _ in range(20)]
    assert {(p.engine, p.version, p.newest) for p in picks} == {(B, 4, 5)}
    labels = {"policy": "p"}
    assert registry.get_sample_value("weightbus_request_version_over_requested_sum", labels) == 0
    assert registry.get_sample_value("weightbus_request_version_behind_newest_sum", labels) == 20  # 5 - 4, each
    await bus.aclose()


async def test_a_min_version_while_the_fleet_converges() -> None:
    bus = MemoryBus()
    await _publish(bus, updated(1, engines=(A, B)), ack(1, A), ack(1, B), updated(2, engines=(A, B)), ack(2, A))
    async with ReplicaFollower(bus, "p") as follower:
        router = VersionRouter(follower, wait_s=5, rng=random.Random(1))
        picks = {
            (p.engine, p.version) for p in [await router.pick(VersionConstraint(min_version=2)) for _ in range(20)]
        }
        assert picks == {(A, 2)}  # B announced for v2 but not acknowledged: never picked
        waiting = asyncio.create_task(router.pick(VersionConstraint(min_version=3)))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await _publish(bus, updated(3, engines=(A, B)), ack(3, B))
        picked = await asyncio.wait_for(waiting, 5)
        assert (picked.engine, picked.version) == (B, 3)
        # A quarantine takes B out again: what it acknowledged before no longer counts.
        quarantine = FleetQuarantined(
            policy="p",
            label="quarantine:4",
            reason="update_failed",
            version=4,
            trainer_id="t",
            published_at=time.time(),
            engines=(B,),
        )
        await _publish(bus, quarantine)
        await follower.wait_until(lambda v: v if v.engines[B].serving is None else None, 5)
        with pytest.raises(VersionUnavailableError):
            await VersionRouter(follower, wait_s=0.2).pick(VersionConstraint(min_version=3))
    await bus.aclose()


def test_constraints_are_checked() -> None:
    with pytest.raises(ValueError):
        VersionConstraint(min_version=-1)
    with pytest.raises(ValueError):
        VersionConstraint(min_version=5, exact_version=4)
    assert VersionConstraint(min_version=2, exact_version=3).requested == 3
