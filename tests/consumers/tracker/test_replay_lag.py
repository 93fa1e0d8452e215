"""A trace replayed into a running tracker's stream feeds no propagation lag (its ``published_at`` is the recorded
one), while the tracker follows it by the chain rules; live updates afterwards are observed again; the replay header
bypasses no integrity rule; ``watch``'s exporter skips it too. On both buses, and with ``weightbus replay`` against a
real nats-server.
"""

from __future__ import annotations

import asyncio
import io
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated, wait_until
from weightbus.bus import Deliver, MemoryBus, NatsBus, subjects
from weightbus.bus.protocol import Bus
from weightbus.bus.trace import REPLAYED_HEADER, TraceRecord, read_trace, record, replay
from weightbus.cli.watch import watch
from weightbus.consumers.tracker.metrics import TrackerMetrics
from weightbus.consumers.tracker.tracker import VersionChange, VersionTracker
from weightbus.schemas import WeightUpdated, decode, encode

TIMEOUT = 10.0
HOUR_AGO = time.time() - 3600


def _sample(registry: CollectorRegistry, name: str, policy: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"policy": policy, **labels})


def _old_trace(policy: str, versions: range, *, trainer: str = "trainer-a") -> list[TraceRecord]:
    """Updates published an hour ago, as ``weightbus record`` writes them."""
    return [
        TraceRecord(
            subject=subjects.weights(policy),
            received_at=HOUR_AGO + v,
            event=msgspec.Raw(encode(updated(v, policy=policy, trainer=trainer, at=HOUR_AGO + v))),
            headers={"Nats-Msg-Id": f"{policy}:1:{v}:{uuid.uuid4().hex}"},
            seq=v,
        )
        for v in versions
    ]


async def test_a_replayed_trace_feeds_no_lag_but_moves_the_version(
    bus: Bus, policy: str, registry: CollectorRegistry
) -> None:
    seen: list[VersionChange] = []
    async with VersionTracker(bus, policy, registry=registry, on_change=seen.append) as tracker:
        assert await tracker.wait_ready(TIMEOUT) is None  # nothing stored: everything below arrives live
        acks = await replay(_old_trace(policy, range(1, 6)), bus)
        assert len(acks) == 5
        assert await tracker.wait_for(5, TIMEOUT) == 5
        assert [c.version for c in seen] == [1, 2, 3, 4, 5]
        assert all(c.lag is None and not c.replayed for c in seen)
        assert _sample(registry, "weightbus_propagation_lag_seconds_count", policy) == 0
        assert _sample(registry, "weightbus_events_replayed_total", policy) == 5
        # A live update afterwards is a propagation delay again.
        await bus.publish(
            subjects.weights(policy), updated(6, policy=policy, trainer="trainer-a"), msg_id=f"{policy}:6"
        )
        assert await tracker.wait_for(6, TIMEOUT) == 6
        assert seen[-1].lag is not None
    assert _sample(registry, "weightbus_propagation_lag_seconds_count", policy) == 1
    assert (_sample(registry, "weightbus_propagation_lag_seconds_sum", policy) or 0.0) < 5.0
    assert _sample(registry, "weightbus_events_replayed_total", policy) == 5


async def test_the_replay_header_bypasses_no_chain_rule(bus: Bus, policy: str, registry: CollectorRegistry) -> None:
    await replay(_old_trace(policy, range(1, 4)), bus)
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        assert await tracker.wait_ready(TIMEOUT) == 3
        # The history read at start was not "received live": neither lag nor replay count.
        assert _sample(registry, "weightbus_events_replayed_total", policy) == 0
        w = subjects.weights(policy)
        # Another trainer's update, marked replayed by whoever published it: rejected like any other.
        rogue = updated(9, policy=policy, trainer="rogue", epoch=1)
        await bus.publish(w, rogue, msg_id=f"{policy}:rogue", headers={REPLAYED_HEADER: "1"})
        await wait_until(
            lambda: _sample(registry, "weightbus_events_rejected_total", policy, reason="not_owner") == 1,
            TIMEOUT,
            "the rogue replayed update rejected",
        )
        # ... and a replayed trace of an older version is a regression, held.
        await replay(_old_trace(policy, range(2, 3)), bus)
        await wait_until(
            lambda: _sample(registry, "weightbus_version_regressions_total", policy) == 1,
            TIMEOUT,
            "the replayed lower version counted as a regression",
        )
        assert tracker.current == 3 and tracker.publisher == "trainer-a"
    assert _sample(registry, "weightbus_propagation_lag_seconds_count", policy) == 0


