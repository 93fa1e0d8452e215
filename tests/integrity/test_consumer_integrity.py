"""The rollout side's integrity on a real nats-server: never judge against "no version", never go deaf in
silence, never lose a drained group, never wait on monitoring, alert once per offending event."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import has_waiters, make_group, updated, wait_until
from tests.chaos.conftest import report
from weightbus.bus import NatsBus, connect, subjects
from weightbus.consumers import (
    DrainReporter,
    FullyAsyncBuffer,
    RegressionMode,
    StalenessMetrics,
    StalenessStage,
    VersionTracker,
)
from weightbus.consumers.tracker.tracker import TrackerStatus
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import TrackerNotReadyError
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.producers.status import read_status
from weightbus.schemas import (
    Group,
    PublisherClaimed,
    Sample,
    SampleStatus,
    VersionRegressed,
    VersionRejected,
    WeightUpdated,
    now,
)

from .conftest import Engines, history

pytestmark = pytest.mark.nats


async def _publish_versions(bus: NatsBus, policy: str, n: int) -> VersionPublisher:
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    for _ in range(n):
        async with pub.update():
            pass
    return pub


async def test_a_tracker_is_ready_when_entered_and_a_drain_never_judges_against_no_version(
    nats_bus: NatsBus, policy: str
) -> None:
    await _publish_versions(nats_bus, policy, 25)
    for _ in range(20):
        async with VersionTracker(nats_bus, policy) as tracker:
            assert tracker.current == 25
    buffer = FullyAsyncBuffer(4, stage=StalenessStage(max_staleness=1, on_stale="drop"))
    await buffer.put(make_group(0, ["1"], n=1))  # 24 versions stale
    await buffer.put(make_group(1, ["25"], n=1))
    tracker = await VersionTracker(nats_bus, policy).start()  # not awaited ready: the drain must wait
    try:
        drain = await buffer.drain(1, tracker)
        assert [g.prompt_index for g in drain.groups] == [1]
        assert drain.stats.current == 25 and drain.stats.version_state == "current"
        assert drain.stats.reasons == {"stale": 1}
    finally:
        await tracker.aclose()


async def test_only_a_policy_that_never_published_turns_the_filter_off_and_says_so(
    nats_bus: NatsBus, policy: str
) -> None:
    await VersionPublisher(nats_bus, policy, trainer_id="t").start()  # claimed, never announced
    buffer = FullyAsyncBuffer(4, stage=StalenessStage(max_staleness=1))
    await buffer.put(make_group(0, ["1"], n=1))
    async with VersionTracker(nats_bus, policy) as tracker:
        assert tracker.status is TrackerStatus.NEVER_PUBLISHED
        drain = await buffer.drain(1, tracker)
    assert drain.stats.current is None and drain.stats.version_state == "never_published"


@pytest.mark.slow
async def test_a_deaf_tracker_is_not_ready_and_comes_back_with_a_recreated_stream(
    tmp_path: Path, policy: str, registry: CollectorRegistry
) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "js").start()  # its own server: the stream is deleted
    bus = await connect(server.url)
    try:
        await _publish_versions(bus, policy, 2)
        async with VersionTracker(bus, policy, registry=registry, check_interval=0.2, retry_delay=0.1) as tracker:
            await bus.js.delete_stream(bus.stream)
            await wait_until(lambda: tracker.status is TrackerStatus.DEAF, 10, "the tracker to go deaf")
            assert registry.get_sample_value("weightbus_tracker_ready", {"policy": policy}) == 0
            with pytest.raises(TrackerNotReadyError, match="deaf"):
                tracker.current  # noqa: B018
            await bus.ensure_stream()
            pub = await VersionPublisher(bus, policy, trainer_id="t2").start()
            async with pub.update() as version:
                assert version == 1  # no fleet and no history: the counter restarts...
            await tracker.wait_ready(10)
            assert tracker.current == 2  # ...but the tracker holds what it knew, and says why
            assert registry.get_sample_value("weightbus_tracker_ready", {"policy": policy}) == 1
    finally:
        await bus.aclose()
        server.stop()


async def test_a_regression_is_alerted_once_and_a_restarted_raise_mode_consumer_does_not_crash_loop(
    nats_bus: NatsBus, policy: str
) -> None:
    await _publish_versions(nats_bus, policy, 4)
    rogue = updated(1, policy=policy, epoch=0, trainer="rogue")
    await nats_bus.publish(subjects.weights(policy), rogue, msg_id=f"{policy}:rogue")
    for observer in ("rm-0", "rm-1", "rm-0"):  # restarts and a second consumer
        async with VersionTracker(nats_bus, policy, regression=RegressionMode.RAISE, observer=observer) as tracker:
            assert tracker.current == 4
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert len([a for a in alerts if isinstance(a, VersionRegressed)]) == 1


async def test_a_cancelled_or_failed_drain_puts_every_kept_group_back() -> None:
    buffer = FullyAsyncBuffer(8, samples_per_group=1)
    await buffer.put(make_group(0, ["5"], n=1))
    await buffer.put(make_group(1, ["5"], n=1))
    pending = asyncio.create_task(buffer.drain(3, 5))
    await wait_until(lambda: has_waiters(buffer._changed), 5, "the drain to wait for a third group")
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert len(buffer) == 2
    await buffer.put(Group(prompt_index=2, samples=[Sample(index=2, weight_versions=["5"])] * 2))
    with pytest.raises(ValueError, match="put back"):
        await buffer.drain(3, 5)
    assert len(buffer) == 3
    assert [g.prompt_index for g in (await buffer.drain(2, 5)).groups] == [0, 1]


async def test_an_aborted_groups_newer_label_raises_the_drains_current() -> None:
    buffer = FullyAsyncBuffer(8, stage=StalenessStage(max_staleness=1, on_stale="drop"))
    await buffer.put(make_group(0, ["13"], status=SampleStatus.ABORTED, n=1))
    await buffer.put(make_group(1, ["11"], n=1))
    await buffer.put(make_group(2, ["13"], n=1))
    drain = await buffer.drain(1, 10)
    assert [g.prompt_index for g in drain.groups] == [2]
    assert drain.stats.current == 13 and drain.stats.reasons.get("stale") == 1


@pytest.mark.slow
async def test_drains_cost_the_same_with_nats_down(tmp_path: Path, policy: str) -> None:
    registry = CollectorRegistry()
    metrics = StalenessMetrics(registry).for_policy(policy)
    server = EmbeddedNats(store_dir=tmp_path / "js").start()
    bus = await connect(server.url, publish_timeout=0.5, publish_attempts=2)
    try:
        reporter = DrainReporter(bus, policy, "rm-0", metrics=metrics, timeout=1.0, max_queued=4)
        buffer = FullyAsyncBuffer(64, stage=StalenessStage(metrics=metrics), reporter=reporter)
        for i in range(20):
            await buffer.put(make_group(i, ["3"], n=1))
        await buffer.drain(1, 3)
        await reporter.flush(5)
        server.kill()
        took = []
        for _ in range(10):
            start = time.perf_counter()
            await buffer.drain(1, 3)
            took.append(time.perf_counter() - start)
        # Before: every drain blocked 2 s on the report. Now the report waits in a bounded queue.
        report(
            "NATS down during drains",
            drains=len(took),
            slowest_drain_ms=round(max(took) * 1000, 2),
            reports_dropped=reporter.dropped,
            lost_groups=0,
        )
        assert max(took) < 0.25, took
        assert reporter.dropped >= 5
        assert registry.get_sample_value("weightbus_drain_reports_dropped_total", {"policy": policy}) >= 5
        await asyncio.to_thread(server.start)  # back on the same store: the queued reports go out
        await reporter.flush(20)
        assert reporter.seq == 11
        await reporter.aclose(timeout=5)
    finally:
        await bus.aclose()
        server.stop()


def _rejected(registry: CollectorRegistry, policy: str, reason: str) -> float:
    return registry.get_sample_value("weightbus_events_rejected_total", {"policy": policy, "reason": reason}) or 0.0


@pytest.mark.parametrize("previous", [None, "t"], ids=["no-history", "epoch-plus-one"])
async def test_a_forged_claim_far_above_the_chain_pins_no_tracker_fences_no_owner_and_recycles_no_group(
    nats_bus: NatsBus, nats_url: str, policy: str, previous: str | None
) -> None:
    pub = await _publish_versions(nats_bus, policy, 3)
    assert pub.state.epoch is not None
    running_registry, fresh_registry = CollectorRegistry(), CollectorRegistry()
    buffer = FullyAsyncBuffer(8, stage=StalenessStage(max_staleness=1, on_stale="recycle"))
    async with VersionTracker(nats_bus, policy, registry=running_registry, check_interval=0.2) as running:
        changes = running.changes(include_regressions=True)
        assert (await anext(changes)).version == 3
        # A buggy tool (or an operator's typo) claims the counter at the largest safe integer.
        forged = PublisherClaimed(
            policy=policy,
            epoch=pub.state.epoch + 1,
            trainer_id="typo",
            published_at=now(),
            version=2**53 - 1,
            previous_trainer_id=previous,
            incarnation="forged",
        )
        await nats_bus.publish(subjects.weights(policy), forged, msg_id=f"{policy}:forged")
        seen = await asyncio.wait_for(anext(changes), 5)
        await changes.aclose()
        assert (seen.incoming, seen.version, seen.reason) == (2**53 - 1, 3, "unexplained_claim")
        async with VersionTracker(nats_bus, policy, registry=fresh_registry) as fresh:
            assert fresh.current == 3
            for i in range(8):
                await buffer.put(make_group(i, ["3"], n=1))
            drain = await asyncio.wait_for(buffer.drain(8, fresh), 5)
            assert [g.prompt_index for g in drain.groups] == list(range(8))  # all eight trained, none recycled
            assert drain.stats.current == 3 and not drain.stats.reasons
            async with pub.update() as version:  # the owner is not fenced by it
                assert version == 4
            assert await fresh.wait_for(4, 5) == 4 and fresh.publisher == "t"
        assert await running.wait_for(4, 5) == 4 and running.publisher == "t"
    updates = [e.event for e in await history(nats_bus, subjects.weights(policy)) if isinstance(e.event, WeightUpdated)]
    assert [(u.version, u.trainer_id) for u in updates] == [(1, "t"), (2, "t"), (3, "t"), (4, "t")]
    # Rejected, counted by each tracker, alerted once for the fleet, and shown by status.
    assert _rejected(running_registry, policy, "unexplained_claim") == 1
    assert _rejected(fresh_registry, policy, "unexplained_claim") == 1
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    rejected = [a for a in alerts if isinstance(a, VersionRejected)]
    assert [(a.reason, a.event_type, a.incoming, a.current, a.publisher) for a in rejected] == [
        ("unexplained_claim", "PublisherClaimed", 2**53 - 1, 3, "typo")
    ]
    status = await read_status(nats_bus, policy)
    assert (status.version, status.publisher, status.epoch) == (4, "t", pub.state.epoch)
    assert status.rejected == f"unexplained_claim: PublisherClaimed v{2**53 - 1} by typo"
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weightbus", "status", "--policy", policy, "--nats", nats_url, "--json",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    doc = json.loads((await cli.communicate())[0])
    text = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weightbus", "status", "--policy", policy, "--nats", nats_url,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    shown = (await text.communicate())[0].decode()
    assert f"REJECTED   v{2**53 - 1} by typo" in shown and "PublisherClaimed not accepted (unexplained_claim)" in shown
    assert "version    4" in shown
    assert (doc["version"], doc["publisher"], doc["latest_rejected"]) == (4, "t", False)
    assert [(r["reason"], r["event_type"], r["version"], r["held"]) for r in doc["rejected"]] == [
        ("unexplained_claim", "PublisherClaimed", 2**53 - 1, 3)
    ]
    successor = await VersionPublisher(nats_bus, policy, trainer_id="u").start()
    assert (successor.state.version, successor.state.next_version) == (
        4,
        6,
    )  # resumes from the chain, not from the claim


async def test_a_resume_above_the_engines_labels_after_a_lost_history_is_still_followed_by_every_tracker(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e1"), engines.add("e2")])
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet).start()
    async with VersionTracker(nats_bus, policy, check_interval=0.2) as running:
        for _ in range(5):
            async with pub.update():
                pass
        await running.wait_for(5, 5)
        await pub.settle()  # the mark after the last announcement (deferred by mark_delay) is written
        await nats_bus.js.purge_stream(nats_bus.stream, subject=subjects.weights(policy))
        # The replacement finds no history and resumes above the engines' label and the counter's mark:
        # its claim names 5, and 6, which the predecessor's last announcement reserved, is never reissued.
        restarted = await VersionPublisher(nats_bus, policy, trainer_id="t2", fleet=fleet).start()
        async with VersionTracker(nats_bus, policy) as fresh:
            assert fresh.current == 5 and fresh.publisher == "t2"
            async with restarted.update() as version:
                assert version == 7
            assert await fresh.wait_for(7, 5) == 7
        assert await running.wait_for(7, 5) == 7 and running.publisher == "t2"
    async with VersionTracker(nats_bus, policy) as late:
        assert late.current == 7
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert not [a for a in alerts if isinstance(a, VersionRejected)]
    assert (await read_status(nats_bus, policy)).rejected is None
