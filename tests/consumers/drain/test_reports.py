"""Drain reports: conversion, deterministic msg ids, and publish failures that never fail a drain."""

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import make_group, wait_until
from weightbus.bus import subjects
from weightbus.bus.memory import MemoryBus
from weightbus.bus.protocol import PublishAck
from weightbus.consumers import (
    DrainReporter,
    FullyAsyncBuffer,
    StalenessMetrics,
    StalenessStage,
    judge_groups,
    to_drain_report,
)
from weightbus.errors import InvalidPolicyError, PublishError
from weightbus.schemas import DrainReport, decode, encode


class FailingBus:
    """A bus whose every publish fails the way ``NatsBus`` does after its retries, or hangs."""

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.calls = 0

    async def publish(self, subject, event, *, msg_id, expected_last_seq=None, headers=None) -> PublishAck:
        self.calls += 1
        if self.hang:
            await asyncio.sleep(10)
        raise PublishError(subject, "no responders")


def test_to_drain_report_carries_the_stats_and_is_valid_on_the_wire():
    j = judge_groups([make_group(1, ["10"]), make_group(2, ["5"]), make_group(3, ["12"])], 10, max_staleness=2)
    report = to_drain_report(j.stats, policy="p", consumer="rm-0", seq=3, published_at=1.0)
    assert report == DrainReport(
        policy="p",
        consumer="rm-0",
        seq=3,
        current=12,
        kept=2,
        recycled=0,
        dropped=1,
        published_at=1.0,
        reasons={"stale": 1},
        staleness_avg=(2 + 7 + 0) / 3,
        staleness_max=7,
        tracker_behind=1,
        queue_size=0,
        version_state="given",
        tokens_trained=4,
        tokens_not_trained={"stale": 2},
        by_length={"kept": {"0-16": 2}, "dropped": {"0-16": 1}},
        by_reward={"kept": {"none": 2}, "dropped": {"none": 1}},
    )
    assert decode(subjects.drains("p"), encode(report)) == report


async def test_buffer_publishes_one_report_per_drain_on_the_memory_bus():
    bus = MemoryBus()
    buffer = FullyAsyncBuffer(10, reporter=DrainReporter(bus, "p", "rm-0"))
    for i in range(3):
        await buffer.put(make_group(i, ["4"]))
    await buffer.drain(1, 5)
    await buffer.drain(1, None)
    await buffer.reporter.flush(5)
    last = await bus.last(subjects.drains("p"))
    assert last is not None and isinstance(last.event, DrainReport)
    assert (last.event.seq, last.event.current, last.event.kept, last.event.queue_size) == (2, None, 1, 1)
    assert last.headers.get("Nats-Msg-Id") in (None, "p:drain:rm-0:2")


async def test_msg_id_is_deterministic():
    seen = []

    class RecordingBus:
        async def publish(self, subject, event, *, msg_id, expected_last_seq=None, headers=None):
            seen.append((subject, msg_id))
            return PublishAck(seq=len(seen))

    reporter = DrainReporter(RecordingBus(), "p", "rm-0", start_seq=41)
    stats = judge_groups([make_group(1, ["1"])], 1).stats
    assert await reporter.report(stats)
    assert seen == [("weightbus.p.drains", "p:drain:rm-0:42")]


@pytest.mark.parametrize("hang", [False, True])
async def test_publish_failure_is_logged_and_counted_and_never_fails_the_drain(hang, caplog):
    registry = CollectorRegistry()
    metrics = StalenessMetrics(registry).for_policy("p")
    bus = FailingBus(hang=hang)
    reporter = DrainReporter(bus, "p", "rm-0", metrics=metrics, timeout=0.05)
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(metrics=metrics), reporter=reporter)
    await buffer.put(make_group(1, ["1"]))
    with caplog.at_level(logging.WARNING, logger="weightbus.consumers.drain.reports"):
        drain = await buffer.drain(1, 1)
        await reporter.flush(5)
    assert [g.prompt_index for g in drain.groups] == [1]
    assert bus.calls == 1 and reporter.failures == 1
    assert registry.get_sample_value("weightbus_drain_report_failures_total", {"policy": "p"}) == 1
    assert "p:drain:rm-0:1" in caplog.text


def test_reporter_validates_the_policy():
    with pytest.raises(InvalidPolicyError):
        DrainReporter(MemoryBus(), "bad.policy", "rm-0")


