"""Waste and bias you can see: the drain window's token, staleness-split and selection-bias accounts.

Asserted from the drain's own statistics, its wire report and the registry, never from logs.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from weightbus.bus import subjects
from weightbus.consumers import FullyAsyncBuffer, StalenessMetrics, StalenessStage, to_drain_report
from weightbus.consumers.drain.accounts import LENGTH_BUCKETS, REWARD_BUCKETS, length_bucket, reward_bucket
from weightbus.schemas import DrainReport, decode, encode
from weightbus.schemas.rollouts import Group, Sample, SampleStatus


def group(
    index: int,
    version: int,
    *,
    length: int = 4,
    reward: float | None = 1.0,
    n: int = 2,
    status: SampleStatus = SampleStatus.COMPLETED,
    started_at: float | None = None,
    generated_at: float | None = None,
    generated_version: int | None = None,
) -> Group:
    samples = [
        Sample(
            index=index * 10 + i,
            weight_versions=[str(version)],
            tokens=[0] * (3 + length),
            response_length=length,
            reward=reward,
            status=status,
        )
        for i in range(n)
    ]
    return Group(
        prompt_index=index,
        samples=samples,
        status=status,
        started_at=started_at,
        generated_at=generated_at,
        generated_version=generated_version,
    )


def buffer_with(registry: CollectorRegistry | None = None, **stage) -> FullyAsyncBuffer:
    metrics = StalenessMetrics(registry).for_policy("p") if registry is not None else None
    return FullyAsyncBuffer(16, stage=StalenessStage(metrics=metrics, **stage))


async def test_tokens_generated_trained_and_not_trained_by_reason():
    buffer = buffer_with(max_staleness=1, on_stale="recycle")
    assert await buffer.put(group(2, 7, length=3))  # stale at 10: 6 tokens not trained
    assert await buffer.put(group(1, 10, length=5))  # fresh: 10 tokens trained
    assert not await buffer.put(group(3, 10, length=2, status=SampleStatus.ABORTED))  # 4 tokens aborted
    drain = await buffer.drain(1, 10)
    s = drain.stats
    assert s.tokens_generated == 10 + 6 + 4
    assert s.tokens_trained == 10
    assert s.tokens_not_trained == {"stale": 6, "aborted": 4}
    assert s.tokens_generated == s.tokens_trained + s.tokens_not_trained_total
    # Counted before the recycle reset, which empties the responses.
    assert all(g.samples[0].response_length == 0 for g in buffer.take_recycled())
    assert drain.metrics["weightbus/tokens_not_trained"] == 10
    assert drain.metrics["weightbus/tokens_not_trained/stale"] == 6


async def test_dynamic_filter_tokens_in_the_drain_window():
    rejects = iter(["zero_std", None])
    buffer = FullyAsyncBuffer(8, dynamic_filter=lambda g: next(rejects))
    assert not await buffer.put(group(1, 3, length=7))
    assert await buffer.put(group(2, 3, length=1))
    stats = (await buffer.drain(1, 3)).stats
    assert stats.tokens_not_trained == {"filtered": 14}
    assert stats.by_length["dropped"] == {"0-16": 1}


async def test_staleness_splits_into_in_flight_and_in_queue_that_add_up():
    buffer = buffer_with(max_staleness=None)
    # Generation began before v4's oldest token and ended when the tracker held v6; judged at v9.
    assert await buffer.put(group(1, 4, started_at=100.0, generated_at=103.0, generated_version=6))
    # A tracker behind the engine (generated_version older than the label) is no negative time in flight.
    assert await buffer.put(group(2, 8, started_at=100.0, generated_at=104.0, generated_version=7))
    stats = (await buffer.drain(2, 9)).stats
    assert stats.in_flight_versions_avg == pytest.approx((2 + 0) / 2)
    assert stats.in_queue_versions_avg == pytest.approx((3 + 1) / 2)
    assert stats.in_flight_versions_avg + stats.in_queue_versions_avg == pytest.approx(stats.staleness_avg)
    assert stats.in_flight_s_avg == pytest.approx(3.5)
    assert stats.in_queue_s_avg is not None and stats.in_queue_s_avg > 1_000_000  # measured against now


async def test_no_stamps_no_split():
    buffer = buffer_with(max_staleness=None)
    assert await buffer.put(group(1, 4))
    stats = (await buffer.drain(1, 9)).stats
    assert stats.in_flight_versions_avg is None and stats.in_queue_versions_avg is None
    assert stats.in_flight_s_avg is None and stats.in_queue_s_avg is None
    assert "weightbus/staleness/in_flight_versions" not in stats.metrics


async def test_selection_bias_by_length_and_reward_bucket():
    buffer = buffer_with(max_staleness=0, on_stale="drop")
    assert await buffer.put(group(2, 4, length=900, reward=0.0))  # long, unsolved, stale
    assert await buffer.put(group(3, 4, length=900, reward=None))  # long, unrewarded, stale
    assert await buffer.put(group(1, 5, length=10, reward=1.0))  # short, solved, fresh
    assert not await buffer.put(group(4, 5, length=200, reward=0.5, status=SampleStatus.ABORTED))
    stats = (await buffer.drain(1, 5)).stats
    assert stats.by_length == {"kept": {"0-16": 1}, "dropped": {"257-1024": 2}, "aborted": {"65-256": 1}}
    assert stats.by_reward == {"kept": {"0.75-1": 1}, "dropped": {"<=0": 1, "none": 1}, "aborted": {"0.25-0.5": 1}}


async def test_prometheus_families_by_name():
    registry = CollectorRegistry()
    buffer = buffer_with(registry, max_staleness=0, on_stale="recycle")
    assert await buffer.put(group(2, 3, length=600, reward=0.0, generated_at=2.0, generated_version=4))
    assert await buffer.put(group(1, 5, length=10, started_at=1.0, generated_at=2.0, generated_version=5))
    buffer.window.early_abort(group(3, 5, length=6), tokens_saved=120)
    await buffer.drain(1, 5)
    value = registry.get_sample_value
    assert value("weightbus_tokens_generated_total", {"policy": "p"}) == 20 + 1200 + 12
    assert value("weightbus_tokens_trained_total", {"policy": "p"}) == 20
    labels = {"policy": "p", "action": "recycled"}
    assert value("weightbus_tokens_not_trained_total", {**labels, "reason": "stale"}) == 1200
    assert value("weightbus_tokens_not_trained_total", {**labels, "reason": "aborted"}) == 12
    assert value("weightbus_early_aborts_total", {"policy": "p"}) == 1
    assert value("weightbus_tokens_saved_total", {"policy": "p"}) == 120
    flight = {"policy": "p", "phase": "in_flight"}
    queue = {"policy": "p", "phase": "in_queue"}
    assert value("weightbus_group_wait_versions_count", flight) == 2
    assert value("weightbus_group_wait_versions_sum", flight) == 0 + 1
    assert value("weightbus_group_wait_versions_sum", queue) == 0 + 1
    assert value("weightbus_group_wait_seconds_count", flight) == 1  # only the group with started_at
    assert value("weightbus_group_wait_seconds_count", queue) == 2
    bias = {"policy": "p", "outcome": "recycled"}
    assert value("weightbus_groups_by_length_total", {**bias, "length": "257-1024"}) == 1
    assert value("weightbus_groups_by_reward_total", {**bias, "reward": "<=0"}) == 1
    assert value("weightbus_groups_by_length_total", {"policy": "p", "outcome": "aborted", "length": "0-16"}) == 1
    assert value("weightbus_groups_by_length_total", {"policy": "p", "outcome": "kept", "length": "0-16"}) == 1


async def test_the_report_carries_the_accounts_and_an_old_report_still_decodes():
    buffer = buffer_with(max_staleness=0)
    assert await buffer.put(group(1, 5, generated_at=1.0, generated_version=5))
    stats = (await buffer.drain(1, 5)).stats
    report = to_drain_report(stats, policy="p", consumer="c", seq=1, published_at=1.0)
    assert report.tokens_generated == report.tokens_trained == 8
    assert report.by_length == {"kept": {"0-16": 1}}
    assert decode(subjects.drains("p"), encode(report)) == report
    old = b'{"type":"drain.report","policy":"p","consumer":"c","seq":1,"current":3,"kept":1,"recycled":0,'
    old += b'"dropped":0,"published_at":1.0}'
    decoded = decode(subjects.drains("p"), old)
    assert isinstance(decoded, DrainReport)
    assert (decoded.tokens_generated, decoded.tokens_not_trained, decoded.in_queue_s_avg) == (0, {}, None)


def test_buckets_are_few_and_named():
    assert length_bucket(0) == length_bucket(16) == "0-16"
    assert length_bucket(17) == "17-64"
    assert length_bucket(10**6) == "4097+"
    assert reward_bucket(None) == "none"
    assert reward_bucket(-3.0) == reward_bucket(0.0) == "<=0"
    assert reward_bucket(1.0) == "0.75-1" and reward_bucket(1.5) == ">1"
    assert len(LENGTH_BUCKETS) + len(REWARD_BUCKETS) < 16


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 50), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.integers(0, 2),
    st.sampled_from(["recycle", "drop"]),
)
def test_every_generated_token_is_trained_not_trained_or_still_buffered(specs, bound, on_stale):
    import asyncio

    async def run() -> None:
        buffer = buffer_with(max_staleness=bound, on_stale=on_stale)
        generated = trained = not_trained = 0
        for i, (version, length, aborted) in enumerate(specs):
            status = SampleStatus.ABORTED if aborted else SampleStatus.COMPLETED
            await buffer.put(group(i, version, length=length, status=status))
        fresh = sum(1 for v, _, a in specs if not a and 6 - v <= bound)
        stats = (await buffer.drain(fresh, 6)).stats if fresh else buffer.window.finish(list(buffer._items))
        generated += stats.tokens_generated
        trained += stats.tokens_trained
        not_trained += stats.tokens_not_trained_total
        buffered = sum(s.response_length for g in buffer._items for s in g.samples)
        assert generated == trained + not_trained + buffered

    asyncio.run(run())


_labels = st.sampled_from(["3", "4", "5", "6", "default"])


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(_labels, min_size=1, max_size=2),
            st.integers(0, 3000),
            st.one_of(st.none(), st.floats(-1, 2)),
            st.booleans(),
        ),
        min_size=1,
        max_size=10,
    ),
    st.integers(0, 2),
    st.sampled_from(["stale", "ignore"]),
)
def test_the_inlined_paths_account_as_the_plain_sum(specs, bound, unknown):
    """Batch judging (DrainTally.add_many), the buffer's per-group take (DrainTally.add) and a plain
    sum over the rule's verdicts give the same token and bias accounts."""
    import asyncio

    from weightbus.consumers.drain.accounts import length_bucket, reward_bucket
    from weightbus.rules.staleness import Reason, group_versions, judge

    def build() -> list[Group]:
        out = []
        for i, (labels, length, reward, aborted) in enumerate(specs):
            status = SampleStatus.ABORTED if aborted and i % 3 == 0 else SampleStatus.COMPLETED
            g = group(i, 0, length=length, reward=reward, status=status)
            for s in g.samples:
                s.weight_versions = list(labels)
            out.append(g)
        return out

    expected_trained = 0
    expected_not: dict[str, int] = {}
    expected_length: dict[str, dict[str, int]] = {}
    for g in build():
        tokens = sum(s.response_length for s in g.samples)
        if g.is_aborted:
            reason = Reason.ABORTED
        else:
            reason = judge(group_versions(g), 6, max_staleness=bound, unknown=unknown).reason
        outcome = (
            "kept"
            if reason in (Reason.FRESH, Reason.UNMEASURED)
            else "aborted"
            if reason is Reason.ABORTED
            else "dropped"
        )
        if outcome == "kept":
            expected_trained += tokens
        else:
            expected_not[reason.value] = expected_not.get(reason.value, 0) + tokens
        bucket = length_bucket(tokens / len(g.samples))
        expected_length.setdefault(outcome, {})
        expected_length[outcome][bucket] = expected_length[outcome].get(bucket, 0) + 1
        assert reward_bucket(None) == "none"

    batch = StalenessStage(max_staleness=bound, unknown=unknown).judge(build(), 6).stats
    assert (batch.tokens_trained, batch.tokens_not_trained, batch.by_length) == (
        expected_trained,
        expected_not,
        expected_length,
    )

    async def per_group():
        buffer = FullyAsyncBuffer(64, stage=StalenessStage(max_staleness=bound, unknown=unknown))
        groups = build()
        admitted = [g for g in groups if await buffer.put(g)]
        kept = sum(1 for g in admitted if judge(group_versions(g), 6, max_staleness=bound, unknown=unknown).keep)
        # Take everything: the kept ones as the drain's n, after every group was judged.
        if kept:
            return (await buffer.drain(kept, 6)).stats, len(buffer)
        return buffer.window.finish(list(buffer._items)), len(buffer)

    stats, left = asyncio.run(per_group())
    if left == 0:
        assert (stats.tokens_trained, stats.tokens_not_trained, stats.by_length) == (
            batch.tokens_trained,
            batch.tokens_not_trained,
            batch.by_length,
        )
        assert stats.by_reward == batch.by_reward
