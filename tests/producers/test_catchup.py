"""Catch-up without the trainer, on a real nats-server and reference engines served over real HTTP.

Every test asserts the invariant from what the engine recorded: a numeric label names the weights the engine holds
(its ``model_path`` is that version's verified file), and a failure leaves it quarantined or truthfully labelled.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from weightbus.bus import subjects
from weightbus.bus.nats import NatsBus
from weightbus.engines.sglang import SGLangClient
from weightbus.errors import (
    ArtifactDigestError,
    ArtifactLineageError,
    ArtifactMissingError,
    CatchupEngineError,
    CatchupError,
)
from weightbus.producers import CatchupMetrics, EngineFleet, VersionPublisher, catch_up
from weightbus.producers.artifact import safetensors_artifact
from weightbus.refengine.reference import EngineState
from weightbus.schemas import FleetQuarantined, LoraAdapter, WeightApplied, WeightArtifact, WeightUpdated, now

from .conftest import HookBus, announce_full, history, loads, truthful, write_safetensors

pytestmark = pytest.mark.nats


async def alerts(bus: NatsBus, policy: str) -> list[FleetQuarantined]:
    return [e.event for e in await history(bus, subjects.alerts(policy)) if isinstance(e.event, FleetQuarantined)]


async def test_a_restarted_engine_is_brought_to_the_announced_version(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    files = dict([await announce_full(pub, tmp_path), await announce_full(pub, tmp_path)])
    metrics = CatchupMetrics(CollectorRegistry())
    async with SGLangClient(url) as client:
        result = await catch_up(nats_bus, policy, client, metrics=metrics)
    assert (result.outcome, result.before, result.label, result.loaded) == ("caught_up", "default", "2", (2,))
    assert state.weight_version == "2" and truthful(state, files)
    assert [b["model_path"] for b in loads(state)] == [str(files[2])]  # type: ignore[index]
    assert state.pause_mode is None  # resumed
    applied = [e.event for e in await history(nats_bus, subjects.applied(policy))]
    assert [(a.version, a.engine, a.read_back, a.ok) for a in applied if isinstance(a, WeightApplied)] == [
        (2, url, "2", True)
    ]
    assert metrics.registry.get_sample_value("weightbus_catchup_total", {"policy": policy, "outcome": "caught_up"})


async def test_an_engine_at_or_above_the_version_is_never_loaded_or_brought_down(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    await announce_full(pub, tmp_path)
    async with SGLangClient(url) as client:
        state.weight_version = "1"
        assert (await catch_up(nats_bus, policy, client)).outcome == "current"
        state.weight_version = "7"  # the bus read is older than the engine (a push landed after it)
        result = await catch_up(nats_bus, policy, client)
    assert (result.outcome, result.version, state.weight_version) == ("ahead", 7, "7")
    assert loads(state) == [] and state.recorded("/pause_generation") == []


async def test_bytes_changed_after_the_announcement_are_never_loaded_and_the_engine_is_quarantined(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    _, path = await announce_full(pub, tmp_path)
    write_safetensors(path, 99)  # same size, same header, other weights
    metrics = CatchupMetrics(CollectorRegistry())
    async with SGLangClient(url) as client:
        with pytest.raises(ArtifactDigestError) as caught:
            await catch_up(nats_bus, policy, client, metrics=metrics)
    assert caught.value.quarantined and caught.value.reason == "digest_mismatch" and caught.value.version == 1
    assert state.weight_version == "quarantine:1" and loads(state) == []
    [alert] = await alerts(nats_bus, policy)
    assert (alert.label, alert.engines, alert.reason) == ("quarantine:1", (url,), "catchup_failed")
    labels = {"policy": policy, "reason": "digest_mismatch"}
    assert metrics.registry.get_sample_value("weightbus_catchup_failures_total", labels) == 1


async def test_a_tensor_digest_that_differs_is_refused_even_when_the_manifest_matches(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    path = write_safetensors(tmp_path / "w1.safetensors", 1)
    good = safetensors_artifact(path)
    wrong = WeightArtifact(uri=good.uri, manifest_digest=good.manifest_digest, tensors=(("w", "sha256:" + "0" * 64),))
    async with pub.update(artifact=wrong):
        pass
    async with SGLangClient(url) as client:
        with pytest.raises(ArtifactDigestError, match="tensor"):
            await catch_up(nats_bus, policy, client)
    assert state.weight_version == "quarantine:1" and loads(state) == []


async def test_a_missing_file_is_never_loaded_and_the_engine_is_quarantined(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    await announce_full(pub, tmp_path)
    _, path = await announce_full(pub, tmp_path)
    path.unlink()
    state.weight_version = "1"
    async with SGLangClient(url) as client:
        with pytest.raises(ArtifactMissingError):
            await catch_up(nats_bus, policy, client)
    assert state.weight_version == "quarantine:2" and loads(state) == []


async def test_a_version_announced_without_an_artifact_cannot_be_caught_up_to(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    await announce_full(pub, tmp_path)
    async with pub.update():  # an old trainer, or a push that wrote nothing a replica could load
        pass
    async with SGLangClient(url) as client:
        with pytest.raises(ArtifactLineageError) as caught:
            await catch_up(nats_bus, policy, client)
    assert caught.value.reason == "no_artifact" and state.weight_version == "quarantine:2" and loads(state) == []


async def test_a_delta_whose_base_was_never_announced_is_never_loaded(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    # The retained history starts at a LoRA delta on v3: trackers take it (they cannot vouch for the base), but no
    # announcement names the weights under it, so the adapter alone would be a v5 on whatever the engine booted.
    state, url = served
    adapter = write_safetensors(tmp_path / "adapter-v5.safetensors", 5)
    event = WeightUpdated(
        policy=policy,
        version=5,
        epoch=1,
        trainer_id="t",
        published_at=now(),
        lora=LoraAdapter(name="lora-v5", path=str(adapter)),
        artifact=safetensors_artifact(adapter, base=3),
    )
    await nats_bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:v5")
    async with SGLangClient(url) as client:
        with pytest.raises(ArtifactLineageError) as caught:
            await catch_up(nats_bus, policy, client)
    assert caught.value.reason == "unannounced_base" and caught.value.quarantined
    assert state.weight_version == "quarantine:5" and loads(state) == [] and state.lora_adapters == {}


async def test_a_lora_version_is_its_adapter_on_the_announced_base(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    version, base = await announce_full(pub, tmp_path)
    adapter = write_safetensors(tmp_path / "adapter-v2.safetensors", 2)
    lora = LoraAdapter(name="lora-v2", path=str(adapter))
    async with pub.update(lora=lora, artifact=safetensors_artifact(adapter, base=version)):
        pass
    async with SGLangClient(url) as client:
        result = await catch_up(nats_bus, policy, client)
    assert (result.outcome, state.weight_version, state.model_path) == ("caught_up", "2", str(base))
    assert state.lora_adapters["lora-v2"].path == str(adapter)
    # The base alone never carried the number: it was loaded as quarantined, relabelled once its adapter was on.
    assert [b["weight_version"] for b in loads(state)] == ["quarantine:2"]  # type: ignore[index]


async def test_a_lora_only_run_is_caught_up_by_its_adapter_on_the_boot_base(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    # Every push since the first claim loaded an adapter (the RL loop with lora_rank): the trainer's own coverage rule
    # says every engine's base is its boot weights, so the target's adapter alone serves the version.
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with pub.update(lora=LoraAdapter(name="lora-v1", path="/adapter-v1")):  # the first announces no artifact
        pass
    adapter = write_safetensors(tmp_path / "adapter-v2.safetensors", 2)
    async with pub.update(
        lora=LoraAdapter(name="lora-v2", path=str(adapter)), artifact=safetensors_artifact(adapter, 1)
    ):
        pass
    async with SGLangClient(url) as client:
        result = await catch_up(nats_bus, policy, client)
    assert (result.outcome, state.weight_version, result.loaded) == ("caught_up", "2", (2,))
    assert loads(state) == [] and state.lora_adapters["lora-v2"].path == str(adapter)


async def test_an_adapter_on_weights_no_artifact_names_is_never_put_on_the_boot_base(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    # A full push without an artifact, then adapters: the base is v1's weights, which no file names, not the boot's.
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with pub.update():
        pass
    async with pub.update(lora=LoraAdapter(name="lora-v2", path="/adapter-v2")):
        pass
    adapter = write_safetensors(tmp_path / "adapter-v3.safetensors", 3)
    async with pub.update(
        lora=LoraAdapter(name="lora-v3", path=str(adapter)), artifact=safetensors_artifact(adapter, 2)
    ):
        pass
    async with SGLangClient(url) as client:
        with pytest.raises(ArtifactLineageError) as caught:
            await catch_up(nats_bus, policy, client)
    assert caught.value.reason == "no_artifact" and state.lora_adapters == {} and state.weight_version == "quarantine:3"


class _PushFirst(SGLangClient):
    """An engine client whose pause first lets the trainer's next update land on the same engine (the race)."""

    def __init__(self, url: str, before_pause: object) -> None:
        super().__init__(url)
        self.before_pause = before_pause

    async def pause_generation(self, mode: str = "retract") -> None:  # type: ignore[override]
        hook, self.before_pause = self.before_pause, None
        if hook is not None:
            await hook()  # type: ignore[operator]
        await super().pause_generation(mode)  # type: ignore[arg-type]