class BufferingBus:
    """A bus that, while ``down``, keeps what is published and answers nothing, as nats-py's reconnect
    buffer does; when ``up()`` it stores what it kept, deduplicating by ``msg_id`` as JetStream does."""

    def __init__(self) -> None:
        self.down = False
        self.kept: list[tuple[str, object]] = []
        self.stored: dict[str, object] = {}
        self.calls = 0

    async def publish(self, subject, event, *, msg_id, expected_last_seq=None, headers=None) -> PublishAck:
        self.calls += 1
        if self.down:
            self.kept.append((msg_id, event))
            await asyncio.sleep(10)  # no acknowledgement while disconnected
        duplicate = msg_id in self.stored
        self.stored.setdefault(msg_id, event)
        return PublishAck(seq=len(self.stored), duplicate=duplicate)

    def up(self) -> None:
        self.down = False
        for msg_id, event in self.kept:
            self.stored.setdefault(msg_id, event)
        self.kept.clear()


async def test_a_report_stored_after_its_publish_timed_out_is_not_counted_as_failed():
    registry = CollectorRegistry()
    metrics = StalenessMetrics(registry).for_policy("p")
    bus = BufferingBus()
    reporter = DrainReporter(bus, "p", "rm-0", metrics=metrics, timeout=0.05)
    stats = judge_groups([make_group(1, ["1"])], 1).stats
    bus.down = True
    reporter.submit(stats)
    await wait_until(lambda: reporter.in_doubt > 0, 5, "the report to be in doubt")
    bus.up()  # the client's buffer went out on reconnect: report 1 is stored
    reporter.submit(stats)
    await reporter.flush(5)
    assert sorted(bus.stored) == ["p:drain:rm-0:1", "p:drain:rm-0:2"]
    assert reporter.failures == 0 and reporter.in_doubt == 0
    assert registry.get_sample_value("weightbus_drain_report_failures_total", {"policy": "p"}) == 0
    await reporter.aclose()


async def test_a_report_that_never_lands_is_counted_once_when_given_up():
    bus = BufferingBus()
    reporter = DrainReporter(bus, "p", "rm-0", timeout=0.05)
    bus.down = True
    reporter.submit(judge_groups([make_group(1, ["1"])], 1).stats)
    await wait_until(lambda: reporter.in_doubt > 0, 5, "the report to be in doubt")
    bus.kept.clear()  # lost with the connection
    await reporter.aclose()
    assert reporter.failures == 1 and reporter.in_doubt == 0 and bus.stored == {}


def test_a_report_submitted_outside_the_event_loop_is_dropped_and_counted():
    reporter = DrainReporter(MemoryBus(), "p", "rm-0")
    assert not reporter.submit(judge_groups([make_group(1, ["1"])], 1).stats)
    assert reporter.dropped == 1 and reporter.seq == 1


@pytest.mark.nats
@pytest.mark.slow
async def test_reports_queued_while_nats_is_down_and_stored_later_are_not_failures(tmp_path, policy):
    from weightbus.bus import connect
    from weightbus.bus.history import read_subject_history
    from weightbus.embedded.server import EmbeddedNats

    server = EmbeddedNats(store_dir=tmp_path / "js").start()
    bus = await connect(server.url, publish_timeout=0.3, publish_attempts=1)
    try:
        reporter = DrainReporter(bus, policy, "rm-0", timeout=0.5)
        buffer = FullyAsyncBuffer(16, reporter=reporter)
        for i in range(4):
            await buffer.put(make_group(i, ["3"]))
        await buffer.drain(1, 3)
        await reporter.flush(5)
        server.kill()
        await buffer.drain(1, 3)  # its publish times out: nats-py keeps it for the reconnect
        await wait_until(lambda: reporter.in_doubt > 0, 10, "the report to be in doubt")
        await asyncio.to_thread(server.start)  # the same store: the kept publish goes out
        await wait_until(lambda: bus.client.is_connected, 20, "the client to reconnect")
        await buffer.drain(1, 3)
        await reporter.flush(10)
        seqs = [env.event.seq for env in (await read_subject_history(bus, subjects.drains(policy))).events]
        assert sorted(seqs) == [1, 2, 3]  # each stored once: the retry of 2 was deduplicated or stored it
        assert reporter.failures == 0
        await reporter.aclose()
    finally:
        await bus.aclose()
        server.stop()
