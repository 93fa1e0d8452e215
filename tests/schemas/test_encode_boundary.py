"""The encoder at the bus boundary, on both buses: an event every consumer would drop is never sent."""

from __future__ import annotations

import pytest

from weightbus.bus import subjects
from weightbus.bus.protocol import Bus
from weightbus.errors import InvalidEventError, UnsendableEventError
from weightbus.schemas import MAX_EVENT_BYTES, MAX_VERSION, DrainReport, PublisherClaimed, WeightUpdated


async def test_a_version_above_the_bound_is_refused_naming_the_field(bus: Bus, policy: str) -> None:
    subject = subjects.weights(policy)
    over = WeightUpdated(policy=policy, version=MAX_VERSION + 1, epoch=0, trainer_id="t", published_at=1.0)
    with pytest.raises(UnsendableEventError) as info:
        await bus.publish(subject, over, msg_id=f"{policy}:over")
    err = info.value
    assert isinstance(err, InvalidEventError) and isinstance(err, ValueError)
    assert (err.path, err.event_type, err.family, err.reason) == ("$.version", "WeightUpdated", "weights", "unsendable")
    assert "9007199254740991" in str(err) and "$.version" in str(err)
    claim = PublisherClaimed(policy=policy, epoch=0, trainer_id="t", published_at=1.0, reserved=2**53)
    with pytest.raises(UnsendableEventError) as info:
        await bus.publish(subject, claim, msg_id=f"{policy}:claim")
    assert info.value.path == "$.reserved"
    assert await bus.last_seq(subject) == 0  # nothing reached the stream
    at_bound = WeightUpdated(policy=policy, version=MAX_VERSION, epoch=0, trainer_id="t", published_at=1.0)
    await bus.publish(subject, at_bound, msg_id=f"{policy}:bound")
    stored = await bus.last(subject)
    assert stored is not None and stored.event == at_bound


async def test_every_constraint_of_the_type_is_checked_before_sending(bus: Bus, policy: str) -> None:
    subject = subjects.drains(policy)
    negative = DrainReport(
        policy=policy, consumer="c", seq=1, current=1, kept=-1, recycled=0, dropped=0, published_at=1.0
    )
    with pytest.raises(UnsendableEventError) as info:
        await bus.publish(subject, negative, msg_id=f"{policy}:neg")
    assert info.value.path == "$.kept"
    big = DrainReport(
        policy=policy,
        consumer="c" * MAX_EVENT_BYTES,
        seq=1,
        current=1,
        kept=1,
        recycled=0,
        dropped=0,
        published_at=1.0,
    )
    with pytest.raises(UnsendableEventError) as info:
        await bus.publish(subject, big, msg_id=f"{policy}:big")
    assert info.value.path == "$" and "bytes" in info.value.detail
    assert await bus.last_seq(subject) == 0
