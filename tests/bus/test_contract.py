"""The bus contract, run on both MemoryBus and NatsBus through the parametrised ``bus`` fixture."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import has_waiters, updated, wait_until
from weightbus.bus import Deliver, Envelope, MemoryBus, NatsBus, subjects
from weightbus.bus.nats import _NatsSubscription as NatsSubscriptionType
from weightbus.bus.nats import stream_seq
from weightbus.errors import SequenceConflictError, SlowConsumerError
from weightbus.schemas import DrainReport

Bus = MemoryBus | NatsBus


wu = partial(updated, epoch=0, at=1.0)


async def take(it: AsyncIterator[Envelope], n: int, timeout: float = 5.0) -> list[Envelope]:
    out: list[Envelope] = []

    async def _go() -> None:
        async for env in it:
            out.append(env)
            if len(out) == n:
                return

    await asyncio.wait_for(_go(), timeout)
    return out


async def nothing_more(it: AsyncIterator[Envelope], wait: float = 0.3) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(it.__anext__(), wait)


async def test_publish_then_last(bus: Bus, policy: str) -> None:
    subject = subjects.weights(policy)
    assert await bus.last(subject) is None
    a1 = await bus.publish(subject, wu(1, policy=policy), msg_id=f"{policy}:1")
    a2 = await bus.publish(subject, wu(2, policy=policy), msg_id=f"{policy}:2")
    assert a2.seq > a1.seq and not a1.duplicate
    last = await bus.last(subject)
    assert last is not None and last.event == wu(2, policy=policy) and last.seq == a2.seq
    assert last.headers["Nats-Msg-Id"] == f"{policy}:2"


async def test_same_msg_id_stores_one_event(bus: Bus, policy: str) -> None:
    subject = subjects.weights(policy)
    first = await bus.publish(subject, wu(1, policy=policy), msg_id=f"{policy}:1")
    again = await bus.publish(subject, wu(1, policy=policy), msg_id=f"{policy}:1")
    assert again.duplicate and again.seq == first.seq
    sub = bus.subscribe(subject, deliver=Deliver.ALL)
    got = await take(sub, 1)
    await nothing_more(sub)
    await sub.aclose()
    assert [e.event.version for e in got] == [1]  # type: ignore[union-attr]


async def test_conditional_publish(bus: Bus, policy: str) -> None:
    subject = subjects.weights(policy)
    a1 = await bus.publish(subject, wu(1, policy=policy), msg_id=f"{policy}:1", expected_last_seq=0)
    with pytest.raises(SequenceConflictError) as info:
        await bus.publish(subject, wu(2, policy=policy), msg_id=f"{policy}:2", expected_last_seq=0)
    assert info.value.expected == 0
    last = await bus.last(subject)
    assert last is not None and last.event.version == 1  # type: ignore[union-attr]
    a2 = await bus.publish(subject, wu(2, policy=policy), msg_id=f"{policy}:2", expected_last_seq=a1.seq)
    # A retry of a conditional publish that landed is a duplicate, not a conflict.
    again = await bus.publish(subject, wu(2, policy=policy), msg_id=f"{policy}:2", expected_last_seq=a1.seq)
    assert again.duplicate and again.seq == a2.seq


async def test_last_per_subject_replays_current_then_live(bus: Bus, policy: str) -> None:
    w, d = subjects.weights(policy), subjects.drains(policy)
    for v in (1, 2, 3):
        await bus.publish(w, wu(v, policy=policy), msg_id=f"{policy}:{v}")
    report = DrainReport(policy=policy, consumer="c", seq=1, current=3, kept=1, recycled=0, dropped=0, published_at=1)
    await bus.publish(d, report, msg_id=f"{policy}:d1")
    sub = bus.subscribe(subjects.policy_pattern(policy))
    first = await take(sub, 2)
    assert [(e.subject, type(e.event).__name__) for e in first] == [(w, "WeightUpdated"), (d, "DrainReport")]
    assert first[0].event.version == 3  # type: ignore[union-attr]
    await bus.publish(w, wu(4, policy=policy), msg_id=f"{policy}:4")
    live = await take(sub, 1)
    assert live[0].event.version == 4  # type: ignore[union-attr]
    await sub.aclose()


async def test_deliver_new_skips_stored_events(bus: Bus, policy: str) -> None:
    w = subjects.weights(policy)
    await bus.publish(w, wu(1, policy=policy), msg_id=f"{policy}:1")
    sub = bus.subscribe(w, deliver=Deliver.NEW)
    if isinstance(sub, object) and hasattr(sub, "start"):
        await sub.start()  # type: ignore[attr-defined]
    await bus.publish(w, wu(2, policy=policy), msg_id=f"{policy}:2")
    got = await take(sub, 1)
    assert got[0].event.version == 2  # type: ignore[union-attr]
    await sub.aclose()


async def test_wildcards(bus: Bus, policy: str) -> None:
    other = f"{policy}x"
    sub = bus.subscribe("weightbus.*.weights", deliver=Deliver.NEW)
    if hasattr(sub, "start"):
        await sub.start()  # type: ignore[attr-defined]
    await bus.publish(
        subjects.drains(policy),
        DrainReport(policy=policy, consumer="c", seq=1, current=None, kept=0, recycled=0, dropped=0, published_at=1),
        msg_id=f"{policy}:d",
    )
    await bus.publish(subjects.weights(policy), wu(1, policy=policy), msg_id=f"{policy}:1")
    await bus.publish(subjects.weights(other), wu(5, policy=other), msg_id=f"{other}:5")
    got = await take(sub, 2)
    assert sorted((e.event.policy, e.event.version) for e in got) == [(policy, 1), (other, 5)]  # type: ignore[union-attr]
    await nothing_more(sub)
    await sub.aclose()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"{not json", "malformed"),
        (b'{"type":"weight.updated","policy":"p","version":-3,"epoch":0,"trainer_id":"t","published_at":1}', "invalid"),
        (b'{"type":"surprise"}', "invalid"),
        (b'{"type":"weight.updated","x":"' + b"y" * 70_000 + b'"}', "oversized"),
    ],
)
async def test_invalid_payload_is_counted_and_subscription_carries_on(
    bus: Bus, policy: str, registry: CollectorRegistry, payload: bytes, reason: str
) -> None:
    w = subjects.weights(policy)
    sub = bus.subscribe(w, deliver=Deliver.NEW)
    if hasattr(sub, "start"):
        await sub.start()  # type: ignore[attr-defined]
    await bus.publish_raw(w, payload, msg_id=f"{policy}:bad")
    await bus.publish(w, wu(9, policy=policy), msg_id=f"{policy}:9")
    got = await take(sub, 1)
    assert got[0].event.version == 9  # type: ignore[union-attr]
    assert registry.get_sample_value("weightbus_invalid_events_total", {"family": "weights", "reason": reason}) == 1
    await sub.aclose()


async def test_closed_subscription_ends_iteration(bus: Bus, policy: str) -> None:
    sub = bus.subscribe(subjects.weights(policy))
    task = asyncio.ensure_future(take(sub, 1, timeout=5))
    await wait_until(lambda: has_waiters(sub._queue), 5, "the reader to wait")  # type: ignore[attr-defined]
    await sub.aclose()
    assert await task == []


async def test_deliveries_carry_their_stream_sequence(bus: Bus, policy: str) -> None:
    subject = subjects.weights(policy)
    acks = [await bus.publish(subject, wu(v, policy=policy), msg_id=f"{policy}:{v}") for v in (1, 2, 3)]
    sub = bus.subscribe(subject, deliver=Deliver.ALL)
    got = await take(sub, 3)
    await sub.aclose()
    assert [e.seq for e in got] == [a.seq for a in acks]


async def test_a_consumer_that_falls_behind_gets_a_typed_error_not_a_silent_gap(bus: Bus, policy: str) -> None:
    subject = subjects.weights(policy)
    sub = bus.subscribe(subject, deliver=Deliver.ALL)
    sub._max_pending = 5  # type: ignore[union-attr]  # the default (10,000) is too many to queue in a test
    if isinstance(sub, NatsSubscriptionType):
        await sub.start()  # subscribed before the publishes
    for v in range(1, 21):
        await bus.publish(subject, wu(v, policy=policy), msg_id=f"{policy}:{v}")
    # More queued than it may hold, none read (MemoryBus drops the overflow and flags it; nats-py queues it).
    await wait_until(
        lambda: sub._overflowed or sub._queue.qsize() > sub._max_pending,  # type: ignore[union-attr]
        5,
        "the subscription to fall behind",
    )
    with pytest.raises(SlowConsumerError):
        await take(sub, 20)
    await sub.aclose()


async def test_stream_seq_reads_both_reply_subject_forms() -> None:
    assert stream_seq("$JS.ACK.WEIGHTBUS.c1.1.42.7.1796000000000000000.0") == 42
    assert stream_seq("$JS.ACK._.acchash.WEIGHTBUS.c1.1.43.8.1796000000000000000.0.rnd") == 43
    assert stream_seq("$JS.ACK._.acchash.WEIGHTBUS.c1.1.44.9.1796000000000000000.0") == 44
    for reply in (None, "", "_INBOX.abc", "$JS.ACK.short.1", "$JS.ACK.WEIGHTBUS.c1.1.x.7.1.0"):
        assert stream_seq(reply) is None
