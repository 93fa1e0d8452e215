"""VersionPublisher on both buses: resume, claim and fencing, the update protocol, publishes in doubt."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated, wait_until
from weightbus.bus import MemoryBus, subjects
from weightbus.bus.protocol import Bus
from weightbus.consumers import VersionTracker
from weightbus.errors import FencedError, PublishError
from weightbus.producers import EngineFleet, VersionPublisher, read_status
from weightbus.producers.status import read_weights_history
from weightbus.schemas import (
    CounterHighWater,
    Event,
    LoraAdapter,
    PublisherClaimed,
    VersionReserved,
    WeightUpdated,
)

from .conftest import Engines, HookBus, history


async def test_new_policy_claims_epoch_0_and_starts_at_1(bus: Bus, policy: str) -> None:
    pub = await VersionPublisher(bus, policy, trainer_id="t1", incarnation="i1").start()
    assert (pub.state.epoch, pub.state.version, pub.state.next_version) == (0, None, 1)
    claim = (await bus.last(subjects.weights(policy))).event
    assert claim == PublisherClaimed(
        policy=policy, epoch=0, trainer_id="t1", published_at=claim.published_at, version=None, incarnation="i1"
    )
    async with pub.update() as version:
        assert version == 1
    last = await bus.last(subjects.weights(policy))
    assert isinstance(last.event, WeightUpdated)
    assert (last.event.version, last.event.epoch, last.event.trainer_id, last.event.lora) == (1, 0, "t1", None)
    assert last.headers["Nats-Msg-Id"] == f"{policy}:0:1:i1"
    kinds = [type(e.event).__name__ for e in await history(bus, subjects.weights(policy))]
    assert kinds == ["PublisherClaimed", "VersionReserved", "WeightUpdated"]
    assert pub.state.version == 1 and pub.state.last_event == last.event


async def test_restart_resumes_the_counter_57_to_58(bus: Bus, policy: str) -> None:
    # The failover of the review finding: the old trainer's last event says 57.
    old = updated(57, policy=policy, epoch=4, trainer="cell-0")
    await bus.publish(subjects.weights(policy), old, msg_id=f"{policy}:4:57", expected_last_seq=0)
    pub = await VersionPublisher(bus, policy, trainer_id="cell-1").start()
    assert (pub.state.epoch, pub.state.version) == (5, 57)
    claim = (await bus.last(subjects.weights(policy))).event
    assert isinstance(claim, PublisherClaimed)
    assert (claim.version, claim.epoch, claim.previous_trainer_id) == (57, 5, "cell-0")
    async with pub.update() as version:
        assert version == 58
    async with pub.update() as version:
        assert version == 59


async def test_restart_after_a_rogue_lower_version_resumes_above_the_highest(bus: Bus, policy: str) -> None:
    # A publisher that bypassed the counter stored 1 after 57: resuming from the last event would reissue 2.
    w = subjects.weights(policy)
    await bus.publish(
        w,
        updated(57, policy=policy, epoch=4, trainer="cell-0"),
        msg_id=f"{policy}:4:57",
    )
    await bus.publish(
        w,
        updated(1, policy=policy, epoch=0, trainer="rogue"),
        msg_id=f"{policy}:rogue:1",
    )
    pub = await VersionPublisher(bus, policy, trainer_id="cell-1").start()
    assert (pub.state.epoch, pub.state.version) == (5, 57)
    async with pub.update() as version:
        assert version == 58


async def test_same_trainer_restarting_continues(bus: Bus, policy: str) -> None:
    first = await VersionPublisher(bus, policy, trainer_id="t").start()
    for _ in range(3):
        async with first.update():
            pass
    again = await VersionPublisher(bus, policy, trainer_id="t").start()
    # 4 was reserved by the first instance's last announcement: only that instance may ever push it.
    assert (again.state.epoch, again.state.version, again.state.issued) == (1, 3, 4)
    async with again.update() as version:
        assert version == 5


async def test_a_one_shot_publisher_leaves_no_number_for_its_successor_to_skip(bus: Bus, policy: str) -> None:
    first = await VersionPublisher(bus, policy, trainer_id="cli", reserve_next=False).start()
    async with first.update():
        pass
    assert not (await bus.last(subjects.weights(policy))).event.reserves_next
    again = await VersionPublisher(bus, policy, trainer_id="cli", reserve_next=False).start()
    async with again.update() as version:
        assert version == 2


async def test_an_update_after_a_successful_one_stores_one_event(bus: Bus, policy: str) -> None:
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    for _ in range(3):
        async with pub.update():
            pass
    kinds = [(type(e.event).__name__, e.event.version) for e in await history(bus, subjects.weights(policy))]
    # The first update after the claim reserves; every announcement reserves the number after it.
    assert kinds == [
        ("PublisherClaimed", None),
        ("VersionReserved", 1),
        ("WeightUpdated", 1),
        ("WeightUpdated", 2),
        ("WeightUpdated", 3),
    ]
    assert all(e.event.reserves_next for e in (await history(bus, subjects.weights(policy)))[2:])


async def test_takeover_fences_the_old_publisher_before_its_body_runs(bus: Bus, policy: str) -> None:
    old = await VersionPublisher(bus, policy, trainer_id="old").start()
    async with old.update():
        pass
    new = await VersionPublisher(bus, policy, trainer_id="new").start()
    before = await bus.last(subjects.weights(policy))
    ran = False
    with pytest.raises(FencedError) as info:
        async with old.update():
            ran = True
    assert not ran
    assert (info.value.owner, info.value.epoch, info.value.version, info.value.policy) == ("new", 1, 1, policy)
    assert "'new'" in str(info.value)
    assert (await bus.last(subjects.weights(policy))).seq == before.seq
    # Fenced for good, without another read.
    with pytest.raises(FencedError):
        async with old.update():
            pass
    assert old.state.fenced is not None
    async with new.update() as version:
        assert version == 3  # 2 was the old owner's, reserved by its announcement of 1


async def test_takeover_during_an_update_refuses_its_publish(bus: Bus, policy: str) -> None:
    old = await VersionPublisher(bus, policy, trainer_id="old").start()
    with pytest.raises(FencedError) as info:
        async with old.update() as version:
            assert version == 1
            await VersionPublisher(bus, policy, trainer_id="usurper").start()
    assert info.value.owner == "usurper" and info.value.epoch == 1
    events = [e.event for e in await history(bus, subjects.weights(policy))]
    assert [type(e).__name__ for e in events] == ["PublisherClaimed", "VersionReserved", "PublisherClaimed"]
    assert old.state.version is None
    # The usurper saw the old owner's reservation: number 1 names the old owner's attempt, never anything else.
    assert events[-1].reserved == 1


async def test_two_publishers_racing_exactly_one_wins(bus: Bus, policy: str) -> None:
    a = VersionPublisher(bus, policy, trainer_id="a")
    b = VersionPublisher(bus, policy, trainer_id="b")
    await asyncio.gather(a.start(), b.start())
    assert {a.state.epoch, b.state.epoch} == {0, 1}

    async def one_update(pub: VersionPublisher) -> int:
        async with pub.update() as version:
            await asyncio.sleep(0)
        return version

    results = await asyncio.gather(one_update(a), one_update(b), return_exceptions=True)
    winner, loser = (a, b) if a.state.epoch == 1 else (b, a)
    by_pub = dict(zip((a, b), results, strict=True))
    assert by_pub[winner] == 1
    assert isinstance(by_pub[loser], FencedError)
    assert by_pub[loser].owner == winner.state.trainer_id
    updates = [e.event for e in await history(bus, subjects.weights(policy)) if isinstance(e.event, WeightUpdated)]
    assert [(u.version, u.trainer_id) for u in updates] == [(1, winner.state.trainer_id)]


async def test_exception_inside_update_announces_nothing_and_never_reuses_the_number(bus: Bus, policy: str) -> None:
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    async with pub.update():
        pass
    with pytest.raises(ValueError, match="push failed"):
        async with pub.update() as version:
            assert version == 2
            raise ValueError("push failed")
    # 2 was used up by the announcement of 1 before the update entered; nothing was stored for it.
    last = await bus.last(subjects.weights(policy))
    assert isinstance(last.event, WeightUpdated) and (last.event.version, last.event.reserves_next) == (1, True)
    assert pub.state.version == 1
    async with pub.update(lora=LoraAdapter(name="a", path="/p")) as version:
        assert version == 3
    events = [e.event for e in await history(bus, subjects.weights(policy))]
    assert isinstance(events[-2], VersionReserved) and events[-2].version == 3  # no announcement reserved 3
    assert events[-1].version == 3 and events[-1].lora == LoraAdapter(name="a", path="/p")


async def test_update_needs_start_and_is_sequential(bus: Bus, policy: str) -> None:
    pub = VersionPublisher(bus, policy)
    with pytest.raises(RuntimeError, match="start"):
        async with pub.update():
            pass
    await pub.start()
    async with pub.update():
        with pytest.raises(RuntimeError, match="in progress"):
            async with pub.update():
                pass
    assert pub.state.version == 1


async def test_an_update_is_driven_by_its_phases_in_order(bus: Bus, policy: str) -> None:
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    update = pub.update()
    with pytest.raises(RuntimeError, match="begun"):
        await update.commit()
    assert await update.begin() == 1
    with pytest.raises(RuntimeError, match="new update"):
        await update.begin()
    await update.commit()
    assert pub.state.version == 1 and not pub.state.active
    with pytest.raises(RuntimeError, match="begun"):
        await update.abort(ValueError("late"))
    failed = pub.update()
    assert await failed.begin() == 2
    await failed.abort(ValueError("push failed"))  # does not raise: the caller raises its error
    assert pub.state.version == 1 and not pub.state.active
    with pytest.raises(RuntimeError, match="begun"):
        await failed.commit()
    async with pub.update() as version:
        assert version == 3


async def test_a_failed_publish_that_landed_is_resolved_not_fenced(policy: str) -> None:
    mem = MemoryBus()
    lost_ack = True

    async def drop_first_ack(subject: str, event: Event) -> None:
        nonlocal lost_ack
        if isinstance(event, WeightUpdated) and lost_ack:
            lost_ack = False
            await mem.publish(subject, event, msg_id=f"{policy}:0:{event.version}:inc")
            raise PublishError(subject, "no acknowledgement after 5 attempts")

    pub = await VersionPublisher(HookBus(mem, drop_first_ack), policy, trainer_id="t", incarnation="inc").start()
    with pytest.raises(PublishError):
        async with pub.update():
            pass
    assert pub.state.version is None
    async with pub.update() as version:
        assert version == 2
    assert pub.state.version == 2 and pub.state.fenced is None
    updates = [
        e.event.version for e in await history(mem, subjects.weights(policy)) if isinstance(e.event, WeightUpdated)
    ]
    assert updates == [1, 2]


async def test_a_failed_publish_that_did_not_land_skips_its_number(policy: str) -> None:
    mem = MemoryBus()
    fail = True

    async def refuse_once(subject: str, event: Event) -> None:
        nonlocal fail
        if isinstance(event, WeightUpdated) and fail:
            fail = False
            raise PublishError(subject, "no acknowledgement after 5 attempts")

    pub = await VersionPublisher(HookBus(mem, refuse_once), policy, trainer_id="t").start()
    with pytest.raises(PublishError):
        async with pub.update():
            pass
    async with pub.update() as version:
        assert version == 2
    updates = [e.event for e in await history(mem, subjects.weights(policy)) if isinstance(e.event, WeightUpdated)]
    assert [u.version for u in updates] == [2]


async def test_read_status_shows_what_trackers_hold_with_the_rejected_event_flagged(bus: Bus, policy: str) -> None:
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    for _ in range(4):
        async with pub.update(lora=LoraAdapter(name="a", path="/p")):
            pass
    rogue = updated(1, policy=policy, epoch=0, trainer="rogue")
    await bus.publish(subjects.weights(policy), rogue, msg_id=f"{policy}:rogue")
    await bus.publish_raw(subjects.weights(policy), b"hello", msg_id=f"{policy}:garbage")
    status = await read_status(bus, policy)
    assert (status.version, status.publisher, status.last_event) == (4, "t", "updated")
    assert status.lora == LoraAdapter(name="a", path="/p")
    assert status.rejected == "regression: WeightUpdated v1 by rogue"
    assert status.invalid == 1


class MarkRefuser:
    """A ``HookBus`` hook that refuses every counter mark while ``refuse`` is set (a publish that never acks)."""

    def __init__(self, *, refuse: bool) -> None:
        self.refuse = refuse

    async def __call__(self, subject: str, event: Event) -> None:
        if self.refuse and isinstance(event, CounterHighWater):
            raise PublishError(subject, "no acknowledgement after 5 attempts")


async def test_a_mark_that_cannot_be_written_fails_the_take_before_any_engine_and_burns_no_number(
    policy: str, engines: Engines
) -> None:
    mem = MemoryBus()
    marks = MarkRefuser(refuse=True)
    fleet = EngineFleet([engines.add("e1")])
    pub = await VersionPublisher(HookBus(mem, marks), policy, trainer_id="t", fleet=fleet, pause="retract").start()
    with pytest.raises(PublishError, match="no acknowledgement"):
        async with pub.update():
            pytest.fail("nothing may carry a number the mark does not cover")
    state = engines.states["http://e1"]
    assert state.pause_mode is None and state.weight_version == "default"  # paused beside the take, resumed
    assert not state.recorded("/update_weight_version")
    marks.refuse = False
    async with pub.update() as version:
        assert version == 1  # the reservation that landed is taken again, not burned
    await pub.settle()  # the mark after v1 waits out mark_delay; settle writes it now
    mark = (await mem.last(subjects.counter(policy))).event
    assert isinstance(mark, CounterHighWater) and (mark.version, mark.announced) == (2, 1)  # written once v1 is stored
    assert state.weight_version == "1"


async def test_a_fenced_zombie_never_lowers_the_mark(bus: Bus, policy: str) -> None:
    zombie = await VersionPublisher(bus, policy, trainer_id="zombie", reserve_next=False).start()
    async with zombie.update():
        pass
    owner = await VersionPublisher(bus, policy, trainer_id="owner").start()
    async with owner.update() as version:
        assert version == 2
    await owner.settle()  # the mark after v2 (deferred by mark_delay)
    with pytest.raises(FencedError):
        async with zombie.update():  # its number 2 is below the owner's mark: its write loses the race
            pytest.fail("a fenced publisher's block never runs")
    marks = [e.event for e in await history(bus, subjects.counter(policy))]
    assert [(m.version, m.trainer_id) for m in marks] == [(1, "zombie"), (2, "owner"), (3, "owner")]
    assert (marks[-1].announced, marks[-1].epoch) == (
        2,
        1,
    )  # the mark after v2 names v2: it is written once v2 is stored


async def test_garbage_stored_on_the_counter_subject_hides_no_mark(policy: str) -> None:
    mem = MemoryBus()
    pub = await VersionPublisher(mem, policy, trainer_id="t").start()
    for _ in range(3):
        async with pub.update():
            pass
    await pub.settle()  # the mark after v3 (4), deferred by mark_delay
    await mem.publish_raw(subjects.counter(policy), b"hello", msg_id=f"{policy}:garbage")
    mem.purge(subjects.weights(policy))
    restarted = await VersionPublisher(mem, policy, trainer_id="t2").start()
    async with restarted.update() as version:
        assert version == 5  # above the highest retained mark (4), read past the garbage
    async with VersionTracker(mem, policy) as tracker:
        assert tracker.current == 5


async def test_a_tracker_reads_the_mark_past_garbage_and_reports_a_lost_history(policy: str) -> None:
    mem = MemoryBus()
    pub = await VersionPublisher(mem, policy, trainer_id="t").start()
    for _ in range(3):
        async with pub.update():
            pass
    await mem.publish_raw(subjects.counter(policy), b"hello", msg_id=f"{policy}:garbage")
    mem.purge(subjects.weights(policy))
    registry = CollectorRegistry()
    async with VersionTracker(mem, policy, registry=registry) as tracker:
        # The weights history is gone, the newest payload on the counter subject is garbage: the mark
        # retained before it still says versions were announced, so holding none is a counter reset.
        assert tracker.current is None
        rejected = {"policy": policy, "reason": "counter_reset"}
        assert registry.get_sample_value("weightbus_events_rejected_total", rejected) == 1


async def test_a_zombie_that_missed_several_updates_never_stores_a_mark_below_the_owners(bus: Bus, policy: str) -> None:
    # The zombie's own chain stops at its v1; the owner's mark after two updates is above what that chain
    # explains. The zombie must learn it is fenced, not take the owner's mark for a forged one and store
    # its lower mark after it (a lower mark after a higher one voids the higher one: the mark would fall).
    # reserve_next=False: each take of the zombie writes its own mark (beside its reservation).
    zombie = await VersionPublisher(bus, policy, trainer_id="zombie", reserve_next=False, mark_delay=0).start()
    async with zombie.update():
        pass
    owner = await VersionPublisher(bus, policy, trainer_id="owner", mark_delay=0).start()
    for _ in range(3):
        async with owner.update():
            pass
    with pytest.raises(FencedError):
        async with zombie.update():
            pytest.fail("a fenced publisher's block never runs")
    marks = [e.event for e in await history(bus, subjects.counter(policy))]
    versions = [m.version for m in marks]
    assert versions == sorted(versions), f"a mark below an earlier one: {versions}"
    assert marks[-1].trainer_id == "owner" and marks[-1].version >= owner.state.issued
    assert (await read_weights_history(bus, policy)).unexplained_marks == []
    # What the mark is for: with the weights history gone, a successor never reissues the owner's numbers.
    if isinstance(bus, MemoryBus):
        bus.purge(subjects.weights(policy))
    else:
        await bus.js.purge_stream(bus.stream, subject=subjects.weights(policy))  # type: ignore[attr-defined]
    blind = await VersionPublisher(bus, policy, trainer_id="blind").start()
    assert blind.state.next_version > owner.state.issued


async def _marks(bus: Bus, policy: str) -> list[tuple[int, int | None]]:
    return [(e.event.version, e.event.announced) for e in await history(bus, subjects.counter(policy))]


async def test_the_mark_after_an_announcement_waits_then_is_written_or_taken_over_by_the_next_take(
    policy: str,
) -> None:
    mem = MemoryBus()
    pub = await VersionPublisher(mem, policy, trainer_id="t", mark_delay=30).start()
    async with pub.update():
        pass
    assert await _marks(mem, policy) == [(1, None)]  # the take's own; the one for 2 waits
    async with pub.update() as version:  # the take of 2 covers 2 itself, naming 1 as announced
        assert version == 2
    assert await _marks(mem, policy) == [(1, None), (2, 1)]
    await pub.settle()
    assert await _marks(mem, policy) == [(1, None), (2, 1), (3, 2)]
    await pub.settle()  # nothing waits: nothing written
    assert len(await _marks(mem, policy)) == 3
    short = await VersionPublisher(mem, policy, trainer_id="t2", mark_delay=0.05).start()
    async with short.update() as version:
        assert version == 4  # 3 was reserved by the announcement of 2

    async def written() -> bool:
        return len(await _marks(mem, policy)) == 5  # its take wrote 4

    await wait_until(written, timeout=5)
    assert (await _marks(mem, policy))[-1] == (5, 4)  # written by itself once mark_delay was over


async def test_leaving_the_publisher_writes_the_waiting_mark(policy: str) -> None:
    mem = MemoryBus()
    async with VersionPublisher(mem, policy, trainer_id="t", mark_delay=30) as pub:
        async with pub.update():
            pass
    assert await _marks(mem, policy) == [(1, None), (2, 1)]
    with pytest.raises(ValueError, match="mark_delay"):
        VersionPublisher(mem, policy, mark_delay=-1)


async def test_a_deferred_mark_that_fails_is_logged_and_the_next_take_covers_its_number(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    mem = MemoryBus()
    marks = MarkRefuser(refuse=False)
    pub = await VersionPublisher(HookBus(mem, marks), policy, trainer_id="t", mark_delay=30).start()
    async with pub.update():
        pass
    marks.refuse = True
    await pub.settle()
    assert "the counter's mark was not written after the announcement" in caplog.text
    marks.refuse = False
    async with pub.update() as version:
        assert version == 2
    assert await _marks(mem, policy) == [(1, None), (2, 1)]  # covered by its take before the block ran
