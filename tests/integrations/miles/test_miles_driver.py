"""``WeightbusDataBuffer`` driven by miles' own call order (``miles_standin.FullyAsyncRolloutFn``) on a real
nats-server: what a miles user gets with ``--custom-async-data-buffer-path``.

Each test pins one defect of the buffer's former private drain window (weightbus #15 item 4): a group
lost when the tracker is not ready, a stale group admitted because a newer label seen earlier in the
drain was forgotten, ``version_state`` always ``given``, and a ``drop_filtered`` key miles never emits.
Invariants are asserted from what miles received (the batch, the unused handler, the data source),
what the buffer still holds, and the ``DrainReport`` stored on the bus.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated
from tests.integrations.miles.miles_standin import (
    DynamicFilterOutput,
    FullyAsyncRolloutFn,
    RolloutFnTrainInput,
    Sample,
    ScriptedDataSource,
    install_miles_helpers,
    make_args,
    make_group,
)
from weightbus.bus import NatsBus, subjects
from weightbus.bus.history import read_subject_history
from weightbus.consumers.drain.metrics import StalenessMetrics
from weightbus.errors import TrackerNotReadyError
from weightbus.producers import VersionPublisher
from weightbus.schemas import DrainReport

pytestmark = pytest.mark.nats


@pytest.fixture
def miles_env(nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """What a miles user sets: the bus and the policy in the environment, a short ready timeout."""
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_READY_TIMEOUT", "0.5")
    return policy


async def announce(bus: NatsBus, policy: str, version: int) -> None:
    event = updated(version, policy=policy, trainer="trainer")
    await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:1:{version}")


async def reports(bus: NatsBus, policy: str) -> list[DrainReport]:
    history = await read_subject_history(bus, subjects.drains(policy))
    return [env.event for env in history.events if isinstance(env.event, DrainReport)]


def labels(groups: list[list[Any]]) -> list[list[str]]:
    return [g[0].weight_versions for g in groups]


def fresh_at(version: int):
    return lambda i: make_group(i, [str(version)])


async def test_a_tracker_that_is_not_ready_is_waited_for_then_miles_version_judges(
    nats_bus: NatsBus, miles_env: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Only an invalid event stored: the tracker never becomes ready (as deaf or starting would).
    await nats_bus.publish_raw(subjects.weights(miles_env), b"not an event", msg_id=f"{miles_env}:junk")
    stale = make_group(1, ["5"])
    source = ScriptedDataSource([stale], fresh=fresh_at(10))
    fn = FullyAsyncRolloutFn(make_args(max_weight_staleness=1), source, max_in_flight=1)
    try:
        with caplog.at_level(logging.WARNING, logger="weightbus.integrations.miles"):
            out = await fn(RolloutFnTrainInput(rollout_id=0, weight_version=10))
        assert labels(out.samples) == [["10"], ["10"]]
        assert fn.dropped == [stale]  # judged against miles' 10, handed to miles' handler
        assert out.metrics["rollout/fully_async/stale_groups_filtered"] == 1
        assert out.metrics["weightbus/current_version"] == 10
        assert "judging against the highest version miles passed, 10" in caplog.text
    finally:
        await fn.aclose()
    [report] = await reports(nats_bus, miles_env)
    assert (report.current, report.version_state, report.kept, report.reasons) == (10, "given", 2, {"stale": 1})


async def test_a_tracker_that_is_not_ready_and_no_miles_version_raise_with_every_group_buffered(
    nats_bus: NatsBus, miles_env: str
) -> None:
    await nats_bus.publish_raw(subjects.weights(miles_env), b"not an event", msg_id=f"{miles_env}:junk")
    scripted = [make_group(i, ["3"]) for i in range(3)]
    source = ScriptedDataSource(list(scripted))  # nothing after the script
    fn = FullyAsyncRolloutFn(make_args(max_weight_staleness=1), source, max_in_flight=1)
    try:
        with pytest.raises(TrackerNotReadyError) as raised:
            await fn(RolloutFnTrainInput(rollout_id=0, weight_version=None))  # before miles' first push
        assert [entry.group for entry in fn.buffer.buffered()] == scripted  # none lost, in order
        assert fn.dropped == [] and source.recycled == []
        assert "every group is still buffered" in str(raised.value)
        # The bus comes back: the same groups are judged, none was lost meanwhile.
        await announce(nats_bus, miles_env, 3)
        await fn.buffer.tracker.wait_ready(10)
        out = await fn(RolloutFnTrainInput(rollout_id=0, weight_version=None))
        assert out.samples == scripted[:2] and out.metrics["rollout/fully_async/queue_size"] == 1
    finally:
        await fn.aclose()


@pytest.mark.parametrize("earlier", ["kept", "aborted at put"])
async def test_a_newer_label_seen_earlier_in_the_drain_makes_a_later_group_stale(
    nats_bus: NatsBus, miles_env: str, earlier: str
) -> None:
    await announce(nats_bus, miles_env, 10)  # the tracker lags: engines already serve 13
    status = Sample.Status.ABORTED if earlier == "aborted at put" else Sample.Status.COMPLETED
    newer, late = make_group(1, ["13"], status=status), make_group(2, ["11"])
    source = ScriptedDataSource([newer, late], fresh=fresh_at(13))
    fn = FullyAsyncRolloutFn(make_args(max_weight_staleness=1), source, max_in_flight=1)
    try:
        out = await fn(RolloutFnTrainInput(rollout_id=0, weight_version=10))
    finally:
        await fn.aclose()
    assert late not in out.samples and labels(out.samples) == [["13"], ["13"]]
    assert late in fn.dropped  # 13 - 11 = 2 > 1: stale
    assert out.metrics["rollout/fully_async/stale_groups_filtered"] == 1
    assert out.metrics["weightbus/current_version"] == 13


async def test_the_report_says_the_tracker_supplied_the_version(nats_bus: NatsBus, miles_env: str) -> None:
    await announce(nats_bus, miles_env, 4)
    fn = FullyAsyncRolloutFn(make_args(), ScriptedDataSource([], fresh=fresh_at(4)), max_in_flight=1)
    try:
        out = await fn(RolloutFnTrainInput(rollout_id=0, weight_version=None))
    finally:
        await fn.aclose()
    assert out.metrics["weightbus/current_version"] == 4
    [report] = await reports(nats_bus, miles_env)
    assert (report.current, report.version_state) == (4, "current")


async def test_the_report_says_the_policy_never_published(nats_bus: NatsBus, miles_env: str) -> None:
    await VersionPublisher(nats_bus, miles_env, trainer_id="t").start()  # claimed, never announced
    fn = FullyAsyncRolloutFn(
        make_args(max_weight_staleness=0), ScriptedDataSource([], fresh=fresh_at(7)), max_in_flight=1
    )
    try:
        out = await fn(RolloutFnTrainInput(rollout_id=0, weight_version=None))
    finally:
        await fn.aclose()
    assert len(out.samples) == 2 and "rollout/fully_async/max_staleness" not in out.metrics  # filter off
    [report] = await reports(nats_bus, miles_env)
    assert (report.current, report.version_state) == (None, "never_published")


def reject_odd_groups(args: Any, group: list[Sample]) -> DynamicFilterOutput:
    """A user's dynamic filter: odd groups are rejected, group 3 with a reason, the others without."""
    index = group[0].index // 10
    if index % 2 == 0:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason="zero_std" if index == 3 else None)


