"""Pure tier: wire schemas, round trips, evolution, and every documented decode error."""

from __future__ import annotations

import json

import msgspec
import pytest

from weightbus.errors import InvalidEventError
from weightbus.schemas import (
    MAX_EVENT_BYTES,
    AdmissionLedger,
    CounterHighWater,
    DrainReport,
    EngineOutOfSync,
    LoraAdapter,
    PublisherClaimed,
    VersionRegressed,
    WeightApplied,
    WeightUpdated,
    decode,
    encode,
    family_of,
    json_schemas,
)

W = "weightbus.p.weights"

EVENTS = [
    (W, WeightUpdated(policy="p", version=3, epoch=1, trainer_id="t0", published_at=1.5)),
    (
        W,
        WeightUpdated(
            policy="p", version=4, epoch=1, trainer_id="t0", published_at=2.0, lora=LoraAdapter(name="a", path="/x")
        ),
    ),
    (W, PublisherClaimed(policy="p", epoch=2, trainer_id="t1", published_at=3.0, version=4, previous_trainer_id="t0")),
    (
        "weightbus.p.counter",
        CounterHighWater(policy="p", version=9, epoch=2, trainer_id="t1", published_at=3.5, announced=7),
    ),
    (
        "weightbus.p.applied",
        WeightApplied(policy="p", version=4, engine="http://e", read_back="4", ok=True, published_at=3.0),
    ),
    (
        "weightbus.p.alerts",
        VersionRegressed(
            policy="p",
            current=57,
            incoming=1,
            incoming_epoch=0,
            publisher="t9",
            action="hold",
            observer="r0",
            published_at=4.0,
        ),
    ),
    (
        "weightbus.p.alerts",
        EngineOutOfSync(policy="p", engine="http://e", expected="5", actual="default", trainer_id="t", published_at=5),
    ),
    (
        "weightbus.p.drains",
        DrainReport(
            policy="p",
            consumer="c",
            seq=1,
            current=9,
            kept=4,
            recycled=1,
            dropped=0,
            published_at=6.0,
            reasons={"stale": 1},
            staleness_avg=1.2,
            staleness_max=3,
        ),
    ),
]


@pytest.mark.parametrize(("subject", "event"), EVENTS)
def test_round_trip(subject: str, event: object) -> None:
    data = encode(event)  # type: ignore[arg-type]
    assert decode(subject, data) == event
    assert subject.endswith(family_of(event))  # type: ignore[arg-type]


def test_wire_shape_is_tagged_json() -> None:
    data = json.loads(encode(EVENTS[0][1]))  # type: ignore[arg-type]
    assert data["type"] == "weight.updated"
    assert data["version"] == 3 and data["policy"] == "p"


def test_the_counter_subject_carries_only_marks() -> None:
    mark = b'{"type":"counter.high_water","policy":"p","version":9,"epoch":0,"trainer_id":"t","published_at":1}'
    assert decode("weightbus.p.counter", mark) == CounterHighWater(
        policy="p", version=9, epoch=0, trainer_id="t", published_at=1.0
    )
    with pytest.raises(InvalidEventError) as info:
        decode(W, mark)
    assert info.value.reason == "invalid"
    with pytest.raises(InvalidEventError):
        decode("weightbus.p.counter", encode(EVENTS[1][1]))  # type: ignore[arg-type]


def test_older_payload_decodes_with_defaults() -> None:
    # A v0.0 producer knew neither `lora` nor `engines`.
    old = b'{"type":"weight.updated","policy":"p","version":7,"epoch":0,"trainer_id":"t","published_at":1.0}'
    event = decode(W, old)
    assert isinstance(event, WeightUpdated)
    assert event.lora is None and event.engines == ()


def test_a_multi_adapter_lora_round_trips_and_an_older_one_decodes_as_a_single_adapter() -> None:
    lora = LoraAdapter(name="__miles_slot_0", trainer_name="math", more=(LoraAdapter(name="__miles_slot_1"),))
    event = WeightUpdated(policy="p", version=3, epoch=1, trainer_id="t", published_at=1.0, lora=lora)
    back = decode(W, encode(event))
    assert isinstance(back, WeightUpdated) and back.lora == lora
    assert [(a.name, a.trainer_name, a.more) for a in lora.adapters()] == [
        ("__miles_slot_0", "math", ()),
        ("__miles_slot_1", None, ()),
    ]
    old = (
        b'{"type":"weight.updated","policy":"p","version":7,"epoch":0,"trainer_id":"t","published_at":1.0,'
        b'"lora":{"name":"a","path":null}}'
    )
    older = decode(W, old)
    assert isinstance(older, WeightUpdated) and older.lora is not None
    assert older.lora.adapters() == (LoraAdapter(name="a"),)


