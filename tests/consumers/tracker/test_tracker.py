"""``VersionTracker`` on both buses (``bus`` runs each test on MemoryBus and on a real nats-server)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated, wait_until
from weightbus.bus import MemoryBus, subjects
from weightbus.bus._subscription import QueueSubscription
from weightbus.bus.protocol import Bus, Deliver
from weightbus.consumers.tracker.metrics import TrackerMetrics
from weightbus.consumers.tracker.tracker import TrackerStatus, VersionTracker
from weightbus.errors import BusError, TrackerNotReadyError, VersionRegressionError
from weightbus.rules.chain import TrackerAction
from weightbus.schemas import PublisherClaimed, VersionRegressed

TIMEOUT = 5.0


async def publish(
    bus: Bus, policy: str, version: int, *, epoch: int = 1, trainer: str = "trainer-a", at: float | None = None
) -> None:
    event = updated(version, policy=policy, epoch=epoch, trainer=trainer, at=at)
    await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:{epoch}:{version}:{uuid.uuid4().hex}")


def sample(registry: CollectorRegistry, name: str, policy: str) -> float | None:
    return registry.get_sample_value(name, {"policy": policy})


async def test_restarted_tracker_learns_the_current_version_from_the_stream(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    metrics = TrackerMetrics(registry)
    for v in (1, 2, 3):
        await publish(bus, policy, v)
    async with VersionTracker(bus, policy, metrics=metrics) as first:
        assert await first.wait_ready(TIMEOUT) == 3
    await publish(bus, policy, 4, at=time.time() - 30)
    async with VersionTracker(bus, policy, metrics=metrics) as second:
        # No further publish: the stored event alone must make it ready at 4.
        assert await second.wait_ready(TIMEOUT) == 4
        assert second.current == 4 and second.epoch == 1 and second.publisher == "trainer-a"
        assert second.seconds_since_update is not None and second.seconds_since_update >= 29
    assert sample(registry, "weightbus_current_version", policy) == 4
    assert sample(registry, "weightbus_epoch", policy) == 1
    # Replayed events are ages, not propagation lags.
    assert sample(registry, "weightbus_propagation_lag_seconds_count", policy) == 0


async def test_never_published_policy_is_ready_with_none_then_adopts_version_zero(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        assert await tracker.wait_ready(TIMEOUT) is None
        assert tracker.current is None and tracker.seconds_since_update is None
        await publish(bus, policy, 0)
        assert await tracker.wait_for(0, TIMEOUT) == 0
        assert tracker.current == 0


async def test_live_update_lag_is_observed(bus: Bus, policy: str, registry: CollectorRegistry) -> None:
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        await tracker.wait_ready(TIMEOUT)
        await publish(bus, policy, 1, at=time.time() - 0.3)
        await tracker.wait_for(1, TIMEOUT)
        await publish(bus, policy, 2)
        await tracker.wait_for(2, TIMEOUT)
    assert sample(registry, "weightbus_propagation_lag_seconds_count", policy) == 2
    total = sample(registry, "weightbus_propagation_lag_seconds_sum", policy)
    assert total is not None and 0.3 <= total < 3.0
    assert (
        registry.get_sample_value("weightbus_propagation_lag_seconds_bucket", {"policy": policy, "le": "0.25"}) == 1
    )  # the fresh one, not the 0.3 s one
    assert sample(registry, "weightbus_last_update_timestamp_seconds", policy) == pytest.approx(time.time(), abs=3)


@pytest.mark.parametrize("mode", ["hold", "follow", "raise"])
async def test_regression_is_logged_counted_alerted_and_handled(
    bus: Bus, policy: str, registry: CollectorRegistry, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    await publish(bus, policy, 57)
    async with VersionTracker(bus, policy, registry=registry, regression=mode, observer="rm-0") as tracker:
        assert await tracker.wait_ready(TIMEOUT) == 57
        changes = tracker.changes(include_regressions=True)
        first = await anext(changes)
        assert (first.action, first.version) == (TrackerAction.ADOPTED, 57)
        await publish(bus, policy, 1, epoch=2, trainer="cell-1")
        if mode == "raise":
            with pytest.raises(VersionRegressionError) as info:
                await asyncio.wait_for(anext(changes), TIMEOUT)
            assert (info.value.current, info.value.incoming, info.value.publisher) == (57, 1, "cell-1")
            with pytest.raises(VersionRegressionError):
                tracker.current  # noqa: B018
            with pytest.raises(VersionRegressionError):
                await tracker.wait_for(58, TIMEOUT)
            assert tracker.state.version == 57
        else:
            change = await asyncio.wait_for(anext(changes), TIMEOUT)
            assert change.incoming == 1 and change.previous == 57
            assert tracker.current == (57 if mode == "hold" else 1)
            assert change.action is (TrackerAction.HELD if mode == "hold" else TrackerAction.FOLLOWED)
            # The tracker keeps following its owner after a regression (hold: trainer-a; follow: cell-1).
            if mode == "hold":
                await publish(bus, policy, 58)
            else:
                await publish(bus, policy, 2, epoch=2, trainer="cell-1")
            assert await tracker.wait_for(58 if mode == "hold" else 2, TIMEOUT) == (58 if mode == "hold" else 2)
        await changes.aclose()
    assert sample(registry, "weightbus_version_regressions_total", policy) == 1
    stored = await bus.last(subjects.alerts(policy))
    assert stored is not None
    alert = stored.event
    assert isinstance(alert, VersionRegressed)
    assert (alert.current, alert.incoming, alert.incoming_epoch) == (57, 1, 2)
    assert (alert.publisher, alert.action, alert.observer) == ("cell-1", mode, "rm-0")
    assert any(r.getMessage() == "weight version went backwards" for r in caplog.records)


async def test_takeover_with_a_higher_version_in_a_new_epoch_is_not_a_regression(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    await publish(bus, policy, 5)
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        await tracker.wait_ready(TIMEOUT)
        claim = PublisherClaimed(policy=policy, epoch=2, trainer_id="trainer-b", published_at=time.time(), version=5)
        await bus.publish(subjects.weights(policy), claim, msg_id=f"{policy}:claim:2")
        await publish(bus, policy, 6, epoch=2, trainer="trainer-b")
        assert await tracker.wait_for(6, TIMEOUT) == 6
        assert (tracker.epoch, tracker.publisher) == (2, "trainer-b")
    assert sample(registry, "weightbus_version_regressions_total", policy) == 0
    assert sample(registry, "weightbus_epoch", policy) == 2
    assert await bus.last(subjects.alerts(policy)) is None


async def test_a_claim_alone_gives_the_version_but_no_update(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    claim = PublisherClaimed(policy=policy, epoch=3, trainer_id="trainer-c", published_at=time.time(), version=9)
    await bus.publish(subjects.weights(policy), claim, msg_id=f"{policy}:claim:3")
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        assert await tracker.wait_ready(TIMEOUT) == 9
        assert tracker.epoch == 3 and tracker.seconds_since_update is None
    assert sample(registry, "weightbus_last_update_timestamp_seconds", policy) is None or (
        sample(registry, "weightbus_last_update_timestamp_seconds", policy) == 0
    )


async def test_malformed_payloads_do_not_stop_the_tracker(bus: Bus, policy: str, registry: CollectorRegistry) -> None:
    subject = subjects.weights(policy)
    await publish(bus, policy, 1)
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        assert await tracker.wait_ready(TIMEOUT) == 1
        await bus.publish_raw(subject, b"{not json", msg_id=f"{policy}:garbage")
        await bus.publish_raw(
            subject,
            b'{"type":"weight.updated","policy":"%s","version":-4,"epoch":1,"trainer_id":"x","published_at":1}'
            % policy.encode(),
            msg_id=f"{policy}:negative",
        )
        await publish(bus, policy, 2)
        assert await tracker.wait_for(2, TIMEOUT) == 2
    invalid = registry.get_sample_value("weightbus_invalid_events_total", {"family": "weights", "reason": "malformed"})
    assert invalid == 1


async def test_an_invalid_latest_stored_event_leaves_the_last_valid_version(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    await publish(bus, policy, 24)
    await bus.publish_raw(subjects.weights(policy), b"hello", msg_id=f"{policy}:garbage")
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        assert tracker.status is TrackerStatus.CURRENT and tracker.current == 24


async def test_a_history_of_garbage_only_is_not_never_published(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    await bus.publish_raw(subjects.weights(policy), b"\x00garbage", msg_id=f"{policy}:garbage")
    metrics = TrackerMetrics(registry)
    with pytest.raises(TrackerNotReadyError, match="no_valid_version"):
        async with VersionTracker(bus, policy, metrics=metrics, ready_timeout=0.5):
            pass
    tracker = await VersionTracker(bus, policy, metrics=metrics).start()
    try:
        await wait_until(lambda: tracker.status is not TrackerStatus.STARTING, 5, "the tracker to read its history")
        assert tracker.status is TrackerStatus.NO_VALID_VERSION and not tracker.ready
        with pytest.raises(TrackerNotReadyError):
            tracker.current  # noqa: B018  # never "no version" by accident: the filter must not switch off
        assert sample(registry, "weightbus_tracker_ready", policy) == 0
        await publish(bus, policy, 3)
        assert await tracker.wait_for(3, TIMEOUT) == 3
        assert tracker.ready and sample(registry, "weightbus_tracker_ready", policy) == 1
    finally:
        await tracker.aclose()


async def test_iterator_starts_at_the_current_version_and_ends_on_stop(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    await publish(bus, policy, 1)
    tracker = await VersionTracker(bus, policy, registry=registry).start()
    seen: list[tuple[int | None, bool]] = []

    async def consume() -> None:
        async for change in tracker.changes():
            seen.append((change.version, change.replayed))

    await tracker.wait_ready(TIMEOUT)
    consumer = asyncio.create_task(consume())
    await wait_until(lambda: len(seen) == 1, TIMEOUT, "the consumer to get the current version")
    await publish(bus, policy, 2)
    await tracker.wait_for(2, TIMEOUT)
    await wait_until(lambda: len(seen) == 2, TIMEOUT, "the consumer to get the new version")
    await tracker.aclose()
    await asyncio.wait_for(consumer, TIMEOUT)
    assert seen == [(1, True), (2, False)]
    with pytest.raises(RuntimeError):
        await tracker.wait_for(3, TIMEOUT)  # a stopped tracker never gets there: fail, don't hang


async def test_slow_consumer_resubscribes_and_relearns_the_version(policy: str, registry: CollectorRegistry) -> None:
    bus = MemoryBus()
    async with VersionTracker(bus, policy, registry=registry, retry_delay=0.01) as tracker:
        await tracker.wait_ready(TIMEOUT)
        # MemoryBus.publish never yields, so the tracker cannot drain its 10k-bounded queue meanwhile.
        for v in range(10_050):
            await publish(bus, policy, v)
        assert await tracker.wait_for(10_049, TIMEOUT) == 10_049
        assert tracker.current == 10_049
    assert sample(registry, "weightbus_tracker_resubscribes_total", policy) == 1
    assert sample(registry, "weightbus_version_regressions_total", policy) == 0
    await bus.aclose()


async def test_event_naming_another_policy_is_skipped(bus: Bus, policy: str, registry: CollectorRegistry) -> None:
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        await tracker.wait_ready(TIMEOUT)
        stray = updated(99, policy="other", trainer="x")
        await bus.publish(subjects.weights(policy), stray, msg_id=f"{policy}:stray")
        await publish(bus, policy, 4)
        assert await tracker.wait_for(4, TIMEOUT) == 4


def test_bad_arguments_are_refused(registry: CollectorRegistry) -> None:
    bus = MemoryBus()
    with pytest.raises(ValueError):
        VersionTracker(bus, "p", regression="ignore")
    with pytest.raises(ValueError):
        VersionTracker(bus, "p", metrics=TrackerMetrics(registry), registry=registry)
    with pytest.raises(ValueError):
        VersionTracker(bus, "bad.policy")


class _RecordingBus(MemoryBus):
    """A MemoryBus that hands out its subscriptions, so a test can fail one as a transport would."""

    def __init__(self) -> None:
        super().__init__()
        self.subscriptions: list[QueueSubscription] = []

    def subscribe(
        self,
        pattern: str,
        *,
        deliver: Deliver = Deliver.LAST_PER_SUBJECT,
        include_invalid: bool = False,
        transient: bool = False,
    ) -> QueueSubscription:
        sub = super().subscribe(pattern, deliver=deliver, include_invalid=include_invalid, transient=transient)
        self.subscriptions.append(sub)
        return sub


async def test_failed_subscription_resubscribes_without_handling_the_last_event_twice(
    policy: str, registry: CollectorRegistry
) -> None:
    bus = _RecordingBus()
    await publish(bus, policy, 57)
    async with VersionTracker(bus, policy, registry=registry, retry_delay=0.01) as tracker:
        await tracker.wait_ready(TIMEOUT)
        changes = tracker.changes(include_regressions=True)
        assert (await anext(changes)).version == 57
        await publish(bus, policy, 1, epoch=2)
        assert (await asyncio.wait_for(anext(changes), TIMEOUT)).action is TrackerAction.HELD
        bus.subscriptions[-1].fail(BusError("connection lost"))
        await wait_until(lambda: len(bus.subscriptions) >= 2, TIMEOUT, "the tracker to resubscribe", interval=0.005)
        # The replay after resubscribing is the held v1 again: recognised, not a second regression
        # (which would be the next item here, before v58).
        await publish(bus, policy, 58)
        assert (await asyncio.wait_for(anext(changes), TIMEOUT)).version == 58
        await changes.aclose()
    assert len(bus.subscriptions) == 2
    assert sample(registry, "weightbus_tracker_resubscribes_total", policy) == 1
    assert sample(registry, "weightbus_version_regressions_total", policy) == 1


async def test_tracker_started_after_a_rogue_lower_version_still_holds_and_alerts(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    # 57 is current, then a publisher that bypasses the counter stores 1 as the latest event. A tracker
    # that was not running at the time must not adopt 1 from the stream.
    for v in (55, 56, 57):
        await publish(bus, policy, v, trainer="cell-0")
    await publish(bus, policy, 1, epoch=0, trainer="cell-1")
    alerts = bus.subscribe(subjects.alerts(policy), deliver=Deliver.ALL)
    async with VersionTracker(bus, policy, registry=registry, observer="late") as tracker:
        assert await tracker.wait_ready(TIMEOUT) == 57
    assert sample(registry, "weightbus_version_regressions_total", policy) == 1
    alert = await asyncio.wait_for(alerts.__anext__(), TIMEOUT)
    await alerts.aclose()
    assert isinstance(alert.event, VersionRegressed)
    assert (alert.event.current, alert.event.incoming, alert.event.publisher) == (57, 1, "cell-1")


async def test_gauges_are_read_at_scrape_time_and_do_not_keep_a_tracker_alive(policy: str) -> None:
    import gc
    import weakref

    bus = MemoryBus()
    registry = CollectorRegistry()
    await publish(bus, policy, 7, epoch=2)
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        assert sample(registry, "weightbus_current_version", policy) == 7
        assert sample(registry, "weightbus_epoch", policy) == 2
        await publish(bus, policy, 8, epoch=2)
        await tracker.wait_for(8, timeout=5)
        assert sample(registry, "weightbus_current_version", policy) == 8  # no per-event gauge write needed
    ref = weakref.ref(tracker)
    del tracker
    for _ in range(5):
        await asyncio.sleep(0)  # the stopped tasks' frames let go
    gc.collect()
    assert ref() is None
    assert sample(registry, "weightbus_current_version", policy) == 0


async def test_a_tracker_leaves_the_collector_alone_unless_its_host_asks(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightbus.consumers.tracker import heap

    frozen: list[int] = []
    monkeypatch.setattr(heap.gc, "freeze", lambda: frozen.append(1))
    monkeypatch.setattr(heap, "_frozen", False)
    bus = MemoryBus()
    await publish(bus, policy, 1)
    async with VersionTracker(bus, policy) as tracker:
        assert tracker.current == 1
    assert frozen == []  # a library object never touches the process-wide collector by default
    for _ in range(2):
        async with VersionTracker(bus, policy, freeze_heap=True) as tracker:
            assert tracker.current == 1
    assert frozen == [1]  # opted in: frozen once per process, when first ready


def test_the_replay_cursor_handles_each_event_once_and_tells_replayed_from_live() -> None:
    from weightbus.consumers.tracker.cursor import ReplayCursor

    cursor = ReplayCursor()
    assert not cursor.subscribe(3, subscribed_at=100.0)
    for seq in (1, 2, 3):
        cursor.arrived(seq)
        assert cursor.take(seq, published_at=50.0) is True  # stored before the subscription
        assert cursor.advance(seq) is (seq == 3)
    cursor.arrived(4)
    assert cursor.take(4, published_at=50.0) is False  # beyond the boundary: live, whatever its clock
    # A resubscribe delivers the history again: nothing is handled twice, and no gap means no rebase.
    assert not cursor.subscribe(4, subscribed_at=200.0)
    cursor.arrived(1)
    assert [cursor.take(seq, 50.0) for seq in (1, 2, 3, 4)] == [None] * 4 and not cursor.rebase
    # The retained history starts past what was handled: events were evicted while away.
    assert not cursor.subscribe(9, subscribed_at=300.0)
    cursor.arrived(7)
    assert cursor.rebase and cursor.take(7, 50.0) is True
    # The stream went back (purged, recreated): everything is handled again from its start.
    assert cursor.subscribe(2, subscribed_at=400.0)
    cursor.arrived(1)
    assert cursor.take(1, 50.0) is True and not cursor.empty
    assert cursor.subscribe(0, subscribed_at=500.0) and cursor.empty  # emptied: reset too, and nothing to replay


class _MarksUnreadableBus(MemoryBus):
    """A MemoryBus on which the counter subject cannot be read (the consumer limit, a denied read)."""

    def __init__(self) -> None:
        super().__init__()
        self.unreadable = True

    async def last_seq(self, subject: str) -> int:
        if self.unreadable and subject.endswith(".counter"):
            raise BusError("cannot subscribe: the stream has all the consumers it allows")
        return await super().last_seq(subject)


async def test_a_tracker_that_cannot_read_the_marks_follows_and_says_so_in_a_gauge(
    policy: str, registry: CollectorRegistry
) -> None:
    bus = _MarksUnreadableBus()
    await publish(bus, policy, 3)
    async with VersionTracker(bus, policy, registry=registry, retry_delay=0.01) as tracker:
        assert await tracker.wait_ready(TIMEOUT) == 3  # never deaf for want of the marks
        assert sample(registry, "weightbus_tracker_marks_unread", policy) == 1
    bus.unreadable = False
    later = CollectorRegistry()
    async with VersionTracker(bus, policy, registry=later) as tracker:
        assert await tracker.wait_ready(TIMEOUT) == 3
        assert sample(later, "weightbus_tracker_marks_unread", policy) == 0
