"""The publisher's integrity on a real nats-server: one number names one set of weights, ever.

Each test kills, cancels, races or corrupts the thing and asserts from what the bus recorded and what
the reference engines were told, not from logs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated, wait_until
from weightbus.bus import NatsBus, connect, subjects
from weightbus.bus.protocol import Bus, Envelope, PublishAck
from weightbus.consumers import VersionTracker
from weightbus.errors import CounterExhaustedError, EngineOutOfSyncError, FencedError, PublishError
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.schemas import (
    MAX_VERSION,
    EngineOutOfSync,
    Event,
    FleetQuarantined,
    LoraAdapter,
    PublisherClaimed,
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
    """The numbers stamped on an engine, in order (the ``pending:<v>`` relabels before each push left out)."""
    labels = [r.body["new_version"] for r in engines.states[url].recorded("/update_weight_version")]
    return [label for label in labels if not label.startswith("pending:")]


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
    assert _announced(recorded) == [(3, owner.state.incarnation)]
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
            await b.aclose()


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
    assert pub.state.fenced is None and pub.state.version == 3
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
    assert again.state.version == 2
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
    forged = updated(2**52, policy=policy, epoch=0, incarnation=pub.state.incarnation)
    await nats_bus.publish(subject, forged, msg_id=f"{policy}:forged")
    async with VersionTracker(nats_bus, policy) as tracker:
        assert tracker.current == 1
    successor = await VersionPublisher(nats_bus, policy, trainer_id="u").start()
    # The counter folds the chain as trackers do: 1 announced, 2 reserved by that announcement.
    assert (successor.state.version, successor.state.next_version) == (1, 3)
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert any(isinstance(a, VersionRejected) and a.reason == "unexplained_jump" for a in alerts)


async def test_a_purged_history_is_resumed_above_the_counter_mark_and_trackers_hold(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1"), engines.add("e2")])
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet).start()
    async with VersionTracker(nats_bus, policy, check_interval=0.2) as tracker:
        for _ in range(3):
            async with pub.update():
                pass
        await tracker.wait_for(3, 5)
        await pub.settle()  # the mark after the last announcement (deferred by mark_delay) is written
        await nats_bus.js.purge_stream(nats_bus.stream, subject=subjects.weights(policy))
        # A replacement trainer without a fleet resumes above the counter's mark (4, reserved by the
        # announcement of 3): it used to restart at 1, reissuing numbers the engines had carried.
        blind = await VersionPublisher(nats_bus, policy, trainer_id="blind").start()
        async with blind.update() as version:
            assert version == 5
        # A replacement with the fleet resumes above the mark and the highest label any engine carries.
        restarted = await VersionPublisher(nats_bus, policy, trainer_id="t2", fleet=fleet).start()
        async with restarted.update() as version:
            assert version == 7  # 6 was reserved by the blind publisher's announcement of 5
        assert await tracker.wait_for(7, 5) == 7
    assert _announced(await history(nats_bus, subjects.weights(policy))) == [
        (5, blind.state.incarnation),
        (7, restarted.state.incarnation),
    ]
    for url in fleet.urls:
        assert _stamped_numbers(engines, url) == ["1", "2", "3", "7"]
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    reasons = {getattr(a, "reason", type(a).__name__) for a in alerts}
    # The blind claim names 3, the mark's announced (written once 3 was stored): what trackers hold, no reset.
    assert "counter_reset" not in reasons
    assert not any(type(a).__name__ == "VersionRegressed" for a in alerts)  # no version went backwards


async def test_a_history_purged_before_the_deferred_mark_is_written_reissues_no_carried_number(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    # The purge lands inside mark_delay: the newest mark covers 3 (written at its take) but not 4, which the
    # announcement of 3 reserved, and names 2 as announced. Nothing carried 4, so a blind successor may take
    # it; no engine may ever carry a number twice, and the running owner must not lower the mark later.
    fleet = EngineFleet([engines.add("e1")])
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet, mark_delay=30).start()
    registry = CollectorRegistry()
    async with VersionTracker(nats_bus, policy, registry=registry, check_interval=0.2) as tracker:
        for _ in range(3):
            async with pub.update():
                pass
        await tracker.wait_for(3, 5)
        await nats_bus.js.purge_stream(nats_bus.stream, subject=subjects.weights(policy))
        blind = await VersionPublisher(nats_bus, policy, trainer_id="blind", mark_delay=0).start()
        async with blind.update() as version:
            assert version == 4  # above the mark (3); 4 was reserved ahead by t, never carried
        await pub.settle()  # t's deferred mark, after the successor's: t is fenced and stores nothing
        with pytest.raises(FencedError):
            async with pub.update():
                pytest.fail("the fenced owner's block never runs")
        restarted = await VersionPublisher(nats_bus, policy, trainer_id="t2", fleet=fleet).start()
        async with restarted.update() as version:
            assert version == 6  # 5 was reserved by the blind announcement of 4
        assert await tracker.wait_for(6, 5) == 6
    announced = [v for v, _ in _announced(await history(nats_bus, subjects.weights(policy)))]
    assert announced == [4, 6]
    assert _stamped_numbers(engines, "http://e1") == ["1", "2", "3", "6"]  # each number once, none of blind's
    marks = [e.event.version for e in await history(nats_bus, subjects.counter(policy))]
    assert marks == sorted(marks), f"the mark went down: {marks}"
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert not any(type(a).__name__ == "VersionRegressed" for a in alerts)
    # The blind claim names 2 (the newest mark's announced) while trackers hold 3: reported, and held.
    assert _rejected_total(registry, policy, "counter_reset") == 1


_TRAINER = """
import asyncio, sys
from weightbus.bus import connect
from weightbus.producers import VersionPublisher

