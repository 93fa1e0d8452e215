"""Property tier: random bytes and random JSON through the decoders; only the typed error comes out."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from weightbus.errors import InvalidEventError
from weightbus.schemas import FAMILIES, Event, decode

SUBJECTS = [f"weightbus.p.{family}" for family in FAMILIES] + ["weightbus.p.nope", "x.y"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=6),
    max_leaves=30,
)

TAGS = ["weight.updated", "weight.claimed", "weight.applied", "alert.version_regressed", "drain.report", "x"]
FIELDS = ["policy", "version", "epoch", "trainer_id", "published_at", "engine", "current", "incoming", "seq", "kept"]
event_like = st.fixed_dictionaries({"type": st.sampled_from(TAGS)}, optional={f: json_values for f in FIELDS})


def _only_typed_outcomes(subject: str, data: bytes) -> None:
    try:
        event = decode(subject, data)
    except InvalidEventError as exc:
        assert exc.subject == subject and exc.reason in {"malformed", "invalid", "oversized", "unknown_subject"}
    else:
        assert isinstance(event, Event.__args__)  # type: ignore[attr-defined]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SUBJECTS), st.binary(max_size=256))
def test_random_bytes(subject: str, data: bytes) -> None:
    _only_typed_outcomes(subject, data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SUBJECTS), json_values)
def test_random_json(subject: str, value: object) -> None:
    _only_typed_outcomes(subject, json.dumps(value).encode())


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SUBJECTS), event_like)
def test_event_shaped_json(subject: str, value: dict[str, object]) -> None:
    _only_typed_outcomes(subject, json.dumps(value).encode())
