"""The publisher's integrity on a real nats-server: one number names one set of weights, ever.

Each test kills, cancels, races or corrupts the thing and asserts from what the bus recorded and what
the reference engines were told, not from logs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from weightbus.bus import NatsBus, connect, subjects
from weightbus.bus.protocol import Bus, Envelope, PublishAck
from weightbus.consumers import VersionTracker
from weightbus.errors import EngineOutOfSyncError, FencedError
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.schemas import (
    EngineOutOfSync,
    Event,
    FleetQuarantined,
    VersionRejected,
    VersionReserved,
    WeightUpdated,
    now,
)

from .conftest import Engines, history

pytestmark = pytest.mark.nats


def _announced(events: list[Envelope]) -> list[tuple[int, str]]:
    return [(e.event.version, e.event.incarnation) for e in events if isinstance(e.event, WeightUpdated)]


def _stamped_numbers(engines: Engines, url: str) -> list[str]:
    return [r.body["new_version"] for r in engines.states[url].recorded("/update_weight_version")]


async def test_a_zombie_fenced_mid_update_never_labels_engines_with_a_number(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    a_engine, b_engine = engines.add("e1"), engines.add("e2")
    fleet = EngineFleet([a_engine, b_engine])
    zombie = await VersionPublisher(nats_bus, policy, trainer_id="cell-0", fleet=fleet, pause="retract").start()
    z = zombie.update()
    assert await z.__aenter__() == 1  # reserved 1, paused; now the cell is presumed dead and replaced
    owner = await VersionPublisher(nats_bus, policy, trainer_id="cell-1", fleet=fleet, pause="retract").start()
    o = owner.update()
    assert await o.__aenter__() == 2  # the owner never reuses the zombie's reserved number
    with pytest.raises(FencedError) as info:
        await z.__aexit__(None, None, None)  # the zombie's push is done; it tries to finish
    assert info.value.owner == "cell-1"
    # It resumes although the owner is mid-update (it cannot know): samples generated until the owner's
    # announcement carry the quarantine label, judged stale, or the owner's unannounced number.
    assert z.quarantined is not None and z.quarantined.resumed
    for url in fleet.urls:
        assert engines.states[url].weight_version == "quarantine:1"
        assert "1" not in _stamped_numbers(engines, url)  # never relabelled with a number
    # The zombie relabelled the engines during the owner's push: whatever it pushed may be on them, so the
    # owner stamps nothing (its pending label is gone), quarantines and tries again.
    with pytest.raises(EngineOutOfSyncError, match="pending:2"):
        await o.__aexit__(None, None, None)
    for url in fleet.urls:
        assert engines.states[url].weight_version == "quarantine:2" and engines.states[url].pause_mode is None
    async with owner.update() as version:
        assert version == 3
    for url in fleet.urls:
        assert engines.states[url].weight_version == "3" and engines.states[url].pause_mode is None
    recorded = await history(nats_bus, subjects.weights(policy))
    assert _announced(recorded) == [(3, owner.incarnation)]
    applied = [e.event for e in await history(nats_bus, subjects.applied(policy))]
    assert {(x.version, x.ok) for x in applied if x.version == 3} == {(3, True)}
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert any(isinstance(x, FleetQuarantined) and x.reason == "fenced" and x.version == 1 for x in alerts)
    assert any(isinstance(x, FleetQuarantined) and x.reason == "update_failed" and x.version == 2 for x in alerts)


async def test_a_fenced_zombie_resumes_the_fleet_and_never_pauses_it_again(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1")])
    zombie = await VersionPublisher(nats_bus, policy, trainer_id="cell-0", fleet=fleet, pause="retract").start()
    z = zombie.update()
    await z.__aenter__()
    await VersionPublisher(nats_bus, policy, trainer_id="cell-1", fleet=fleet).start()  # idle owner
    with pytest.raises(FencedError):
        await z.__aexit__(None, None, None)
    state = engines.states["http://e1"]
    # Nobody else paused them: a stalled fleet would deadlock the owner, and the label is non-numeric.
    assert state.pause_mode is None and state.weight_version == "quarantine:1"
    pauses = len(state.recorded("/pause_generation"))
    for _ in range(3):  # a zombie's training loop goes on calling update()
        with pytest.raises(FencedError):
            async with zombie.update():
                pytest.fail("a fenced publisher's block never runs")
    assert len(state.recorded("/pause_generation")) == pauses  # the owner's generation is not aborted again


async def test_two_publishers_with_one_trainer_id_starting_together_have_exactly_one_owner(
    nats_url: str, policy: str
) -> None:
    buses = [await connect(nats_url), await connect(nats_url)]
    try:
        pubs = [VersionPublisher(b, policy, trainer_id="host:1234") for b in buses]  # a restarted pod's pid
        await asyncio.gather(*(p.start() for p in pubs))

        async def rounds(pub: VersionPublisher) -> list[int | str]:
            out: list[int | str] = []
            for _ in range(3):
                try:
                    async with pub.update() as version:
                        await asyncio.sleep(0.01)
                    out.append(version)
                except FencedError:
                    out.append("fenced")
            return out

        results = await asyncio.gather(*(rounds(p) for p in pubs))
        winners = [r for r in results if r == [1, 2, 3]]
        losers = [r for r in results if r == ["fenced"] * 3]
        assert len(winners) == 1 and len(losers) == 1, results
        announced = _announced(await history(buses[0], subjects.weights(policy)))
        assert [v for v, _ in announced] == [1, 2, 3] and len({inc for _, inc in announced}) == 1
    finally:
        for b in buses:
            await b.close()


class _CancelAfterLanding:
    """Lets the announcement land on the bus, then raises ``CancelledError`` in the caller, once."""

    def __init__(self, inner: Bus) -> None:
        self.inner = inner
        self.armed = True

    async def publish(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str,
        expected_last_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        ack = await self.inner.publish(
            subject, event, msg_id=msg_id, expected_last_seq=expected_last_seq, headers=headers
        )
        if self.armed and isinstance(event, WeightUpdated):
            self.armed = False
            raise asyncio.CancelledError
        return ack

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


async def test_a_publish_cancelled_after_it_landed_is_in_doubt_not_a_fence(nats_bus: NatsBus, policy: str) -> None:
    pub = await VersionPublisher(_CancelAfterLanding(nats_bus), policy, trainer_id="t").start()  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        async with pub.update():
            pass
    for expected in (2, 3):
        async with pub.update() as version:
            assert version == expected
    assert pub.fenced is None and pub.version == 3
    assert [v for v, _ in _announced(await history(nats_bus, subjects.weights(policy)))] == [1, 2, 3]


async def test_one_stray_payload_stored_last_stops_nothing(nats_bus: NatsBus, policy: str) -> None:
    subject = subjects.weights(policy)
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with pub.update():
        pass
    await nats_bus.client.publish(subject, b"hello")  # `nats pub weightbus.P.weights hello`
    await nats_bus.client.flush()
    async with pub.update() as version:  # the running trainer
        assert version == 2
    await nats_bus.client.publish(subject, b"hello")
    await nats_bus.client.flush()
    again = await VersionPublisher(nats_bus, policy, trainer_id="t2").start()  # a new start()
    assert again.version == 2
    async with again.update() as version:
        assert version == 4  # 3 was reserved by the first publisher's announcement of 2
    async with VersionTracker(nats_bus, policy) as tracker:
        assert tracker.current == 4


async def test_out_of_range_and_unexplained_versions_are_never_adopted(
    nats_bus: NatsBus, policy: str, registry: object
) -> None:
    subject = subjects.weights(policy)
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with pub.update():
        pass
    for huge in (10**30, 2**64, 2**53):
        raw = b'{"type":"weight.updated","policy":"%s","version":%d,"epoch":0,"trainer_id":"x","published_at":1}' % (
            policy.encode(),
            huge,
        )
        await nats_bus.publish_raw(subject, raw, msg_id=f"{policy}:huge:{huge}")
    # Schema-valid, but nothing on the chain explains it: a forged owner identity without a reservation.
    forged = WeightUpdated(
        policy=policy, version=2**52, epoch=0, trainer_id="t", published_at=now(), incarnation=pub.incarnation
    )
    await nats_bus.publish(subject, forged, msg_id=f"{policy}:forged")
    async with VersionTracker(nats_bus, policy) as tracker:
        assert tracker.current == 1
    successor = await VersionPublisher(nats_bus, policy, trainer_id="u").start()
    # The counter folds the chain as trackers do: 1 announced, 2 reserved by that announcement.
    assert (successor.version, successor.next_version) == (1, 3)
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert any(isinstance(a, VersionRejected) and a.reason == "unexplained_jump" for a in alerts)


async def test_a_purged_history_is_resumed_above_the_engines_labels_and_trackers_hold(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1"), engines.add("e2")])
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet).start()
    async with VersionTracker(nats_bus, policy, check_interval=0.2) as tracker:
        for _ in range(3):
            async with pub.update():
                pass
        await tracker.wait_for(3, 5)
        await nats_bus.js.purge_stream(nats_bus.stream, subject=subjects.weights(policy))
        # A replacement trainer without a fleet would restart the counter at 1: trackers hold 3, loudly.
        blind = await VersionPublisher(nats_bus, policy, trainer_id="blind").start()
        async with blind.update() as version:
            assert version == 1
        # A replacement with the fleet resumes above the highest label any engine carries.
        restarted = await VersionPublisher(nats_bus, policy, trainer_id="t2", fleet=fleet).start()
        async with restarted.update() as version:
            assert version == 4
        assert await tracker.wait_for(4, 5) == 4
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    reasons = {getattr(a, "reason", type(a).__name__) for a in alerts}
    assert "counter_reset" in reasons  # the blind claim
    assert any(type(a).__name__ == "VersionRegressed" and a.incoming == 1 for a in alerts)


async def test_the_running_owner_survives_a_purge_by_reclaiming_its_counter(nats_bus: NatsBus, policy: str) -> None:
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with VersionTracker(nats_bus, policy, check_interval=0.2) as tracker:
        for _ in range(3):
            async with pub.update():
                pass
        await nats_bus.js.purge_stream(nats_bus.stream, subject=subjects.weights(policy))
        async with pub.update() as version:
            assert version == 4
        assert await tracker.wait_for(4, 5) == 4
    assert pub.fenced is None
    kinds = [type(e.event).__name__ for e in await history(nats_bus, subjects.weights(policy))]
    assert kinds == ["PublisherClaimed", "VersionReserved", "WeightUpdated"]


async def test_a_restarted_engine_is_alerted_before_it_is_stamped(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1"), engines.add("e2")])
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet).start()
    async with pub.update():
        pass
    engines.add("e2")  # the engine restarted: new process, boot label "default"
    async with pub.update() as version:
        assert version == 2
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    (alert,) = [a for a in alerts if isinstance(a, EngineOutOfSync)]
    assert (alert.engine, alert.actual, alert.expected) == ("http://e2", "default", "1")
    assert alert.reason == "unexpected_label"
    assert engines.states["http://e2"].weight_version == "2"


async def test_reservations_are_on_the_bus_before_any_engine_carries_the_number(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    a = engines.add("e1")
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=EngineFleet([a]), pause="in_place").start()
    async with pub.update() as version:
        last = await nats_bus.last(subjects.weights(policy))
        assert isinstance(last.event, VersionReserved) and last.event.version == version
        assert engines.states["http://e1"].weight_version == f"pending:{version}"  # not a number yet
        await a.update_weights_from_disk("/ckpt", weight_version=version)
    assert engines.states["http://e1"].weight_version == "1"


async def test_an_update_cancelled_during_its_resume_still_resumes_the_fleet(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1")])
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet, pause="retract").start()
    original = fleet.resume
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_resume() -> None:
        entered.set()
        await release.wait()
        await original()

    fleet.resume = slow_resume  # type: ignore[method-assign]

    async def one_update() -> None:
        async with pub.update():
            pass

    task = asyncio.create_task(one_update())
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()  # the trainer is stopped after the announcement, while the engines are being resumed
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    state = engines.states["http://e1"]
    for _ in range(250):
        if state.pause_mode is None:
            break
        await asyncio.sleep(0.02)
    assert state.pause_mode is None  # v is announced: a fleet left paused would stall every rollout
    assert state.weight_version == "1"  # and not quarantined: the number is on the bus
    last = await nats_bus.last(subjects.weights(policy))
    assert last is not None and isinstance(last.event, WeightUpdated) and last.event.version == 1


async def test_a_number_reserved_ahead_is_never_pushed_by_a_successor(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1")])
    zombie = await VersionPublisher(nats_bus, policy, trainer_id="cell-0", fleet=fleet, pause="retract").start()
    async with zombie.update() as version:
        assert version == 1  # announced with reserves_next: 2 is the zombie's
    z = zombie.update()
    assert await z.__aenter__() == 2  # taken with a read; now the cell is presumed dead and replaced
    owner = await VersionPublisher(nats_bus, policy, trainer_id="cell-1", fleet=fleet, pause="retract").start()
    async with owner.update() as version:
        assert version == 3  # 2 may be on its way to the engines from the zombie
    with pytest.raises(FencedError):
        await z.__aexit__(None, None, None)
    recorded = await history(nats_bus, subjects.weights(policy))
    assert _announced(recorded) == [(1, zombie.incarnation), (3, owner.incarnation)]
    assert "2" not in _stamped_numbers(engines, "http://e1")  # the zombie checks ownership before any stamp
    state = engines.states["http://e1"]
    assert state.weight_version == "quarantine:2" and state.pause_mode is None
    async with VersionTracker(nats_bus, policy) as tracker:
        assert tracker.current == 3


async def test_a_publisher_fenced_while_it_pauses_resumes_the_fleet_and_touches_nothing_else(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1")])
    old = await VersionPublisher(nats_bus, policy, trainer_id="cell-0", fleet=fleet, pause="retract").start()
    async with old.update():
        pass
    await VersionPublisher(nats_bus, policy, trainer_id="cell-1").start()  # takes over between two updates
    before = await nats_bus.last_seq(subjects.weights(policy))
    with pytest.raises(FencedError):
        async with old.update():
            pytest.fail("a fenced publisher's block never runs")
    state = engines.states["http://e1"]
    # The pause went out beside the fence read; the fleet is resumed and keeps its label.
    assert [p for p in engines.paths("http://e1") if p in ("/pause_generation", "/continue_generation")][-2:] == [
        "/pause_generation",
        "/continue_generation",
    ]
    assert state.pause_mode is None and state.weight_version == "1"
    assert await nats_bus.last_seq(subjects.weights(policy)) == before  # nothing stored by the fenced publisher