async def main() -> None:
    bus = await connect(sys.argv[1])
    pub = await VersionPublisher(bus, sys.argv[2], trainer_id="killed", mark_delay=60).start()
    for _ in range(3):
        async with pub.update():
            pass
    print("announced", flush=True)
    await asyncio.sleep(3600)  # killed here, its mark after v3 still waiting

asyncio.run(main())
"""


async def test_a_trainer_killed_while_its_mark_waits_reissues_no_number(
    nats_bus: NatsBus, nats_url: str, policy: str
) -> None:
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, nats_url, policy], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "announced"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    marks = [e.event.version for e in await history(nats_bus, subjects.counter(policy))]
    assert marks[-1] == 3  # the take's own; the one for 4 never written
    # With the history: above 4, which the announcement of 3 reserved.
    restarted = await VersionPublisher(nats_bus, policy, trainer_id="restarted", mark_delay=0).start()
    async with restarted.update() as version:
        assert version == 5
    # And without it: above the restarted trainer's numbers, never one a trainer announced.
    await nats_bus.js.purge_stream(nats_bus.stream, subject=subjects.weights(policy))
    blind = await VersionPublisher(nats_bus, policy, trainer_id="blind").start()
    async with blind.update() as version:
        assert version > 5
    marks = [e.event.version for e in await history(nats_bus, subjects.counter(policy))]
    assert marks == sorted(marks), f"the mark went down: {marks}"


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
    assert pub.state.fenced is None
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
    await wait_until(lambda: state.pause_mode is None, 5, "the fleet to be resumed")
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
    assert _announced(recorded) == [(1, zombie.state.incarnation), (3, owner.state.incarnation)]
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


async def _forge_claim(bus: Bus, policy: str, reserved: int) -> None:
    """A claim nobody's counter made, stored as any trainer credential could: it says ``reserved`` was issued."""
    forged = PublisherClaimed(
        policy=policy, epoch=0, trainer_id="forger", published_at=now(), reserved=reserved, incarnation="f"
    )
    await bus.publish(subjects.weights(policy), forged, msg_id=f"{policy}:forged-claim")


async def test_at_the_ceiling_nothing_is_published_and_nothing_pushed(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    await _forge_claim(nats_bus, policy, MAX_VERSION)
    fleet = EngineFleet([engines.add("e1")])
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet, pause="retract").start()
    after_claim = await nats_bus.last_seq(subjects.weights(policy))
    ran = False
    with pytest.raises(CounterExhaustedError) as info:
        async with pub.update():
            ran = True
    assert not ran
    err = info.value
    assert not isinstance(err, PublishError) and (err.policy, err.issued) == (policy, MAX_VERSION)
    assert "new policy id" in str(err)
    assert await nats_bus.last_seq(subjects.weights(policy)) == after_claim  # no reservation, no announcement
    assert engines.paths("http://e1") == ["/model_info"]  # the start's label read; no pause, no stamp
    assert engines.states["http://e1"].weight_version == "default"
    with pytest.raises(CounterExhaustedError):
        await pub.publish_lora(LoraAdapter(name="a", path="/a"))
    assert engines.paths("http://e1") == ["/model_info"]
    async with VersionTracker(nats_bus, policy) as tracker:
        assert tracker.current is None  # never an event the consumers drop as invalid


async def test_the_last_valid_number_is_published_once_then_the_counter_is_exhausted(
    nats_bus: NatsBus, policy: str
) -> None:
    await _forge_claim(nats_bus, policy, MAX_VERSION - 1)
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with pub.update() as version:
        assert version == MAX_VERSION
    with pytest.raises(CounterExhaustedError):
        async with pub.update():
            pytest.fail("no number above the bound")
    restarted = await VersionPublisher(nats_bus, policy, trainer_id="t2").start()
    with pytest.raises(CounterExhaustedError):
        async with restarted.update():
            pytest.fail("no number above the bound")
    recorded = await history(nats_bus, subjects.weights(policy))
    assert _announced(recorded) == [(MAX_VERSION, pub.state.incarnation)]
    assert not recorded[-2].event.reserves_next  # nothing above the bound was reserved either
    async with VersionTracker(nats_bus, policy) as tracker:
        assert tracker.current == MAX_VERSION


