"""A failed update's ``FleetQuarantined`` goes out while the engines are still paused (weightbus #24 item 5).

The docs (docs/design.md#the-update-protocol-step-by-step, docs/trainer.md#what-an-update-guarantees) promise:
relabel every engine ``quarantine:<v>``, publish the alert, and only then resume. Each test records, at the moment the
alert is published, what every strict reference engine has been asked so far, and asserts from that
record that no engine had been resumed yet; then that every engine was resumed after it. Paths: an
exception in the block, an announcement the bus refused, a publisher fenced mid-update, and an alert
the bus refuses or never answers (the engines must still be resumed, within a bound).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from weightbus.bus import MemoryBus, subjects
from weightbus.bus.protocol import Bus
from weightbus.errors import FencedError, PublishError
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.schemas import Event, FleetQuarantined, WeightUpdated

from .conftest import Engines, HookBus, history

_URLS = ("http://a", "http://b")


class Recorder:
    """Records, per published alert, each engine's requests so far and its pause state."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.at_alert: list[dict[str, tuple[list[str], str | None]]] = []

    async def hook(self, subject: str, event: Event) -> None:
        if isinstance(event, FleetQuarantined):
            self.at_alert.append({url: (self.engines.paths(url), self.engines.states[url].pause_mode) for url in _URLS})

    def assert_paused_at_the_alert_then_resumed(self) -> None:
        (snapshot,) = self.at_alert
        for url, (paths, pause_mode) in snapshot.items():
            assert "/pause_generation" in paths, (url, paths)
            assert "/continue_generation" not in paths, f"{url} was resumed before FleetQuarantined: {paths}"
            assert pause_mode == "retract", (url, pause_mode)
        for url in _URLS:
            paths = self.engines.paths(url)
            assert paths[-1] == "/continue_generation" and len(paths) > len(snapshot[url][0]), (url, paths)
            assert self.engines.states[url].pause_mode is None
            assert self.engines.states[url].weight_version.startswith("quarantine:")


async def _publisher(engines: Engines, bus: Bus, policy: str, recorder: Recorder) -> VersionPublisher:
    fleet = EngineFleet([engines.add("a"), engines.add("b")])
    return await VersionPublisher(HookBus(bus, recorder.hook), policy, fleet=fleet, pause="retract").start()


async def test_an_exception_in_the_block_alerts_before_any_engine_resumes(
    engines: Engines, bus: Bus, policy: str
) -> None:
    recorder = Recorder(engines)
    pub = await _publisher(engines, bus, policy, recorder)
    with pytest.raises(RuntimeError, match="nccl"):
        async with pub.update():
            raise RuntimeError("nccl broadcast failed halfway")
    recorder.assert_paused_at_the_alert_then_resumed()
    (alert,) = [e.event for e in await history(bus, subjects.alerts(policy))]
    assert isinstance(alert, FleetQuarantined)
    assert (alert.reason, alert.engines, alert.resumed) == ("update_failed", _URLS, True)


async def test_a_refused_announcement_alerts_before_any_engine_resumes(engines: Engines, policy: str) -> None:
    mem = MemoryBus()
    recorder = Recorder(engines)

    async def hook(subject: str, event: Event) -> None:
        await recorder.hook(subject, event)
        if isinstance(event, WeightUpdated):
            raise PublishError(subject, "no ack")

    fleet = EngineFleet([engines.add("a"), engines.add("b")])
    pub = await VersionPublisher(HookBus(mem, hook), policy, fleet=fleet, pause="retract").start()
    with pytest.raises(PublishError):
        async with pub.update():
            pass
    recorder.assert_paused_at_the_alert_then_resumed()
    (alert,) = [e.event for e in await history(mem, subjects.alerts(policy))]
    assert (alert.reason, alert.resumed) == ("publish_failed", True)


async def test_a_fenced_publisher_alerts_before_it_resumes_the_fleet(engines: Engines, policy: str) -> None:
    mem = MemoryBus()
    recorder = Recorder(engines)
    zombie = await _publisher(engines, mem, policy, recorder)
    with pytest.raises(FencedError):
        async with zombie.update():
            # Another trainer takes the counter over and announces while the zombie holds the fleet paused.
            owner = await VersionPublisher(mem, policy, trainer_id="owner").start()
            async with owner.update():
                pass
    # The zombie's exit finds it is fenced: quarantine, alert, then resume.
    recorder.assert_paused_at_the_alert_then_resumed()
    (alert,) = [e.event for e in await history(mem, subjects.alerts(policy))]
    assert (alert.reason, alert.resumed) == ("fenced", True)


async def test_an_alert_the_bus_refuses_still_resumes_the_engines(engines: Engines, policy: str) -> None:
    mem = MemoryBus()
    recorder = Recorder(engines)

    async def hook(subject: str, event: Event) -> None:
        await recorder.hook(subject, event)
        if isinstance(event, FleetQuarantined):
            raise PublishError(subject, "bus away")

    fleet = EngineFleet([engines.add("a"), engines.add("b")])
    pub = await VersionPublisher(HookBus(mem, hook), policy, fleet=fleet, pause="retract").start()
    with pytest.raises(RuntimeError, match="boom") as info:
        async with pub.update():
            raise RuntimeError("boom")
    recorder.assert_paused_at_the_alert_then_resumed()
    assert any("FleetQuarantined alert was not published" in note for note in info.value.__notes__)


async def test_an_alert_the_bus_never_acknowledges_holds_the_fleet_for_a_bounded_time(
    engines: Engines, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weightbus.producers.update as update_module

    monkeypatch.setattr(update_module, "_CLEANUP_TIMEOUT", 0.5)
    mem = MemoryBus()
    recorder = Recorder(engines)

    async def hook(subject: str, event: Event) -> None:
        await recorder.hook(subject, event)
        if isinstance(event, FleetQuarantined):
            await asyncio.sleep(3600)  # a bus that takes the publish and never acknowledges it

    fleet = EngineFleet([engines.add("a"), engines.add("b")])
    pub = await VersionPublisher(HookBus(mem, hook), policy, fleet=fleet, pause="retract").start()

    async def failed_update() -> None:
        async with pub.update():
            raise RuntimeError("boom")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="boom") as info:
        await asyncio.wait_for(failed_update(), 30)  # bounded by the cleanup timeout, not by the bus
    assert time.monotonic() - started < 30
    recorder.assert_paused_at_the_alert_then_resumed()
    assert any("FleetQuarantined alert was not published" in note for note in info.value.__notes__)
