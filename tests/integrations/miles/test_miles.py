"""``weightbus.integrations.miles.WeightbusDataBuffer`` with stand-ins that carry miles' field names.

The stand-ins mirror ``miles.utils.types.Sample`` (``index``, ``weight_versions``, ``status`` with a
``Status`` enum) and ``miles.rollout.fully_async_data_buffer`` (``DataBufferConstructorInput(args,
unused_handler_fn)``, ``DataBufferInput(prompt_group, group)``); miles itself is not installed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from argparse import Namespace
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

import pytest

from tests._builders import updated
from weightbus.bus import MemoryBus, connect, subjects
from weightbus.bus.protocol import Bus
from weightbus.integrations.miles import WeightbusDataBuffer
from weightbus.schemas import DrainReport


class _Status(Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class MilesSample:
    index: int | None
    weight_versions: list[str] = field(default_factory=list)
    status: _Status = _Status.COMPLETED
    Status = _Status


@dataclass(frozen=True)
class DataBufferConstructorInput:
    args: Namespace
    unused_handler_fn: Any


@dataclass
class DataBufferInput:
    prompt_group: list[MilesSample]
    group: list[Any]


def args(policy: str, **kw: Any) -> Namespace:
    base = dict(
        rollout_batch_size=2,
        async_data_buffer_capacity_factor=2.0,
        max_weight_staleness=1,
        async_unused_samples_handler="retry",
        dynamic_sampling_filter_path=None,
        weightbus_policy=policy,
    )
    return Namespace(**{**base, **kw})


def entry(index: int, *labels: str, status: _Status = _Status.COMPLETED) -> DataBufferInput:
    samples = [MilesSample(index + i, [label], status) for i, label in enumerate(labels)]
    return DataBufferInput(prompt_group=[MilesSample(index)], group=samples)


async def announce(bus: Bus, policy: str, version: int) -> None:
    event = updated(version, policy=policy, trainer="trainer")
    await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:1:{version}")


async def test_the_bus_version_judges_every_sample_and_turn_and_unused_groups_go_to_miles(policy: str) -> None:
    bus = MemoryBus()
    await announce(bus, policy, 5)
    unused: list[list[MilesSample]] = []
    buf = WeightbusDataBuffer(DataBufferConstructorInput(args(policy), unused.append), bus=bus)
    fresh, stale, unknown = entry(0, "5", "4"), entry(10, "5", "3"), entry(20, "5", "default")
    nested = DataBufferInput([MilesSample(30)], [[MilesSample(30, ["5", "5"])], [MilesSample(31, ["5", "3"])]])
    aborted = entry(40, "5", "5", status=_Status.ABORTED)
    for e in (stale, unknown, nested, aborted, fresh):
        await buf.put(e)
    assert unused == [aborted.prompt_group]  # aborted groups never enter
    # miles says v2; the bus says v5 and wins: only the fresh group is trained on.
    assert await buf.get(current_version=2) is fresh
    assert unused == [aborted.prompt_group, stale.prompt_group, unknown.prompt_group, nested.prompt_group]
    metrics = buf.get_metrics()
    assert metrics["rollout/fully_async/queue_size"] == 0
    assert metrics["rollout/fully_async/aborted_groups_filtered"] == 1
    assert metrics["rollout/fully_async/stale_groups_filtered"] == 2
    assert metrics["rollout/fully_async/max_staleness"] == 2 and metrics["weightbus/unknown_version"] == 1
    assert metrics["weightbus/current_version"] == 5 and metrics["weightbus/kept"] == 1
    assert metrics["weightbus/recycled"] == 4  # --async-unused-samples-handler retry
    await buf.aclose()
    report = await bus.last(subjects.drains(policy))
    assert report is not None and isinstance(report.event, DrainReport)
    assert (report.event.current, report.event.kept, report.event.recycled) == (5, 1, 4)
    assert report.event.reasons == {"aborted": 1, "stale": 2, "unknown_version": 1}
    assert buf.get_metrics()["rollout/fully_async/stale_groups_filtered"] == 0  # the window was reset


async def test_miles_version_is_only_a_lower_bound(policy: str) -> None:
    bus = MemoryBus()
    await announce(bus, policy, 3)
    unused: list[Any] = []
    buf = WeightbusDataBuffer(DataBufferConstructorInput(args(policy), unused.append), bus=bus)
    old, ok = entry(0, "4"), entry(1, "5")
    await buf.put(old)
    await buf.put(ok)
    assert await buf.get(current_version=6) is ok  # 6 - 4 = 2 > 1, whatever the tracker lags at
    assert unused == [old.prompt_group]
    for version in range(4, 10):  # an owner moves one version at a time (or through reservations)
        await announce(bus, policy, version)
    await buf.tracker.wait_for(9, timeout=5)
    await buf.put(late := entry(2, "7"))
    await buf.put(fresh := entry(3, "8"))
    assert await buf.get(current_version=6) is fresh and unused[-1] == late.prompt_group
    await buf.aclose()


async def test_a_full_buffer_blocks_put_and_the_dynamic_filter_drops(policy: str) -> None:
    bus = MemoryBus()
    await announce(bus, policy, 1)
    unused: list[Any] = []
    drop_all_correct = lambda a, group: SimpleNamespace(keep=group[0].index != 99, reason="all_correct")  # noqa: E731
    config = args(policy, rollout_batch_size=1, async_data_buffer_capacity_factor=2.0)
    buf = WeightbusDataBuffer(
        DataBufferConstructorInput(config, unused.append), bus=bus, dynamic_filter=drop_all_correct
    )
    await buf.put(entry(99, "1"))  # filtered: dropped, not handed to the handler
    assert unused == [] and buf.get_metrics()["rollout/dynamic_filter/drop_all_correct"] == 1
    first, second, third = entry(0, "1"), entry(1, "1"), entry(2, "1")
    await buf.put(first)
    await buf.put(second)
    blocked = asyncio.create_task(buf.put(third))
    done, _ = await asyncio.wait({blocked}, timeout=0.05)
    assert not done  # capacity floor(2.0 * 1) = 2
    assert await buf.get() is first
    await asyncio.wait_for(blocked, 5)
    assert [await buf.get(), await buf.get()] == [second, third]
    await buf.aclose()


def test_bad_configuration_is_refused(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTBUS_POLICY", raising=False)
    with pytest.raises(ValueError, match="WEIGHTBUS_POLICY"):
        WeightbusDataBuffer(DataBufferConstructorInput(args(policy, weightbus_policy=None), print))
    monkeypatch.setenv("WEIGHTBUS_UNKNOWN", "maybe")
    with pytest.raises(ValueError, match="WEIGHTBUS_UNKNOWN"):
        WeightbusDataBuffer(DataBufferConstructorInput(args(policy), print))


def test_it_imports_without_miles() -> None:
    code = "import sys; sys.modules['miles'] = None; import weightbus.integrations.miles as m; print(m.__name__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "weightbus.integrations.miles", run.stderr


@pytest.mark.nats
async def test_it_connects_from_the_environment_and_reports_drains(
    nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    trainer = await connect(nats_url)
    try:
        await announce(trainer, policy, 4)
        buf = WeightbusDataBuffer(DataBufferConstructorInput(args(policy, weightbus_policy=None), print))
        await buf.put(kept := entry(0, "4", "3"))
        assert await buf.get(current_version=None) is kept
        assert buf.get_metrics()["rollout/fully_async/avg_staleness"] == 1
        await buf.aclose()
        report = await trainer.last(subjects.drains(policy))
        assert report is not None and report.event.kept == 1 and report.event.current == 4
    finally:
        await trainer.aclose()


def test_a_miles_sample_brings_its_response_length_and_numeric_reward() -> None:
    from weightbus.integrations.miles import to_weightbus_group

    samples = [
        SimpleNamespace(index=1, weight_versions=["3"], status="completed", response_length=40, reward=0.5),
        SimpleNamespace(index=2, weight_versions=["3"], status="completed", response_length=7, reward={"acc": 1.0}),
        SimpleNamespace(index=3, weight_versions=["3"], status="completed"),
    ]
    group = to_weightbus_group(samples)
    assert [(s.response_length, s.reward) for s in group.samples] == [(40, 0.5), (7, None), (0, None)]