async def _alerts_of(bus: Bus, policy: str, reason: str, timeout: float = 5.0) -> list[VersionRejected]:
    """The ``VersionRejected`` alerts with ``reason`` stored on the policy's alerts subject (waits for one)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = [
            e.event
            for e in await history(bus, subjects.alerts(policy), idle=0.1)
            if isinstance(e.event, VersionRejected) and e.event.reason == reason
        ]
        if found or asyncio.get_running_loop().time() > deadline:
            return found


def _rejected_total(registry: CollectorRegistry, policy: str, reason: str) -> float:
    return registry.get_sample_value("weightbus_events_rejected_total", {"policy": policy, "reason": reason}) or 0.0


async def test_history_evicted_by_low_writes_is_resumed_above_the_counter_mark_and_reported(
    nats_bus: NatsBus, policy: str
) -> None:
    weights = subjects.weights(policy)
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    for _ in range(5):
        async with pub.update():
            pass
    await pub.settle()  # the mark after the last announcement (deferred by mark_delay) is written
    # 264 low-version writes (retention is 256 per subject) evict every event of the real history.
    for i in range(264):
        low = updated(1, policy=policy, epoch=0, trainer="rogue")
        await nats_bus.publish(weights, low, msg_id=f"{policy}:low:{i}")
    retained = await history(nats_bus, weights)
    assert len(retained) == 256 and {e.event.trainer_id for e in retained} == {"rogue"}

    first = CollectorRegistry()
    async with VersionTracker(nats_bus, policy, registry=first, observer="r1", check_interval=0.2) as tracker:
        assert tracker.current == 1  # all the history still says
        (alert,) = await _alerts_of(nats_bus, policy, "counter_reset")
        # The mark written once the announcement of 5 was stored names 5 as announced and acknowledged.
        assert (alert.event_type, alert.current, alert.incoming, alert.publisher) == ("CounterHighWater", 1, 5, "t")
        assert _rejected_total(first, policy, "counter_reset") == 1
        # A restarted trainer without a fleet resumes above the mark (6, reserved by the announcement of 5).
        restarted = await VersionPublisher(nats_bus, policy, trainer_id="t-restarted").start()
        async with restarted.update() as version:
            assert version == 7
        assert await tracker.wait_for(7, 5) == 7
    # No number named a second set of weights: the restarted trainer announced 7 only.
    assert [(v, inc) for v, inc in _announced(await history(nats_bus, weights)) if inc] == [
        (7, restarted.state.incarnation)
    ]
    later = CollectorRegistry()
    async with VersionTracker(nats_bus, policy, registry=later, observer="r2") as tracker:
        assert tracker.current == 7
    assert _rejected_total(later, policy, "counter_reset") == 0  # above the mark: nothing to report
    assert len(await _alerts_of(nats_bus, policy, "counter_reset")) == 1  # one alert for the fleet


async def test_a_tracker_of_a_purged_history_reports_the_counter_reset(nats_bus: NatsBus, policy: str) -> None:
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    for _ in range(3):
        async with pub.update():
            pass
    await pub.settle()  # the mark after the last announcement (deferred by mark_delay) is written
    await nats_bus.js.purge_stream(nats_bus.stream, subject=subjects.weights(policy))
    registry = CollectorRegistry()
    async with VersionTracker(nats_bus, policy, registry=registry) as tracker:
        assert tracker.current is None  # never published, as far as the weights subject knows: filter off
        (alert,) = await _alerts_of(nats_bus, policy, "counter_reset")
        assert (alert.current, alert.incoming) == (None, 3)  # the mark names the last announced version
    assert _rejected_total(registry, policy, "counter_reset") == 1


async def test_a_trainer_resumes_above_its_checkpoint_when_the_bus_lost_everything(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1")])
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet).start()
    for _ in range(3):
        async with pub.update():
            pass
    # The trainer checkpointed at version 3; then the weights and the counter subjects are lost, and
    # the engines restart with their boot label.
    for subject in (subjects.weights(policy), subjects.counter(policy)):
        await nats_bus.js.purge_stream(nats_bus.stream, subject=subject)
    engines.add("e1")
    restored = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet, floor=3).start()
    async with restored.update() as version:
        assert version == 4
    assert _stamped_numbers(engines, "http://e1") == ["4"]
    async with VersionTracker(nats_bus, policy) as tracker:
        assert tracker.current == 4
    with pytest.raises(ValueError, match="floor"):
        VersionPublisher(nats_bus, policy, floor=MAX_VERSION + 1)