def test_unknown_fields_are_ignored() -> None:
    newer = (
        b'{"type":"weight.updated","policy":"p","version":7,"epoch":0,"trainer_id":"t",'
        b'"published_at":1.0,"field_from_the_future":{"x":1}}'
    )
    assert decode(W, newer).version == 7  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("subject", "payload", "reason", "detail"),
    [
        (W, b"not json", "malformed", "malformed"),
        (W, b"", "malformed", "truncated"),
        (W, b"[1,2]", "invalid", "Expected `object`"),
        (
            W,
            b'{"type":"weight.updated","policy":"p","version":-1,"epoch":0,"trainer_id":"t","published_at":1}',
            "invalid",
            "$.version",
        ),
        (
            W,
            b'{"type":"weight.updated","policy":"p","version":"7","epoch":0,"trainer_id":"t","published_at":1}',
            "invalid",
            "Expected `int`, got `str`",
        ),
        (
            W,
            b'{"type":"weight.updated","policy":"a.b","version":1,"epoch":0,"trainer_id":"t","published_at":1}',
            "invalid",
            "$.policy",
        ),
        (W, b'{"type":"weights.updated","policy":"p"}', "invalid", "Invalid value"),
        (W, b'{"policy":"p","version":1}', "invalid", "missing required field `type`"),
        # A drain report is not a weight event: the subject decides the family.
        (W, encode(EVENTS[-1][1]), "invalid", "Invalid value 'drain.report'"),  # type: ignore[arg-type]
        ("weightbus.p.other", b"{}", "unknown_subject", "subject"),
        ("elsewhere.p.weights", b"{}", "unknown_subject", "subject"),
    ],
)
def test_every_documented_error(subject: str, payload: bytes, reason: str, detail: str) -> None:
    with pytest.raises(InvalidEventError) as info:
        decode(subject, payload)
    assert info.value.reason == reason
    assert info.value.subject == subject
    assert detail in info.value.detail


def test_oversized_payload_is_refused_before_parsing() -> None:
    big = b'{"type":"weight.updated","pad":"' + b"x" * MAX_EVENT_BYTES + b'"}'
    with pytest.raises(InvalidEventError) as info:
        decode(W, big)
    assert info.value.reason == "oversized"


def test_family_of_rejects_foreign_objects() -> None:
    with pytest.raises(TypeError):
        family_of(object())  # type: ignore[arg-type]


def test_json_schemas_cover_every_family_and_tag() -> None:
    schemas = json_schemas()
    assert set(schemas) == {"weights", "applied", "alerts", "drains", "counter", "admission"}
    text = json.dumps(schemas)
    tags = ("weight.updated", "weight.claimed", "weight.applied", "alert.version_regressed", "drain.report")
    for tag in (*tags, "counter.high_water", "admission.ledger"):
        assert tag in text
    # A schema consumer can see the non-negative version constraint.
    assert schemas["weights"]["$defs"]["WeightUpdated"]["properties"]["version"]["minimum"] == 0


def test_frozen_events_cannot_be_mutated() -> None:
    event = EVENTS[0][1]
    with pytest.raises(AttributeError):
        event.version = 9  # type: ignore[misc,attr-defined]
    assert msgspec.structs.replace(event, version=9).version == 9  # type: ignore[type-var,attr-defined]


def test_a_ledger_from_a_writer_before_wants_still_decodes() -> None:
    old = {
        "type": "admission.ledger",
        "policy": "p",
        "total": 8,
        "holders": {"r0:abc": {"slots": 8, "used": 8, "expires_at": 1.0}},
        "writer": "r0:abc",
        "version": 3,
        "written_at": 0.5,
    }
    ledger = decode("weightbus.p.admission", json.dumps(old).encode())
    assert isinstance(ledger, AdmissionLedger) and ledger.holders["r0:abc"].wants == 0
