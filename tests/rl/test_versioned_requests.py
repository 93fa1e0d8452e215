"""The rollout client's version-constrained requests: straight to an engine the replica view knows serves an allowed
version (strict reference engines, a ``MemoryBus``, no router); each sample records the version it started on."""

from __future__ import annotations

import itertools
import time

import pytest

from tests._builders import updated
from tests.producers.conftest import Engines
from weightbus.bus import MemoryBus, subjects
from weightbus.consumers.replicas import ReplicaFollower, VersionConstraint, VersionRouter
from weightbus.rl.config import RolloutConfig
from weightbus.rl.rollout import generate_group
from weightbus.rl.task import ReverseDigits
from weightbus.rules.staleness import group_versions, judge
from weightbus.schemas import WeightApplied
from weightbus.schemas.rollouts import Group

A, B = "http://a", "http://b"


def ack(version: int, engine: str) -> WeightApplied:
    return WeightApplied(
        policy="p", version=version, engine=engine, read_back=str(version), ok=True, published_at=time.time()
    )


async def _publish(bus: MemoryBus, *events: object) -> None:
    for n, event in enumerate(events):
        subject = subjects.applied("p") if isinstance(event, WeightApplied) else subjects.weights("p")
        await bus.publish(subject, event, msg_id=f"{n}:{time.time_ns()}")  # type: ignore[arg-type]


async def test_samples_record_the_version_they_started_on_and_the_drain_judges_it() -> None:
    engines = Engines()
    engines.add("a", weight_version="2")
    engines.add("b", weight_version="1")
    bus = MemoryBus()
    # a was restamped to 3 while its acknowledgement has not arrived yet: the view still says 2.
    engines.states[A].weight_version = "3"
    await _publish(bus, updated(2, engines=(A, B)), ack(2, A), ack(1, B))
    config = RolloutConfig(nats_url="nats://unused", router_url="http://router", policy="p", group_size=3)
    task = ReverseDigits(3)
    try:
        async with ReplicaFollower(bus, "p") as follower:
            router = VersionRouter(follower, wait_s=1)
            group = await generate_group(
                engines.http,
                config,
                task,
                Group(prompt_index=0),
                "407.",
                itertools.count(),
                versions=router,
                constraint=VersionConstraint(min_version=2),
            )
            exact = await generate_group(
                engines.http,
                config,
                task,
                Group(prompt_index=1),
                "123.",
                itertools.count(),
                versions=router,
                constraint=VersionConstraint(exact_version=1),
            )
    finally:
        await engines.http.aclose()
        await bus.aclose()
    assert all(s.weight_versions == ["2", "3"] for s in group.samples)  # the start, then the end
    assert len(engines.states[A].recorded("/generate")) == 3
    assert all(s.weight_versions == ["1", "1"] for s in exact.samples)
    assert len(engines.states[B].recorded("/generate")) == 3
    # Judged by the start version: stale at 3 with a bound of 0, though every answer said 3.
    verdict = judge(group_versions(group), 3, max_staleness=0)
    assert (verdict.reason, verdict.staleness) == ("stale", 1)


async def test_a_constraint_needs_a_router() -> None:
    config = RolloutConfig(nats_url="nats://unused", router_url="http://router", policy="p", group_size=2)
    with pytest.raises(ValueError):
        await generate_group(
            None,
            config,
            ReverseDigits(3),
            Group(prompt_index=0),
            "1.",
            itertools.count(),  # type: ignore[arg-type]
            constraint=VersionConstraint(min_version=1),
        )
