"""The rollout client's version-constrained requests: straight to an engine the replica view knows serves an allowed
version (strict reference engines, a ``MemoryBus``, no router); each sample records the version it started on."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated, wait_until
from tests.producers.conftest import Engines
from weightbus.bus import MemoryBus, subjects
from weightbus.consumers import VersionTracker
from weightbus.consumers.replicas import ReplicaFollower, VersionConstraint, VersionRouter
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.rl.config import RolloutConfig
from weightbus.rl.rollout import _Rollout, generate_group
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


async def test_a_rollout_that_requires_the_current_version_sends_nothing_through_the_router() -> None:
    engine, router = EngineState(weight_version="1"), EngineState(weight_version="1")
    bus = MemoryBus()
    registry = CollectorRegistry()
    with ServedEngine(create_app(engine)) as served, ServedEngine(create_app(router)) as router_served:
        # Announced to both, acknowledged by one: only that one may serve a request for v1.
        await _publish(bus, updated(1, engines=(served.url, router_served.url)), ack(1, served.url))
        config = RolloutConfig(
            nats_url="nats://unused",
            router_url=router_served.url,
            policy="p",
            group_size=2,
            in_flight=1,
            batch=1,
            admission="off",
            require_version="current",
        )
        rollout = _Rollout(config, ReverseDigits(3), bus, registry, None)
        async with VersionTracker(bus, "p", registry=registry) as tracker:
            running = asyncio.create_task(rollout.run(tracker))
            try:
                # Until the buffer is full: the producer then waits in put(), cancelled there rather than mid-request.
                await wait_until(lambda: len(rollout.buffer) == rollout.buffer.capacity, timeout=10)
                await asyncio.sleep(0.05)
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
    await bus.aclose()
    assert router.recorded("/generate") == []
    sent = len(engine.recorded("/generate"))
    assert sent >= 2 * rollout.buffer.capacity
    assert registry.get_sample_value("weightbus_request_version_over_requested_count", {"policy": "p"}) == sent


async def test_a_request_the_http_client_breaks_inside_is_an_engine_error_the_producer_recycles() -> None:
    # An engine restarted as a request connected broke anyio under httpx on uvloop (AttributeError): it must be a
    # failed generation (the group recycled and generated again), never the end of the rollout.
    import httpx

    from weightbus.errors import EngineError
    from weightbus.rl.rollout import _GENERATION_FAILURES

    def broken(request: httpx.Request) -> httpx.Response:
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    config = RolloutConfig(nats_url="nats://unused", router_url="http://router", policy="p", group_size=2)
    async with httpx.AsyncClient(base_url="http://router", transport=httpx.MockTransport(broken)) as http:
        with pytest.raises(EngineError) as caught:
            await generate_group(http, config, ReverseDigits(3), Group(prompt_index=0), "407.", itertools.count())
    assert caught.value.url == "http://router" and "getpeername" in caught.value.message
    assert isinstance(caught.value, _GENERATION_FAILURES)
