"""Differential: miles' buffer, ``judge_groups`` and ``FullyAsyncBuffer`` keep exactly the same groups.

Random groups (numeric and non-version labels, several turns, nested trajectories, aborted groups),
a random current version (None: never published), bound and unknown-label policy. Every host goes
through the one drain engine; this pins that no host has a rule of its own. The miles buffer is fed
through miles' objects (``miles_standin``) and follows a tracker on an in-memory bus.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tests._builders import updated
from tests.integrations.miles.miles_standin import DataBufferConstructorInput, DataBufferInput, Sample
from weightbus.bus import MemoryBus, subjects
from weightbus.consumers import FullyAsyncBuffer, StalenessStage, judge_groups
from weightbus.integrations.miles import WeightbusDataBuffer
from weightbus.schemas.rollouts import Group, SampleStatus
from weightbus.schemas.rollouts import Sample as WbSample

labels = st.one_of(st.integers(0, 20).map(str), st.sampled_from(["default", "-1"]))
turns = st.lists(labels, max_size=3)
group_specs = st.tuples(
    st.lists(turns, min_size=1, max_size=3),  # flat samples (or, nested, one trajectory each)
    st.booleans(),  # nested (multi-agent)
    st.booleans(),  # aborted (one sample)
)


def miles_group(i: int, spec) -> list:
    samples, nested, aborted = spec
    built = [
        Sample(
            index=i * 10 + k,
            weight_versions=list(v),
            status=Sample.Status.ABORTED if aborted and k == 0 else Sample.Status.COMPLETED,
        )
        for k, v in enumerate(samples)
    ]
    return [[s] for s in built] if nested else built


def weightbus_group(i: int, spec) -> Group:
    samples, nested, aborted = spec
    built = [
        WbSample(
            index=i * 10 + k,
            weight_versions=list(v),
            status=SampleStatus.ABORTED if aborted and k == 0 else SampleStatus.COMPLETED,
        )
        for k, v in enumerate(samples)
    ]
    if nested:
        return Group(prompt_index=i, trajectories=[[s] for s in built])
    return Group(prompt_index=i, samples=built)


async def miles_keeps(specs, current, max_staleness, unknown) -> tuple[list[int], list[int], list[int]]:
    """(kept, handed to the unused handler, left buffered) by group id, through miles' calls."""
    bus = MemoryBus()
    policy = "diff"
    if current is not None:
        event = updated(current, policy=policy)
        await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:{current}")
    unused: list[list] = []
    args = Namespace(
        rollout_batch_size=16,
        max_weight_staleness=max_staleness,
        async_unused_samples_handler="drop",
        weightbus_policy=policy,
        weightbus_unknown=unknown,
    )
    buf = WeightbusDataBuffer(DataBufferConstructorInput(args, unused.append), bus=bus, ready_timeout=5)
    entries = [DataBufferInput(prompt_group=[Sample(index=i)], group=miles_group(i, s)) for i, s in enumerate(specs)]
    for entry in entries:
        await buf.put(entry)
    expected = judge(specs, current, max_staleness, unknown)
    kept = [entries.index(await buf.get(current_version=None)) for _ in expected]
    handed = [next(i for i, e in enumerate(entries) if e.prompt_group is pg) for pg in unused]
    left = [entries.index(e) for e in buf.buffered()]
    buf.get_metrics()
    await buf.aclose()
    return kept, handed, left


async def buffer_keeps(specs, current, max_staleness, unknown) -> tuple[list[int], list[int]]:
    stage = StalenessStage(max_staleness=max_staleness, unknown=unknown)
    buffer = FullyAsyncBuffer(64, stage=stage)
    for i, spec in enumerate(specs):
        await buffer.put(weightbus_group(i, spec))
    n = len(judge(specs, current, max_staleness, unknown))
    kept = [g.prompt_index for g in (await buffer.drain(n, current)).groups] if n else []
    return kept, [g.prompt_index for g in buffer._items]


def judge(specs, current, max_staleness, unknown) -> list[int]:
    groups = [weightbus_group(i, s) for i, s in enumerate(specs)]
    return [g.prompt_index for g in judge_groups(groups, current, max_staleness=max_staleness, unknown=unknown).kept]


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(group_specs, max_size=12),
    current=st.one_of(st.none(), st.integers(0, 20)),
    max_staleness=st.one_of(st.none(), st.integers(0, 4)),
    unknown=st.sampled_from(["stale", "ignore"]),
)
def test_every_host_keeps_the_same_groups(specs, current, max_staleness, unknown) -> None:
    expected = judge(specs, current, max_staleness, unknown)
    kept, handed, left = asyncio.run(miles_keeps(specs, current, max_staleness, unknown))
    assert kept == expected  # miles takes in FIFO order: the same groups, in the same order
    assert sorted(kept + handed + left) == list(range(len(specs)))  # nothing lost, nothing twice
    assert not set(left) & set(expected)
    buffer_kept, buffer_left = asyncio.run(buffer_keeps(specs, current, max_staleness, unknown))
    assert buffer_kept == sorted(expected)  # a drain is sorted by first sample index
    assert set(buffer_left) == set(left)  # both stop at the last kept group
