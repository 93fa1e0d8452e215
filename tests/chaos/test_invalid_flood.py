"""Chaos: 10,000 invalid payloads flood a policy's subjects while a trainer publishes.

A raw nats-py client (a rogue publisher with permission on the subjects) stores 10,000 payloads that fail
the typed decode, of four kinds (malformed JSON, wrong field type, negative version, unknown tag):
9,000 on the drains subjects of 180 other policies, interleaved with 20 real updates from a
``VersionPublisher``, then 950 on other policies' weights subjects and 50 on the tracked policy's weights
subject after its last update. A ``VersionTracker`` and a watcher (the ``weightbus watch`` reducer over a
``weightbus.>`` subscription) follow on their own connections. Checked: both end at the last version; the
watcher counted exactly 10,000 invalid events and the tracker exactly the 50 of its subject; the recorder
saw versions 1..last exactly once; this process's memory grew by less than ``MEMORY_BOUND_MIB``.

At most 50 payloads land on any one subject: the stream keeps 64 events per subject and discards the
oldest, so a burst larger than that on a single subject is evicted before a slow reader gets to it and
no subscriber could count it (the latest event of each subject is always kept, which is what a tracker
needs).

``test_trainer_survives_invalid_payloads_on_its_subject``: invalid payloads on the weights subject do not
stop the trainer (the publisher resolves its conditional publish past them from the history).

``test_forged_claims_raced_against_every_update_move_nothing``: schema-valid claims that nothing on the
chain explains (the largest safe integer and below, with no history or a higher epoch), each raced
against one of the trainer's updates: no tracker moves, the trainer is never fenced, every forged claim
is counted and alerted exactly once.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from prometheus_client import CollectorRegistry

from tests._builders import wait_until
from tests.chaos.conftest import EventRecorder, assert_versions_exact, report, rss_mib
from weightbus.bus import BusMetrics, Deliver, NatsBus, connect, subjects
from weightbus.bus.history import read_subject_history
from weightbus.consumers import VersionTracker
from weightbus.consumers.monitor import MonitorState, reduce
from weightbus.embedded.server import EmbeddedNats
from weightbus.producers import VersionPublisher
from weightbus.schemas import PublisherClaimed, VersionRejected, WeightUpdated, encode, now

pytestmark = [pytest.mark.slow, pytest.mark.nats]

FLOOD = 10_000
PER_SUBJECT = 50
ON_OWN_WEIGHTS = 50
ON_OTHER_WEIGHTS = 950
UPDATES = 20
MEMORY_BOUND_MIB = 64.0
KINDS = {
    "malformed": b"{not json",
    "invalid": b'{"type": "weight.updated", "policy": "chaos-flood", "version": "seven"}',
    "negative": b'{"type": "weight.updated", "policy": "chaos-flood", "version": -1, "epoch": 0,'
    b' "trainer_id": "rogue", "published_at": 1.0}',
    "unknown_tag": b'{"type": "weights.updated", "version": 10}',
}


async def test_ten_thousand_invalid_payloads(own_server: EmbeddedNats, open_buses: list[NatsBus]) -> None:
    policy = "chaos-flood"
    url = own_server.url
    tracker_registry, watcher_registry = CollectorRegistry(), CollectorRegistry()
    trainer_bus = await connect(url, name="chaos-trainer")
    tracker_bus = await connect(url, name="chaos-tracker", metrics=BusMetrics(tracker_registry))
    watcher_bus = await connect(url, name="chaos-watcher", metrics=BusMetrics(watcher_registry))
    recorder_bus = await connect(url, name="chaos-recorder")
    open_buses.extend([trainer_bus, tracker_bus, watcher_bus, recorder_bus])
    recorder = await EventRecorder(recorder_bus, policy).start()
    pub = await VersionPublisher(trainer_bus, policy, trainer_id="chaos-trainer").start()
    tracker = await VersionTracker(tracker_bus, policy).start()

    watch_state = MonitorState()
    watch_sub = watcher_bus.subscribe("weightbus.>", deliver=Deliver.NEW)
    await watch_sub.start()

    async def _watch() -> None:
        nonlocal watch_state
        async for env in watch_sub:
            watch_state = reduce(watch_state, env.subject, env.event, received_at=time.time())

    watcher = asyncio.create_task(_watch())
    rogue = await nats.connect(url, name="chaos-rogue")
    js = rogue.jetstream()
    expected: dict[str, int] = {}

    def payload(i: int) -> bytes:
        kind = list(KINDS)[i % len(KINDS)]
        reason = "malformed" if kind == "malformed" else "invalid"  # the decoder's reason label
        expected[reason] = expected.get(reason, 0) + 1
        return KINDS[kind]

    def flood_subject(i: int, family: str) -> str:
        return f"weightbus.flood-{i // PER_SUBJECT}.{family}"

    rss_before = rss_mib()
    started = time.monotonic()
    last = 0
    try:
        per_update = (FLOOD - ON_OWN_WEIGHTS - ON_OTHER_WEIGHTS) // UPDATES
        sent = 0
        for _ in range(UPDATES):
            acks = [js.publish_async(flood_subject(i, "drains"), payload(i)) for i in range(sent, sent + per_update)]
            await asyncio.gather(*acks)
            sent += per_update
            async with pub.update() as version:
                pass
            last = version
        others = [js.publish_async(flood_subject(i, "weights"), payload(i)) for i in range(ON_OTHER_WEIGHTS)]
        own = [js.publish_async(subjects.weights(policy), payload(i)) for i in range(ON_OWN_WEIGHTS)]
        await asyncio.gather(*others, *own)
        sent += ON_OTHER_WEIGHTS + ON_OWN_WEIGHTS
        assert sent == FLOOD
        flood_s = time.monotonic() - started
        await tracker.wait_for(last, timeout=30)
        assert tracker.current == last

        def _watched() -> int | None:
            view = watch_state.policies.get(policy)
            return view.weights.version if view is not None else None

        def _invalid(registry: CollectorRegistry) -> float:
            total = 0.0
            for family in registry.collect():
                for sample in family.samples:
                    if sample.name == "weightbus_invalid_events_total":
                        total += sample.value
            return total

        await wait_until(lambda: _watched() == last, 30, f"the watcher to show v{last}")
        # The watcher sees the whole flood; the tracker only what landed on the weights subject.
        await wait_until(lambda: _invalid(watcher_registry) == FLOOD, 30, "the watcher to count every invalid event")
        await wait_until(lambda: _invalid(tracker_registry) == ON_OWN_WEIGHTS, 30, "the tracker to count its share")
        assert tracker.current == last and _watched() == last
        await wait_until(lambda: last in recorder.weight_versions(), 30, f"the recorder to receive v{last}")
        drained_s = time.monotonic() - started
        assert_versions_exact(recorder.weight_versions(), last)
        by_reason: dict[str, int] = {}
        for family in watcher_registry.collect():
            for sample in family.samples:
                if sample.name == "weightbus_invalid_events_total":
                    reason = sample.labels["reason"]
                    by_reason[reason] = by_reason.get(reason, 0) + int(sample.value)
        counted = {reason: n for reason, n in by_reason.items() if n}  # every reason is exported from 0
        assert counted == expected and sum(expected.values()) == FLOOD, by_reason
        growth = rss_mib() - rss_before
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await watch_sub.aclose()
        await tracker.aclose()
        await recorder.aclose()
        await rogue.close()

    report(
        "flood of 10,000 invalid payloads",
        invalid=FLOOD,
        versions=last,
        lost=0,
        duplicated=0,
        counted_by_watcher=int(_invalid(watcher_registry)),
        counted_by_tracker=int(_invalid(tracker_registry)),
        by_reason=by_reason,
        flood_s=round(flood_s, 2),
        all_consumed_s=round(drained_s, 2),
        rss_growth_mib=round(growth, 1),
    )
    assert growth < MEMORY_BOUND_MIB, f"memory grew by {growth:.1f} MiB"


async def test_trainer_survives_invalid_payloads_on_its_subject(own_server: EmbeddedNats) -> None:
    policy = "chaos-rogue-last"
    bus = await connect(own_server.url, name="chaos-trainer")
    rogue = await nats.connect(own_server.url, name="chaos-rogue")
    try:
        pub = await VersionPublisher(bus, policy, trainer_id="t").start()
        async with pub.update():
            pass
        await rogue.jetstream().publish(subjects.weights(policy), KINDS["malformed"])
        async with pub.update() as version:
            pass
        assert version == 2
    finally:
        await rogue.close()
        await bus.aclose()


async def test_forged_claims_raced_against_every_update_move_nothing(own_server: EmbeddedNats) -> None:
    policy = "chaos-forged-claims"
    registry = CollectorRegistry()
    bus = await connect(own_server.url, name="chaos-trainer")
    tracker_bus = await connect(own_server.url, name="chaos-tracker")
    rogue = await nats.connect(own_server.url, name="chaos-rogue")
    js = rogue.jetstream()
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    assert pub.state.epoch is not None
    tracker = await VersionTracker(tracker_bus, policy, registry=registry).start()
    try:
        for i in range(UPDATES):
            forged = PublisherClaimed(
                policy=policy,
                epoch=pub.state.epoch + 1 + i,
                trainer_id=f"typo-{i}",
                published_at=now(),
                version=2**53 - 1 - i,
                previous_trainer_id=None if i % 2 else "t",
                reserved=2**53 - 1 - i if i % 3 else None,
            )
            racer = asyncio.create_task(js.publish(subjects.weights(policy), encode(forged)))
            async with pub.update() as version:
                await asyncio.sleep(0)
            assert version == i + 1
            await racer
        assert pub.state.fenced is None
        assert await tracker.wait_for(UPDATES, 30) == UPDATES

        def _rejected() -> float:
            labels = {"policy": policy, "reason": "unexplained_claim"}
            return registry.get_sample_value("weightbus_events_rejected_total", labels) or 0.0

        await wait_until(lambda: _rejected() == UPDATES, 30, "the tracker to count every forged claim")
        async with VersionTracker(tracker_bus, policy, registry=CollectorRegistry()) as late:
            assert late.current == UPDATES and late.publisher == "t"
        weights = await read_subject_history(bus, subjects.weights(policy))
        updates = [e.event for e in weights.events if isinstance(e.event, WeightUpdated)]
        assert [(u.version, u.trainer_id) for u in updates] == [(v, "t") for v in range(1, UPDATES + 1)]
        alerts = await read_subject_history(bus, subjects.alerts(policy))
        rejected = [e.event for e in alerts.events if isinstance(e.event, VersionRejected)]
        assert sorted(a.publisher for a in rejected) == sorted(f"typo-{i}" for i in range(UPDATES))
        assert {a.reason for a in rejected} == {"unexplained_claim"}
        assert tracker.current == UPDATES
    finally:
        await tracker.aclose()
        await rogue.close()
        await tracker_bus.aclose()
        await bus.aclose()