async def test_a_trainer_push_landing_before_the_load_is_never_overwritten_with_the_older_version(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    async with SGLangClient(url) as trainer_client:
        fleet = EngineFleet([trainer_client])
        pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
        files = dict([await announce_full(pub, tmp_path)])
        trainer = await VersionPublisher(nats_bus, policy, trainer_id="t2", fleet=fleet, pause="retract").start()

        async def trainer_push() -> None:  # the trainer's full push: load and label in one call
            upd = trainer.update(labels=True)
            async with upd as version:
                path = write_safetensors(tmp_path / f"weights-v{version}.safetensors", version)
                upd.artifact = safetensors_artifact(path)
                files[version] = path
                await trainer_client.update_weights_from_disk(str(path), weight_version=str(version))

        racing = _PushFirst(url, trainer_push)
        try:
            result = await catch_up(nats_bus, policy, racing)  # read the bus at v1, then the trainer pushed v2
        finally:
            await racing.aclose()
    pushed = max(files)  # the takeover resumed above the number the first owner reserved ahead
    assert (result.outcome, result.label, result.loaded) == ("ahead", str(pushed), ())
    assert state.weight_version == str(pushed) and truthful(state, files)
    assert [b["model_path"] for b in loads(state)] == [str(files[pushed])]  # type: ignore[index]


class _AnnounceAfterLoad(SGLangClient):
    """An engine client whose first load lets the trainer announce newer versions elsewhere before it returns."""

    def __init__(self, url: str, after_load: object) -> None:
        super().__init__(url)
        self.after_load = after_load

    async def update_weights_from_disk(self, model_path: str, **kwargs: object):  # type: ignore[no-untyped-def,override]
        result = await super().update_weights_from_disk(model_path, **kwargs)  # type: ignore[arg-type]
        hook, self.after_load = self.after_load, None
        if hook is not None:
            await hook()  # type: ignore[operator]
        return result


@pytest.mark.parametrize("rounds", [3, 1])
async def test_an_announcement_during_the_catch_up_is_followed_or_left_truthfully(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path, rounds: int
) -> None:
    # The trainer announces v2 (its fleet does not hold this engine) while the catch-up loads v1: with rounds to
    # spare it goes on to v2; with none it stops truthfully at v1 and says the engine is behind.
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    files = dict([await announce_full(pub, tmp_path)])

    async def announce() -> None:
        version, path = await announce_full(pub, tmp_path)
        files[version] = path

    client = _AnnounceAfterLoad(url, announce)
    try:
        result = await catch_up(nats_bus, policy, client, rounds=rounds)
    finally:
        await client.aclose()
    assert truthful(state, files) and result.announced == 2
    if rounds == 3:
        assert (result.outcome, result.loaded, state.weight_version) == ("caught_up", (1, 2), "2")
    else:
        assert (result.outcome, result.loaded, state.weight_version, result.version) == ("behind", (1,), "1", 1)
    assert state.pause_mode is None


@pytest.mark.parametrize("when", ["over_the_load", "after_the_read_back"])
async def test_a_trainer_push_onto_the_engine_during_the_catch_up_ends_it_at_the_trainers_version(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path, when: str
) -> None:
    # The trainer's full push lands on the engine right after the catch-up's load of v1 returned, or once its
    # read-back was published: the catch-up never relabels it, and ends at the trainer's version either way.
    state, url = served
    async with SGLangClient(url) as trainer_client:
        pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
        files = dict([await announce_full(pub, tmp_path)])
        trainer = await VersionPublisher(
            nats_bus, policy, trainer_id="t2", fleet=EngineFleet([trainer_client]), pause="retract"
        ).start()

        async def trainer_push() -> None:
            upd = trainer.update(labels=True)
            async with upd as version:
                path = write_safetensors(tmp_path / f"weights-v{version}.safetensors", version)
                upd.artifact = safetensors_artifact(path)
                files[version] = path
                await trainer_client.update_weights_from_disk(str(path), weight_version=str(version))

        pending = [trainer_push]

        async def on_applied(subject: str, event: object) -> None:
            if when == "after_the_read_back" and isinstance(event, WeightApplied) and pending:
                await pending.pop()()

        bus = HookBus(nats_bus, on_applied)
        client = _AnnounceAfterLoad(url, trainer_push if when == "over_the_load" else None)
        try:
            result = await catch_up(bus, policy, client)  # type: ignore[arg-type]
        finally:
            await client.aclose()
    pushed = max(files)
    outcome = "ahead" if when == "over_the_load" else "current"
    assert (result.outcome, result.version, result.label, result.loaded) == (outcome, pushed, str(pushed), (1,))
    assert state.weight_version == str(pushed) and truthful(state, files)


async def test_a_pending_label_above_the_version_is_a_trainer_update_and_left_alone(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    await announce_full(pub, tmp_path)
    state.weight_version = "pending:2"
    async with SGLangClient(url) as client:
        with pytest.raises(CatchupEngineError) as caught:
            await catch_up(nats_bus, policy, client)
    assert caught.value.reason == "busy" and not caught.value.quarantined
    assert state.weight_version == "pending:2" and loads(state) == []


async def test_a_policy_that_never_announced_leaves_the_engine_untouched(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str]
) -> None:
    state, url = served
    async with SGLangClient(url) as client:
        with pytest.raises(CatchupError) as caught:
            await catch_up(nats_bus, policy, client)
    assert caught.value.reason == "never_published" and state.requests == []


async def test_a_failed_load_quarantines_and_resumes(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    await announce_full(pub, tmp_path)
    state.fail_weight_updates = "Failed to load: out of memory"
    async with SGLangClient(url) as client:
        with pytest.raises(CatchupEngineError, match="out of memory") as caught:
            await catch_up(nats_bus, policy, client)
    assert caught.value.quarantined and state.weight_version == "quarantine:1" and state.pause_mode is None
    assert [a.resumed for a in await alerts(nats_bus, policy)] == [True]


async def test_a_cancelled_catch_up_resumes_the_engine_and_leaves_it_truthfully_labelled(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    files = dict([await announce_full(pub, tmp_path)])
    state.weight_update_delay = 1.0
    async with SGLangClient(url) as client:
        task = asyncio.create_task(catch_up(nats_bus, policy, client))
        while not state.recorded("/update_weights_from_disk"):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert state.weight_version != "1" or truthful(state, files)
        while state.pause_mode is not None:  # the shielded resume, after the cancel
            await asyncio.sleep(0.01)
    assert truthful(state, files)
