"""``WeightUpdated.artifact``: round trips, both directions of evolution, and the self-contradictions decode refuses."""

from __future__ import annotations

import json

import msgspec
import pytest

from weightbus.errors import InvalidEventError, UnsendableEventError
from weightbus.schemas import LoraAdapter, WeightArtifact, WeightUpdated, decode, encode

W = "weightbus.p.weights"
DIGEST = "sha256:" + "0f" * 32
BASE = {"type": "weight.updated", "policy": "p", "version": 7, "epoch": 0, "trainer_id": "t", "published_at": 1.0}


class _OldWeightUpdated(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="weight.updated"):
    """``WeightUpdated`` as a reader before artifacts declared it (its last field was ``reserves_next``)."""

    policy: str
    version: int
    epoch: int
    trainer_id: str
    published_at: float
    lora: LoraAdapter | None = None
    engines: tuple[str, ...] = ()
    incarnation: str = ""
    reserves_next: bool = False


def _payload(**artifact: object) -> bytes:
    return json.dumps({**BASE, "artifact": artifact}).encode()


def test_full_and_delta_artifacts_round_trip() -> None:
    for artifact in (
        WeightArtifact(uri="/ckpt/v7.safetensors", manifest_digest=DIGEST, tensors=(("a.weight", DIGEST),)),
        WeightArtifact(uri="s3://bucket/d7", lineage="delta", base=6),
    ):
        event = WeightUpdated(policy="p", version=7, epoch=0, trainer_id="t", published_at=1.0, artifact=artifact)
        assert decode(W, encode(event)) == event
        assert hash(event)  # frozen all the way down: tensors are pairs, not a dict


def test_an_old_event_decodes_without_an_artifact() -> None:
    event = decode(W, json.dumps(BASE).encode())
    assert isinstance(event, WeightUpdated) and event.artifact is None


def test_an_old_reader_decodes_a_new_event_and_ignores_the_artifact() -> None:
    artifact = WeightArtifact(uri="/d7", lineage="delta", base=6, manifest_digest=DIGEST)
    new = WeightUpdated(
        policy="p", version=7, epoch=0, trainer_id="t", published_at=1.0, reserves_next=True, artifact=artifact
    )
    old = msgspec.json.decode(encode(new), type=_OldWeightUpdated)
    assert (old.version, old.reserves_next) == (7, True)


@pytest.mark.parametrize(
    ("artifact", "detail"),
    [
        ({"uri": "/d", "lineage": "delta"}, "a delta artifact names its base version"),
        ({"uri": "/w", "lineage": "full", "base": 3}, "a full artifact has no base version"),
        ({"uri": "/d", "lineage": "delta", "base": 7}, "must be below its version"),
        ({"uri": "/d", "lineage": "delta", "base": 8}, "must be below its version"),
        ({"uri": "/w", "lineage": "patch"}, "$.artifact.lineage"),
        ({"uri": ""}, "$.artifact.uri"),
        ({"uri": "/w", "manifest_digest": "sha256:xyz"}, "$.artifact.manifest_digest"),
        ({"uri": "/w", "manifest_digest": "0f" * 32}, "$.artifact.manifest_digest"),
        ({"uri": "/w", "tensors": [["a", "md5"]]}, "$.artifact.tensors"),
        ({"uri": "/w", "tensors": [["a", DIGEST], ["a", DIGEST]]}, "a tensor is named twice"),
    ],
)
def test_a_self_contradicting_artifact_is_an_invalid_event(artifact: dict[str, object], detail: str) -> None:
    # One typed decode at the bus boundary: counted and skipped like any malformed event, never seen by the chain.
    with pytest.raises(InvalidEventError) as info:
        decode(W, _payload(**artifact))
    assert info.value.reason == "invalid"
    assert detail in info.value.detail


def test_a_lora_push_with_a_full_artifact_is_an_invalid_event() -> None:
    payload = json.dumps({**BASE, "lora": {"name": "a"}, "artifact": {"uri": "/a"}}).encode()
    with pytest.raises(InvalidEventError, match="a LoRA push's artifact is a delta"):
        decode(W, payload)
    delta = json.dumps({**BASE, "lora": {"name": "a"}, "artifact": {"uri": "/a", "lineage": "delta", "base": 6}})
    assert decode(W, delta.encode()).artifact == WeightArtifact(uri="/a", lineage="delta", base=6)  # type: ignore[union-attr]


def test_the_constructors_refuse_what_decode_refuses() -> None:
    with pytest.raises(ValueError, match="names its base"):
        WeightArtifact(uri="/d", lineage="delta")
    with pytest.raises(ValueError, match="below its version"):
        WeightUpdated(
            policy="p",
            version=3,
            epoch=0,
            trainer_id="t",
            published_at=1.0,
            artifact=WeightArtifact(uri="/d", lineage="delta", base=3),
        )
    # A malformed digest is a type constraint: the encode boundary refuses to send it.
    bad = WeightArtifact(uri="/w", manifest_digest="sha256:xyz")
    with pytest.raises(UnsendableEventError):
        encode(WeightUpdated(policy="p", version=3, epoch=0, trainer_id="t", published_at=1.0, artifact=bad))
