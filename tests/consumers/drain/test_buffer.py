"""The fully-async buffer: the intent of miles tests 1, 4, 5, 6, 14, 15, 17, 18, plus weightbus' rules."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import has_waiters, make_group, wait_until
from weightbus.consumers import FullyAsyncBuffer, StalenessMetrics, StalenessStage, buffer_capacity, resolve_current
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

M = "rollout/fully_async/"


async def fill(buffer: FullyAsyncBuffer, *groups: Group) -> None:
    for g in groups:
        assert await buffer.put(g)


async def test_drain_returns_exactly_n_sorted_with_metrics_and_again():  # miles 1
    buffer = FullyAsyncBuffer(10)
    await fill(buffer, *(make_group(i, ["10"]) for i in (5, 3, 4, 1, 2, 6)))
    first = await buffer.drain(3, 10)
    # FIFO takes 5, 3, 4; the batch is sorted by first sample index
    assert [g.prompt_index for g in first.groups] == [3, 4, 5]
    assert all(len(g.samples) == 2 for g in first.groups)
    assert first.metrics[f"{M}aborted_groups_filtered"] == 0
    assert first.metrics[f"{M}stale_groups_filtered"] == 0
    assert first.metrics[f"{M}queue_size"] == 3
    second = await buffer.drain(3, 10)
    assert [g.prompt_index for g in second.groups] == [1, 2, 6]


async def test_aborted_group_is_filtered_at_put_and_recycled_reset():  # miles 4
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(on_stale="recycle"))
    aborted = make_group(1, ["10"], status=SampleStatus.ABORTED)
    assert not await buffer.put(aborted)
    assert len(buffer) == 0
    await fill(buffer, make_group(2, ["10"]))
    drain = await buffer.drain(1, 10)
    assert [g.prompt_index for g in drain.groups] == [2]
    assert drain.metrics[f"{M}aborted_groups_filtered"] == 1
    [recycled] = buffer.take_recycled()
    assert recycled is aborted
    assert all(
        s.weight_versions == [] and s.response == "" and s.status == SampleStatus.PENDING for s in recycled.samples
    )


async def test_stale_group_recycled_and_counted_in_max_staleness():  # miles 5
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=2, on_stale="recycle"))
    stale = make_group(1, ["5"])
    await fill(buffer, stale, make_group(2, ["10"]), make_group(3, ["10"]))
    drain = await buffer.drain(2, 10)
    assert [g.prompt_index for g in drain.groups] == [2, 3]
    assert drain.metrics[f"{M}stale_groups_filtered"] == 1
    assert drain.metrics[f"{M}max_staleness"] == 5
    assert buffer.take_recycled() == [stale] and stale.samples[0].weight_versions == []


async def test_stale_group_dropped_by_default():  # miles 6
    recycled: list[Group] = []
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=2), on_recycle=recycled.append)
    await fill(buffer, make_group(1, ["5"]), make_group(2, ["10"]))
    drain = await buffer.drain(1, 10)
    assert recycled == [] and buffer.take_recycled() == []
    assert drain.metrics[f"{M}stale_groups_filtered"] == 1
    assert drain.metrics["weightbus/dropped"] == 1


async def test_filter_off_before_the_first_weight_update():  # miles 14
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=0, on_stale="recycle"))
    await fill(buffer, make_group(1, ["5"]))
    drain = await buffer.drain(1, None)
    assert [g.prompt_index for g in drain.groups] == [1]
    assert buffer.take_recycled() == []
    assert f"{M}max_staleness" not in drain.metrics
    assert f"{M}buffer_avg_staleness" not in drain.metrics


async def test_full_buffer_blocks_the_producer_without_evicting():  # miles 15
    buffer = FullyAsyncBuffer(2)
    await fill(buffer, make_group(1, ["1"]), make_group(2, ["1"]))
    third = asyncio.create_task(buffer.put(make_group(3, ["1"])))
    await wait_until(lambda: has_waiters(buffer._changed), 5, "the put to wait for room")
    assert not third.done() and len(buffer) == 2
    first = await buffer.drain(1, 1)
    assert await asyncio.wait_for(third, 1)
    second = await buffer.drain(2, 1)
    assert [g.prompt_index for g in first.groups + second.groups] == [1, 2, 3]


async def test_drain_skips_groups_stale_at_consumption_time():  # miles 17
    recycled: list[Group] = []
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=2, on_stale="recycle"), on_recycle=recycled.append)
    stale = make_group(1, ["5"])
    # fresh when put (the tracker was at 5), stale when taken (10)
    await fill(buffer, stale, make_group(2, ["9"]))
    drain = await buffer.drain(1, 10)
    assert [g.prompt_index for g in drain.groups] == [2]
    assert recycled == [stale]
    assert drain.metrics[f"{M}stale_groups_filtered"] == 1


async def test_buffer_staleness_metrics_against_last_known_version():  # miles 18
    registry = CollectorRegistry()
    metrics = StalenessMetrics(registry).for_policy("p")
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(metrics=metrics))
    await fill(buffer, make_group(1, ["4"]), make_group(2, ["6"]), make_group(3, ["8"]))
    assert registry.get_sample_value("weightbus_buffer_groups", {"policy": "p"}) == 3
    drain = await buffer.drain(1, 10)
    assert drain.metrics[f"{M}avg_staleness"] == 6.0
    assert drain.metrics[f"{M}buffer_avg_staleness"] == 3.0
    assert drain.metrics[f"{M}buffer_max_staleness"] == 4
    assert registry.get_sample_value("weightbus_buffer_avg_staleness", {"policy": "p"}) == 3.0
    assert registry.get_sample_value("weightbus_buffer_max_staleness", {"policy": "p"}) == 4
    assert registry.get_sample_value("weightbus_buffer_groups", {"policy": "p"}) == 2
    # a later drain without a version still measures the buffer against the last known one (10)
    later = await buffer.drain(1, None)
    assert later.metrics[f"{M}buffer_avg_staleness"] == 2.0
    assert f"{M}avg_staleness" not in later.metrics


async def test_metrics_window_resets_per_drain():
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=1))
    await buffer.put(make_group(9, ["1"], status=SampleStatus.ABORTED))
    await fill(buffer, make_group(1, ["1"]), make_group(2, ["10"]), make_group(3, ["10"]))
    first = await buffer.drain(1, 10)
    assert first.stats.reasons == {"stale": 1, "aborted": 1}
    assert first.stats.dropped == 2
    second = await buffer.drain(1, 10)
    assert second.stats.reasons == {} and second.stats.dropped == 0
    assert second.metrics[f"{M}stale_groups_filtered"] == 0
    assert second.metrics[f"{M}aborted_groups_filtered"] == 0


async def test_unknown_label_is_filtered_at_take_time():
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=4))
    await fill(buffer, make_group(1, [["default"], ["10"]]), make_group(2, ["10"]))
    drain = await buffer.drain(1, 10)
    assert [g.prompt_index for g in drain.groups] == [2]
    assert drain.stats.reasons == {"unknown_version": 1}


async def test_tracker_behind_raises_the_drain_current_and_rejudges():
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=1))
    await fill(buffer, make_group(1, ["9"]), make_group(2, ["12"]), make_group(3, ["12"]))
    drain = await buffer.drain(2, 10)
    # group 1 was fresh at 10 but the drain saw 12: it is stale (3) and a later group replaces it
    assert [g.prompt_index for g in drain.groups] == [2, 3]
    assert (drain.stats.current, drain.stats.tracker_current, drain.stats.tracker_behind) == (12, 10, 2)
    assert drain.stats.reasons == {"stale": 1}


async def test_current_is_read_once_from_a_tracker_like_object():
    class Tracker:
        reads = 0

        @property
        def current(self):
            Tracker.reads += 1
            return 10

    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=0))
    await fill(buffer, *(make_group(i, ["10"]) for i in range(4)))
    drain = await buffer.drain(4, Tracker())
    assert Tracker.reads == 1 and drain.stats.current == 10
    await fill(buffer, make_group(7, ["3"]))
    assert (await buffer.drain(1, lambda: 3)).stats.current == 3


def test_resolve_current_rejects_bad_sources():
    assert resolve_current(None) is None and resolve_current(4) == 4
    with pytest.raises(TypeError):
        resolve_current(True)
    with pytest.raises(TypeError):
        resolve_current("10")
    with pytest.raises(ValueError):
        resolve_current(-1)


async def test_cancelled_drain_puts_kept_groups_back_in_order():
    buffer = FullyAsyncBuffer(10)
    await fill(buffer, make_group(1, ["1"]), make_group(2, ["1"]))
    task = asyncio.create_task(buffer.drain(3, 1))
    await wait_until(lambda: has_waiters(buffer._changed), 5, "the drain to wait for a third group")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(buffer) == 2
    drain = await buffer.drain(2, 1)
    assert [g.prompt_index for g in drain.groups] == [1, 2]


async def test_failed_producer_fails_the_drain_even_with_groups_queued():
    buffer = FullyAsyncBuffer(10)
    await fill(buffer, make_group(1, ["1"]))
    waiting = asyncio.create_task(buffer.drain(2, 1))
    await wait_until(lambda: has_waiters(buffer._changed), 5, "the drain to wait for a second group")
    buffer.fail(RuntimeError("worker died"))
    with pytest.raises(RuntimeError, match="worker died"):
        await asyncio.wait_for(waiting, 1)
    with pytest.raises(RuntimeError, match="worker died"):
        await buffer.drain(1, 1)
    with pytest.raises(RuntimeError, match="worker died"):
        await buffer.put(make_group(2, ["1"]))


async def test_dynamic_filter_rejects_are_always_dropped():
    buffer = FullyAsyncBuffer(
        10,
        stage=StalenessStage(on_stale="recycle"),
        dynamic_filter=lambda g: "zero_std" if g.prompt_index == 1 else None,
    )
    assert not await buffer.put(make_group(1, ["1"]))
    await fill(buffer, make_group(2, ["1"]))
    drain = await buffer.drain(1, 1)
    assert buffer.take_recycled() == []
    assert drain.metrics["rollout/dynamic_filter/drop_zero_std"] == 1
    assert drain.stats.reasons == {"filtered": 1}


async def test_nested_group_recycles_the_flat_prompt_group():
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(on_stale="recycle"))
    prompt = [Sample(index=10), Sample(index=11)]
    nested = Group(
        prompt_index=1,
        samples=prompt,
        trajectories=[
            [
                Sample(index=12, weight_versions=["1"]),
                Sample(index=13, weight_versions=["1"], status=SampleStatus.ABORTED),
            ]
        ],
    )
    assert not await buffer.put(nested)
    [recycled] = buffer.take_recycled()
    assert recycled.samples is prompt and recycled.trajectories == []


async def test_samples_per_group_is_checked():
    buffer = FullyAsyncBuffer(10, samples_per_group=3)
    await fill(buffer, make_group(1, ["1"]))
    with pytest.raises(ValueError, match="expected 3"):
        await buffer.drain(1, 1)


def test_capacity():
    assert buffer_capacity(4) == 8 and buffer_capacity(3, 0.1) == 1
    with pytest.raises(ValueError):
        FullyAsyncBuffer(0)


async def test_drain_wakes_a_blocked_producer_before_waiting_for_more():
    buffer = FullyAsyncBuffer(1)
    await fill(buffer, make_group(1, ["1"]))
    producer = asyncio.create_task(buffer.put(make_group(2, ["1"])))
    await wait_until(lambda: has_waiters(buffer._changed), 5, "the put to wait for room")
    assert not producer.done()
    # the drain empties the buffer, then needs the blocked producer's group to finish
    drain = await asyncio.wait_for(buffer.drain(2, 1), 1)
    assert [g.prompt_index for g in drain.groups] == [1, 2]
    assert await producer


async def test_put_side_rejects_reach_prometheus_once_with_the_drain_not_per_put():
    registry = CollectorRegistry()
    metrics = StalenessMetrics(registry).for_policy("p")
    buffer = FullyAsyncBuffer(
        10, stage=StalenessStage(metrics=metrics), dynamic_filter=lambda g: "" if g.prompt_index == 8 else None
    )
    assert not await buffer.put(make_group(9, ["1"], status=SampleStatus.ABORTED))
    assert not await buffer.put(make_group(8, ["1"]))
    await fill(buffer, make_group(1, ["1"]))

    def groups(action, reason):
        return registry.get_sample_value("weightbus_groups_total", {"policy": "p", "action": action, "reason": reason})

    assert groups("dropped", "aborted") is None and groups("dropped", "filtered") is None
    assert registry.get_sample_value("weightbus_buffer_groups", {"policy": "p"}) == 1  # read at scrape time
    drain = await buffer.drain(1, 1)
    assert groups("dropped", "aborted") == 1 and groups("dropped", "filtered") == 1
    assert drain.stats.reasons == {"aborted": 1, "filtered": 1}
    assert "rollout/dynamic_filter/drop_" not in "".join(drain.metrics)  # a reason-less reject has no key


async def test_a_newer_label_anywhere_in_the_buffer_is_evidence_for_the_drain():
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=0))
    await fill(buffer, make_group(1, ["0"]), make_group(2, ["1"]))
    drain = await buffer.drain(1, 0)
    # version 1 exists (group 2 was generated with it): group 1 is a version behind, as judge_groups says
    assert [g.prompt_index for g in drain.groups] == [2]
    assert (drain.stats.current, drain.stats.reasons) == (1, {"stale": 1})


async def test_an_aborted_label_put_while_a_drain_waits_reaches_it():
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=1))
    pending = asyncio.create_task(buffer.drain(1, 10))
    await wait_until(lambda: has_waiters(buffer._changed), 5, "the drain to wait for a group")
    assert not await buffer.put(make_group(1, ["13"], status=SampleStatus.ABORTED))
    await fill(buffer, make_group(2, ["11"]), make_group(3, ["13"]))
    drain = await asyncio.wait_for(pending, 1)
    assert [g.prompt_index for g in drain.groups] == [3]
    assert drain.stats.reasons == {"aborted": 1, "stale": 1}


async def test_a_cancelled_drains_filter_counts_stay_in_the_next_window():
    buffer = FullyAsyncBuffer(10, stage=StalenessStage(max_staleness=1))
    await fill(buffer, make_group(1, ["5"]), make_group(2, ["10"]))
    task = asyncio.create_task(buffer.drain(2, 10))
    await wait_until(lambda: has_waiters(buffer._changed), 5, "the drain to wait for a second kept group")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(buffer) == 1  # the kept group is back; the stale one was routed
    await fill(buffer, make_group(3, ["10"]))
    drain = await buffer.drain(2, 10)
    assert [g.prompt_index for g in drain.groups] == [2, 3]
    assert drain.stats.reasons == {"stale": 1} and drain.stats.staleness_max == 5
    assert drain.stats.dropped == 1 and drain.stats.kept == 2
