"""The rollout side's integrity on a real nats-server: never judge against "no version", never go deaf in
silence, never lose a drained group, never wait on monitoring, alert once per offending event."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

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
from weightbus.producers import VersionPublisher
from weightbus.schemas import Group, Sample, SampleStatus, VersionRegressed, WeightUpdated, now

from .conftest import history

pytestmark = pytest.mark.nats


def group(i: int, *labels: str, aborted: bool = False) -> Group:
    status = SampleStatus.ABORTED if aborted else SampleStatus.COMPLETED
    return Group(prompt_index=i, samples=[Sample(index=i, weight_versions=list(labels), status=status)])


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
    await buffer.put(group(0, "1"))  # 24 versions stale
    await buffer.put(group(1, "25"))
    tracker = await VersionTracker(nats_bus, policy).start()  # not awaited ready: the drain must wait
    try:
        drain = await buffer.drain(1, tracker)
        assert [g.prompt_index for g in drain.groups] == [1]
        assert drain.stats.current == 25 and drain.stats.version_state == "current"
        assert drain.stats.reasons == {"stale": 1}
    finally:
        await tracker.stop()


async def test_only_a_policy_that_never_published_turns_the_filter_off_and_says_so(
    nats_bus: NatsBus, policy: str
) -> None:
    await VersionPublisher(nats_bus, policy, trainer_id="t").start()  # claimed, never announced
    buffer = FullyAsyncBuffer(4, stage=StalenessStage(max_staleness=1))
    await buffer.put(group(0, "1"))
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
            async with asyncio.timeout(10):
                while tracker.status is not TrackerStatus.DEAF:
                    await asyncio.sleep(0.05)
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
        await bus.close()
        server.stop()


async def test_a_regression_is_alerted_once_and_a_restarted_raise_mode_consumer_does_not_crash_loop(
    nats_bus: NatsBus, policy: str
) -> None:
    await _publish_versions(nats_bus, policy, 4)
    rogue = WeightUpdated(policy=policy, version=1, epoch=0, trainer_id="rogue", published_at=now())
    await nats_bus.publish(subjects.weights(policy), rogue, msg_id=f"{policy}:rogue")
    for observer in ("rm-0", "rm-1", "rm-0"):  # restarts and a second consumer
        async with VersionTracker(nats_bus, policy, regression=RegressionMode.RAISE, observer=observer) as tracker:
            assert tracker.current == 4
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert len([a for a in alerts if isinstance(a, VersionRegressed)]) == 1


async def test_a_cancelled_or_failed_drain_puts_every_kept_group_back() -> None:
    buffer = FullyAsyncBuffer(8, samples_per_group=1)
    await buffer.put(group(0, "5"))
    await buffer.put(group(1, "5"))
    pending = asyncio.create_task(buffer.drain(3, 5))
    await asyncio.sleep(0.05)
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
    await buffer.put(group(0, "13", aborted=True))
    await buffer.put(group(1, "11"))
    await buffer.put(group(2, "13"))
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
            await buffer.put(group(i, "3"))
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
        await bus.close()
        server.stop()
