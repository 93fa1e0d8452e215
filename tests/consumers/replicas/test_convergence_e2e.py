"""Convergence end to end: a real nats-server, strict reference engines, the publisher's stamping path.

What the follower records (its view, its histograms) is checked against the stored events' own timestamps, read back
from the stream afterwards; an engine whose acknowledgement never reaches the bus leaves the version unconverged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
from prometheus_client import CollectorRegistry

from tests.producers.conftest import Engines, HookBus
from weightbus.bus import NatsBus, subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.protocol import PublishAck
from weightbus.consumers.replicas import ConvergenceMetrics, ReplicaFollower, read_replicas
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.rules.replicas import Convergence, ReplicaView
from weightbus.schemas import Event, WeightApplied, WeightUpdated

pytestmark = pytest.mark.nats

SHARES = (1.0, 0.5)


def value(registry: CollectorRegistry, policy: str, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"policy": policy, **labels})


async def _stored(bus: NatsBus, policy: str) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """Announcement times and ok acknowledgement times per version, as the stream stored them."""
    announced = {
        e.event.version: e.event.published_at
        for e in (await read_subject_history(bus, subjects.weights(policy))).events
        if isinstance(e.event, WeightUpdated)
    }
    acks: dict[int, dict[str, float]] = {}
    for env in (await read_subject_history(bus, subjects.applied(policy))).events:
        if isinstance(env.event, WeightApplied) and env.event.ok:
            acks.setdefault(env.event.version, {})[env.event.engine] = env.event.published_at
    return announced, acks


def _converged(version: int) -> Callable[[ReplicaView], Convergence | None]:
    def found(view: ReplicaView) -> Convergence | None:
        conv = view.convergence(version)
        return conv if conv is not None and conv.converged else None

    return found


async def test_recorded_convergence_matches_the_events_own_timestamps(nats_bus: NatsBus, policy: str) -> None:
    engines = Engines()
    fleet = EngineFleet([engines.add(name) for name in ("a", "b", "c")])
    registry = CollectorRegistry()
    metrics = ConvergenceMetrics(registry, SHARES).for_policy(policy)
    publisher = VersionPublisher(nats_bus, policy, fleet=fleet, pause="in_place")
    try:
        async with ReplicaFollower(nats_bus, policy, metrics=metrics) as follower:
            await follower.wait_ready(10)
            await publisher.start()
            for _ in range(3):
                async with publisher.update() as version:
                    for client in fleet.clients:
                        await client.update_weights_from_disk(f"/ckpt/step-{version}")
                await follower.wait_until(_converged(version), 10)
            view = follower.view
        announced, acks = await _stored(nats_bus, policy)
        assert sorted(announced) == [1, 2, 3] and all(len(acks[v]) == 3 for v in announced)
        for version, at in announced.items():
            rollout = view.versions[version]
            assert rollout.announced_at == at and dict(rollout.acks) == acks[version]
            times = sorted(max(0.0, t - at) for t in acks[version].values())
            assert rollout.time_to_converge(1.0) == pytest.approx(times[-1])
            assert rollout.time_to_converge(0.5) == pytest.approx(times[1])  # ceil(0.5 * 3) = the 2nd engine
        expected_full = sum(max(0.0, max(acks[v].values()) - announced[v]) for v in announced)
        expected_each = sum(max(0.0, t - announced[v]) for v in announced for t in acks[v].values())
        assert value(registry, policy, "weightbus_version_convergence_seconds_count", share="1") == 3
        assert value(registry, policy, "weightbus_version_convergence_seconds_sum", share="1") == pytest.approx(
            expected_full
        )
        assert value(registry, policy, "weightbus_engine_activation_seconds_count") == 9
        assert value(registry, policy, "weightbus_engine_activation_seconds_sum") == pytest.approx(expected_each)
        assert value(registry, policy, "weightbus_replicas_serving_newest") == 3
        assert value(registry, policy, "weightbus_unconverged_since_timestamp_seconds") == 0
    finally:
        await engines.http.aclose()


class _LosesAcks(HookBus):
    """The trainer's bus, losing every ``WeightApplied`` of one engine (its process died before that publish)."""

    def __init__(self, inner: NatsBus, engine: str) -> None:
        async def nothing(subject: str, event: Event) -> None:
            return None

        super().__init__(inner, nothing)
        self.engine = engine

    async def publish(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str,
        expected_last_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        if isinstance(event, WeightApplied) and event.engine == self.engine:
            return PublishAck(seq=0)
        return await super().publish(
            subject, event, msg_id=msg_id, expected_last_seq=expected_last_seq, headers=headers
        )


async def test_an_engine_that_never_acknowledges_leaves_the_version_unconverged(nats_bus: NatsBus, policy: str) -> None:
    engines = Engines()
    fleet = EngineFleet([engines.add(name) for name in ("a", "b", "c")])
    registry = CollectorRegistry()
    metrics = ConvergenceMetrics(registry, SHARES).for_policy(policy)
    publisher = VersionPublisher(_LosesAcks(nats_bus, "http://c"), policy, fleet=fleet)
    try:
        async with ReplicaFollower(nats_bus, policy, metrics=metrics) as follower:
            await follower.wait_ready(10)
            await publisher.start()
            async with publisher.update():
                pass
            view = await follower.wait_until(lambda v: v if len(v.serving(exact_version=1)) == 2 else None, 10)
        announced, acks = await _stored(nats_bus, policy)
        assert sorted(acks[1]) == ["http://a", "http://b"]
        conv = view.convergence()
        assert conv is not None and (conv.version, conv.serving, conv.fleet, conv.converged) == (1, 2, 3, False)
        assert view.versions[1].fleet == ("http://a", "http://b", "http://c")  # the announcement names c
        # The alert's input: the announcement time of the unconverged version, straight from the stored event.
        assert value(registry, policy, "weightbus_unconverged_since_timestamp_seconds") == announced[1]
        assert value(registry, policy, "weightbus_version_convergence_seconds_count", share="1") == 0
        assert value(registry, policy, "weightbus_version_convergence_seconds_count", share="0.5") == 1
        assert value(registry, policy, "weightbus_replicas_serving_newest") == 2
        assert value(registry, policy, "weightbus_replicas_fleet") == 3
        # weightbus status reads the same view from the history alone.
        again = await read_replicas(nats_bus, policy)
        assert again.convergence() == conv and again.unconverged_since() == announced[1]
    finally:
        await engines.http.aclose()
