"""SyncVersionPublisher: the blocking facade, against the session's nats-server and a served engine."""

from __future__ import annotations

import asyncio

import pytest

from weightbus.bus import connect, subjects
from weightbus.errors import FencedError
from weightbus.producers import SyncVersionPublisher, VersionPublisher
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import LoraAdapter, WeightUpdated


async def _last(nats_url: str, policy: str) -> WeightUpdated:
    bus = await connect(nats_url)
    try:
        env = await bus.last(subjects.weights(policy))
    finally:
        await bus.close()
    assert env is not None and isinstance(env.event, WeightUpdated)
    return env.event


def test_sync_publisher_updates_and_keeps_versions_on_errors(nats_url: str, policy: str) -> None:
    state = EngineState()
    with ServedEngine(create_app(state)) as engine:
        with SyncVersionPublisher(policy, nats_url=nats_url, engines=[engine.url], pause="retract") as pub:
            assert (pub.epoch, pub.version) == (0, None)
            with pub.update() as version:
                assert version == 1 and state.pause_mode == "retract"
            assert state.weight_version == "1" and state.pause_mode is None
            with pytest.raises(KeyError):
                with pub.update() as version:
                    assert version == 2
                    raise KeyError("push failed")
            assert pub.version == 1 and state.pause_mode is None
            # The failed push may have left any weights: an adapter on them names nothing until a full push.
            with pub.update() as version:
                assert version == 3
            assert pub.publish_lora(LoraAdapter(name="a", path="/p")) == 4
            assert state.weight_version == "4" and "a" in state.lora_adapters
    event = asyncio.run(_last(nats_url, policy))
    assert (event.version, event.lora, event.engines) == (4, LoraAdapter(name="a", path="/p"), (engine.url,))


def test_sync_publisher_is_fenced_by_a_newer_one(nats_url: str, policy: str) -> None:
    with SyncVersionPublisher(policy, nats_url=nats_url, trainer_id="old") as old:
        with old.update():
            pass

        async def take_over(_: VersionPublisher) -> None:
            bus = await connect(nats_url)
            try:
                await VersionPublisher(bus, policy, trainer_id="new").start()
            finally:
                await bus.close()

        old.call(take_over)
        with pytest.raises(FencedError, match="'new'"):
            with old.update():
                pass
    with pytest.raises(RuntimeError, match="not started"):
        old.update().__enter__()
