"""The artifact a publisher announces: passed through ``update()``, set in the block, checked before any stamp."""

from __future__ import annotations

import asyncio

import pytest

from weightbus.bus import connect, subjects
from weightbus.bus.protocol import Bus
from weightbus.consumers import VersionTracker
from weightbus.errors import UnsendableEventError
from weightbus.producers import EngineFleet, SyncVersionPublisher, VersionPublisher
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import LoraAdapter, WeightArtifact, WeightUpdated

from .conftest import Engines, history

DIGEST = "sha256:" + "ab" * 32


async def _announced(bus: Bus, policy: str) -> list[WeightUpdated]:
    return [e.event for e in await history(bus, subjects.weights(policy)) if isinstance(e.event, WeightUpdated)]


async def test_update_announces_the_artifact_given_or_set_in_the_block(bus: Bus, policy: str) -> None:
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    full = WeightArtifact(uri="s3://b/w-1", manifest_digest=DIGEST, tensors=(("w", DIGEST),))
    async with pub.update(artifact=full):
        pass
    async with pub.update():
        pass
    upd = pub.update()
    async with upd as version:
        # Set once the version is known: the URI names it.
        upd.artifact = WeightArtifact(uri=f"s3://b/d-{version}", lineage="delta", base=version - 1)
    announced = await _announced(bus, policy)
    assert [e.artifact for e in announced] == [full, None, upd.artifact]
    assert upd.artifact is not None and upd.artifact.uri == "s3://b/d-3"


async def test_a_base_not_below_the_version_fails_the_update_before_any_stamp(
    bus: Bus, policy: str, engines: Engines
) -> None:
    client = engines.add("e0")
    fleet = EngineFleet([client])
    pub = await VersionPublisher(bus, policy, trainer_id="t", fleet=fleet).start()
    upd = pub.update()
    with pytest.raises(ValueError, match="must be below"):
        async with upd as version:
            upd.artifact = WeightArtifact(uri="/w", lineage="delta", base=version)
    assert await _announced(bus, policy) == []
    assert upd.quarantined is not None  # handled like any failed update: the engines never serve it unlabelled
    async with pub.update() as version:
        pass
    assert [e.version for e in await _announced(bus, policy)] == [version]


async def test_a_lora_push_never_announces_a_full_artifact(bus: Bus, policy: str) -> None:
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    with pytest.raises(ValueError, match="delta"):
        pub.update(lora=LoraAdapter(name="a", path="/a"), artifact=WeightArtifact(uri="/a"))
    async with pub.update():
        pass
    adapter = WeightArtifact(uri="/a", lineage="delta", base=1)
    async with pub.update(lora=LoraAdapter(name="a", path="/a"), artifact=adapter):
        pass
    assert (await _announced(bus, policy))[-1].artifact == adapter


async def test_a_tracker_takes_a_delta_announced_on_the_previous_version(bus: Bus, policy: str) -> None:
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    async with pub.update(artifact=WeightArtifact(uri="/w1")):
        pass
    async with VersionTracker(bus, policy) as tracker:
        await tracker.wait_ready()
        async with pub.update(artifact=WeightArtifact(uri="/d2", lineage="delta", base=1)):
            pass
        assert await tracker.wait_for(2, timeout=5) == 2


def test_sync_update_carries_the_artifact_set_in_the_block(nats_url: str, policy: str) -> None:
    with ServedEngine(create_app(EngineState())) as engine:
        with SyncVersionPublisher(policy, nats_url=nats_url, engines=[engine.url]) as pub:
            with pub.update(artifact=WeightArtifact(uri="/w1")) as version:
                assert version == 1
            upd = pub.update()
            with upd as version:
                upd.artifact = WeightArtifact(uri=f"/d{version}", lineage="delta", base=version - 1)

    async def last() -> WeightUpdated:
        b = await connect(nats_url)
        try:
            return (await _announced(b, policy))[-1]
        finally:
            await b.aclose()

    event = asyncio.run(last())
    assert event.version == 2 and event.artifact == WeightArtifact(uri="/d2", lineage="delta", base=1)


async def test_digests_the_bus_cannot_carry_fail_the_update_before_any_stamp(
    bus: Bus, policy: str, engines: Engines
) -> None:
    fleet = EngineFleet([engines.add("e0")])
    pub = await VersionPublisher(bus, policy, trainer_id="t", fleet=fleet).start()
    many = tuple((f"model.layers.{i}.mlp.down_proj.weight", DIGEST) for i in range(1000))
    upd = pub.update(artifact=WeightArtifact(uri="/w", manifest_digest=DIGEST, tensors=many))
    with pytest.raises(UnsendableEventError, match="bytes >"):
        async with upd:
            pass
    assert upd.stamps == [] and upd.quarantined is not None
    assert await _announced(bus, policy) == []


async def test_publish_lora_announces_the_adapter_artifact_and_refuses_a_full_one_before_loading(
    engines: Engines, bus: Bus, policy: str
) -> None:
    pub = await VersionPublisher(bus, policy, fleet=EngineFleet([engines.add("a")])).start()
    async with pub.update():
        pass
    adapter = LoraAdapter(name="math", path="/adapters/math-2")
    with pytest.raises(ValueError, match="delta"):
        await pub.publish_lora(adapter, artifact=WeightArtifact(uri="/adapters/math-2"))
    assert "math" not in engines.states["http://a"].lora_adapters  # refused before any load
    artifact = WeightArtifact(uri="/adapters/math-2", lineage="delta", base=1, manifest_digest=DIGEST)
    assert await pub.publish_lora(adapter, artifact=artifact) == 2
    assert (await _announced(bus, policy))[-1].artifact == artifact
