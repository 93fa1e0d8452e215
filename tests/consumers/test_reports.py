"""Drain reports: conversion, deterministic msg ids, and publish failures that never fail a drain."""

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from tests.consumers._groups import make_group
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