async def test_a_reason_less_dynamic_filter_drop_emits_no_drop_key(nats_bus: NatsBus, miles_env: str) -> None:
    await announce(nats_bus, miles_env, 1)
    scripted = [make_group(i, ["1"]) for i in range(1, 5)]  # 1 and 3 rejected; 3 with a reason
    path = f"{__name__}.reject_odd_groups"
    with install_miles_helpers():
        fn = FullyAsyncRolloutFn(
            make_args(dynamic_sampling_filter_path=path, async_unused_samples_handler="retry"),
            ScriptedDataSource(scripted),
            max_in_flight=1,
        )
        try:
            out = await fn(RolloutFnTrainInput(rollout_id=0, weight_version=1))
        finally:
            await fn.aclose()
    assert out.samples == [scripted[1], scripted[3]]
    drops = {k: v for k, v in out.metrics.items() if k.startswith("rollout/dynamic_filter/")}
    assert drops == {"rollout/dynamic_filter/drop_zero_std": 1}  # miles skips reason-less drops
    assert fn.data_source.recycled == []  # dynamic-filter rejects are always dropped, even under retry
    [report] = await reports(nats_bus, miles_env)
    assert report.reasons == {"filtered": 2} and report.dropped == 2


async def test_the_buffer_alone_survives_miles_failover_regression(
    nats_bus: NatsBus, miles_env: str, caplog: pytest.LogCaptureFixture
) -> None:
    """weightbus #24 item 7: nothing on the bus; miles passes 1..57, then its failover restarts at 1.

    Today the buffer judges every new group against 57 (the highest miles ever passed) and no drain
    completes. Wanted: the drain completes, judged against miles' current version and flagged ``regressed``;
    no group is trained fresher than the weights that produced it.
    """
    with install_miles_helpers():
        fn = FullyAsyncRolloutFn(
            make_args(max_weight_staleness=2), ScriptedDataSource([], fresh=lambda i: make_group(i, []))
        )
        fn.generate_and_rm_group = fn.engine_generate
        registry = CollectorRegistry()
        fn.buffer.stage.metrics = StalenessMetrics(registry).for_policy(miles_env)  # what a caller's metrics= sets
        trained: list[tuple[int, list[str]]] = []
        try:
            for rollout_id, version in enumerate([*range(1, 58), 1, 2, 3, 4]):  # 57 -> 1: miles' failover
                fn.set_weight_version(version)
                out = await asyncio.wait_for(
                    fn.train(rollout_id), timeout=20
                )  # generous: a drain here takes milliseconds
                trained.extend((version, g[0].weight_versions) for g in out.samples)
        finally:
            await fn.aclose()
    # No group is trained against a version below the one it was stamped with: after 57 -> 1, the
    # old numbering's 56 and 57 are above miles' current version, so they are stale, not fresh.
    for current, group_labels in trained:
        assert all(int(label) <= current for label in group_labels), (current, group_labels)
    assert len(trained) == 61 * 2  # every drain completed, the four after the failover too
    drained = await reports(nats_bus, miles_env)
    states = [r.version_state for r in drained]
    assert "regressed" not in states[:57] and states[57:] == ["regressed"] * 4, states
    assert out.metrics["weightbus/version_regressions"] == 1  # counted once, alerted once
    assert registry.get_sample_value("weightbus_host_version_regressions_total", {"policy": miles_env}) == 1
    assert sum("went backwards" in r.getMessage() for r in caplog.records) == 1