@pytest.mark.nats
async def test_cli_replay_of_a_recorded_trace_into_a_fresh_policy_does_not_look_slow(
    nats_bus: NatsBus, nats_url: str, policy: str, tmp_path: Path
) -> None:
    # Record a source policy whose updates were published an hour ago (weightbus record --deliver all).
    source = f"{policy}-src"
    for v in (1, 2, 3):
        event = updated(v, policy=source, trainer="trainer-a", at=HOUR_AGO + v)
        await nats_bus.publish(subjects.weights(source), event, msg_id=f"{source}:{v}")
    out = io.BytesIO()
    assert await record(nats_bus, out, pattern=subjects.weights(source), deliver=Deliver.ALL, count=3) == 3
    trace = tmp_path / "old.jsonl"
    trace.write_bytes(out.getvalue())
    recorded = [decode(r.subject, bytes(r.event)) for r in read_trace(trace)]
    assert all(isinstance(e, WeightUpdated) and e.published_at < time.time() - 3000 for e in recorded)

    registry = CollectorRegistry()
    async with VersionTracker(nats_bus, policy, registry=registry) as tracker:
        assert await tracker.wait_ready(TIMEOUT) is None
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "weightbus.cli",
            "replay",
            str(trace),
            "--as-policy",
            policy,
            "--nats",
            nats_url,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(60):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert b"replayed 3 new events" in err
        assert await tracker.wait_for(3, TIMEOUT) == 3
        assert _sample(registry, "weightbus_propagation_lag_seconds_count", policy) == 0
        assert _sample(registry, "weightbus_events_replayed_total", policy) == 3
        stored = await nats_bus.last(subjects.weights(policy))
        assert stored is not None and stored.headers.get(REPLAYED_HEADER) == "1"
        # The trainer carries on live: observed, and fast.
        await nats_bus.publish(
            subjects.weights(policy), updated(4, policy=policy, trainer="trainer-a"), msg_id=f"{policy}:live:4"
        )
        assert await tracker.wait_for(4, TIMEOUT) == 4
    assert _sample(registry, "weightbus_propagation_lag_seconds_count", policy) == 1
    assert registry.get_sample_value("weightbus_propagation_lag_seconds_bucket", {"policy": policy, "le": "1.0"}) == 1


async def test_watch_exports_no_lag_for_a_replayed_event(policy: str) -> None:
    """``weightbus watch --metrics-port`` feeds the same histogram: a replayed event is not live there either."""
    bus = MemoryBus()
    registry = CollectorRegistry()
    task = asyncio.create_task(
        watch(bus, subjects.weights(policy), json_out=True, count=2, duration=TIMEOUT, metrics=TrackerMetrics(registry))
    )
    await wait_until(lambda: bus._subs, TIMEOUT, "the watch to subscribe")
    # Published after the watch started (so its time alone would read as live), but republished by a replay.
    late = TraceRecord(
        subject=subjects.weights(policy),
        received_at=time.time(),
        event=msgspec.Raw(encode(updated(1, policy=policy, trainer="trainer-a", at=time.time()))),
        headers={"Nats-Msg-Id": f"{policy}:1"},
    )
    await replay([late], bus)
    await bus.publish(subjects.weights(policy), updated(2, policy=policy, trainer="trainer-a"), msg_id=f"{policy}:2")
    state = await asyncio.wait_for(task, TIMEOUT)
    assert state.policies[policy].weights.version == 2
    assert _sample(registry, "weightbus_propagation_lag_seconds_count", policy) == 1  # the live one only
    await bus.aclose()
