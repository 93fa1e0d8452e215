"""SyncVersionPublisher: the blocking facade, against the session's nats-server and a served engine."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from weightbus.bus import connect, subjects
from weightbus.errors import EngineError, FencedError
from weightbus.producers import EngineFleet, EngineStamp, SyncVersionPublisher, VersionPublisher
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import LoraAdapter, WeightUpdated


async def _last(nats_url: str, policy: str) -> WeightUpdated:
    bus = await connect(nats_url)
    try:
        env = await bus.last(subjects.weights(policy))
    finally:
        await bus.aclose()
    assert env is not None and isinstance(env.event, WeightUpdated)
    return env.event


def test_sync_publisher_updates_and_keeps_versions_on_errors(nats_url: str, policy: str) -> None:
    state = EngineState()
    with ServedEngine(create_app(state)) as engine:
        with SyncVersionPublisher(policy, nats_url=nats_url, engines=[engine.url], pause="retract") as pub:
            assert (pub.state.epoch, pub.state.version, pub.state.started, pub.state.connected) == (0, None, True, True)
            with pub.update() as version:
                assert version == 1 and state.pause_mode == "retract"
            assert state.weight_version == "1" and state.pause_mode is None
            with pytest.raises(KeyError):
                with pub.update() as version:
                    assert version == 2
                    raise KeyError("push failed")
            assert pub.state.version == 1 and state.pause_mode is None
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
                await bus.aclose()

        old.call(take_over)
        with pytest.raises(FencedError, match="'new'"):
            with old.update():
                pass
    with pytest.raises(RuntimeError, match="not started"):
        old.update().__enter__()
    closed = old.state
    assert (closed.started, closed.connected, closed.epoch, closed.version) == (False, False, None, None)


#: Set while an update begins (the fleet's label read); read while it ends (the stamp, the quarantine).
_BEGUN: contextvars.ContextVar[int | None] = contextvars.ContextVar("begun", default=None)


class _TaskFleet(EngineFleet):
    """An engine fleet that notes the task and the context each phase of an update runs in."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(urls)
        self.seen: list[tuple[str, asyncio.Task[Any] | None, int | None]] = []

    async def read_versions(self) -> dict[str, str | EngineError]:
        task = asyncio.current_task()
        _BEGUN.set(id(task))
        self.seen.append(("begin", task, _BEGUN.get()))
        return await super().read_versions()

    async def stamp(self, version: int, **kwargs: Any) -> list[EngineStamp]:
        self.seen.append(("commit", asyncio.current_task(), _BEGUN.get()))
        return await super().stamp(version, **kwargs)

    async def relabel(self, label: str, **kwargs: Any) -> dict[str, EngineError | None]:
        if label.startswith("quarantine:"):
            self.seen.append(("abort", asyncio.current_task(), _BEGUN.get()))
        return await super().relabel(label, **kwargs)


def test_sync_updates_begin_and_end_in_one_task(nats_url: str, policy: str) -> None:
    state = EngineState()
    fleets: list[_TaskFleet] = []
    with ServedEngine(create_app(state)) as engine:

        async def build() -> EngineFleet:
            fleets.append(_TaskFleet([engine.url]))
            return fleets[-1]

        factory: Callable[[], Awaitable[EngineFleet]] = build
        with SyncVersionPublisher(policy, nats_url=nats_url, fleet_factory=factory, pause="retract") as pub:
            with pub.update() as version:
                assert version == 1
            with pytest.raises(KeyError):
                with pub.update():
                    raise KeyError("push failed")
            assert pub.state.version == 1 and state.weight_version == "quarantine:2"
    (fleet,) = fleets
    seen = fleet.seen[1:]  # the first label read is start()'s
    assert [phase for phase, _, _ in seen] == ["begin", "commit", "begin", "abort"]
    (_, begin1, _), (_, commit1, seen1), (_, begin2, _), (_, _, seen2) = seen
    assert commit1 is begin1  # the stamp runs in the task that began the update
    assert seen1 == id(begin1) and seen2 == id(begin2)  # what the begin set is there at the end
