"""Fleets against strict reference engines: wire bodies, update ordering, out-of-sync engines, LoRA, routers."""

from __future__ import annotations

import httpx
import pytest

from weightbus.bus import MemoryBus, subjects
from weightbus.bus.protocol import Bus
from weightbus.errors import EngineError, EngineOutOfSyncError
from weightbus.producers import EngineFleet, VersionPublisher, stamp_and_verify
from weightbus.schemas import EngineOutOfSync, Event, LoraAdapter, PublisherClaimed, WeightUpdated

from .conftest import Engines, HookBus, history


async def test_stamp_sends_the_exact_body_and_reads_back(engines: Engines) -> None:
    fleet = EngineFleet([engines.add("a"), engines.add("b")])
    stamps = await stamp_and_verify(fleet, 7)
    assert [(s.engine, s.read_back, s.ok) for s in stamps] == [("http://a", "7", True), ("http://b", "7", True)]
    for url in fleet.urls:
        reqs = engines.states[url].requests
        assert [(r.method, r.path, r.body) for r in reqs] == [
            ("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
            ("GET", "/model_info", None),
        ]


async def test_pause_and_resume_bodies(engines: Engines) -> None:
    fleet = EngineFleet([engines.add("a")])
    await fleet.pause("retract")
    assert engines.states["http://a"].pause_mode == "retract"
    await fleet.resume()
    reqs = engines.states["http://a"].requests
    assert [(r.path, r.body) for r in reqs] == [
        ("/pause_generation", {"mode": "retract"}),
        ("/continue_generation", {}),
    ]
    assert engines.states["http://a"].pause_mode is None


async def test_update_order_is_pause_push_stamp_verify_publish_resume(engines: Engines, policy: str) -> None:
    mem = MemoryBus()
    a = engines.add("a")
    state = engines.states["http://a"]
    seen: list[tuple[str, object]] = []

    async def observe(subject: str, event: Event) -> None:
        if isinstance(event, WeightUpdated):
            # At the publish the engine serves v but is still paused: no v-stamped sample can exist yet.
            seen.append(("publish", (state.weight_version, state.pause_mode, len(state.requests))))

    pub = VersionPublisher(HookBus(mem, observe), policy, fleet=EngineFleet([a]), pause="in_place")
    await pub.start()
    async with pub.update() as version:
        assert state.pause_mode == "in_place"
        await a.update_weights_from_disk("/ckpt/step-1")
    assert seen == [("publish", ("1", "in_place", 4))]
    assert engines.paths("http://a") == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/model_info",
        "/continue_generation",
    ]
    assert state.requests[0].body == {"mode": "in_place"}
    assert state.pause_mode is None and version == 1
    event = (await mem.last(subjects.weights(policy))).event
    assert event.engines == ("http://a",) and event.version == 1


async def test_exception_inside_update_resumes_and_publishes_nothing(engines: Engines, bus: Bus, policy: str) -> None:
    a = engines.add("a")
    pub = await VersionPublisher(bus, policy, fleet=EngineFleet([a]), pause="retract").start()
    with pytest.raises(RuntimeError, match="nccl"):
        async with pub.update():
            raise RuntimeError("nccl broadcast failed")
    assert engines.paths("http://a") == ["/pause_generation", "/continue_generation"]
    assert isinstance((await bus.last(subjects.weights(policy))).event, PublisherClaimed)
    assert pub.version is None and pub.next_version == 1


async def test_an_engine_that_ignores_the_stamp_is_caught(engines: Engines, bus: Bus, policy: str) -> None:
    good, bad = engines.add("good"), engines.add("bad", ignore_version_updates=True)
    pub = await VersionPublisher(bus, policy, trainer_id="t", fleet=EngineFleet([good, bad]), pause="retract").start()
    claim_seq = (await bus.last(subjects.weights(policy))).seq
    with pytest.raises(EngineOutOfSyncError) as info:
        async with pub.update() as version:
            assert version == 1
    assert (info.value.url, info.value.expected, info.value.actual) == ("http://bad", "1", "default")
    # Nothing announced, the version is not used up, and both engines generate again.
    assert (await bus.last(subjects.weights(policy))).seq == claim_seq
    assert pub.next_version == 1
    assert engines.states["http://good"].pause_mode is None and engines.states["http://bad"].pause_mode is None
    alerts = [e.event for e in await history(bus, subjects.alerts(policy))]
    assert alerts == [
        EngineOutOfSync(
            policy=policy,
            engine="http://bad",
            expected="1",
            actual="default",
            trainer_id="t",
            published_at=alerts[0].published_at,
        )
    ]
    applied = sorted(
        (e.event.engine, e.event.read_back, e.event.ok) for e in await history(bus, subjects.applied(policy))
    )
    assert applied == [("http://bad", "default", False), ("http://good", "1", True)]


async def test_an_engine_that_does_not_answer_is_caught(engines: Engines, policy: str) -> None:
    mem = MemoryBus()
    fleet = EngineFleet([engines.add("a"), "http://gone"], http=engines.http)
    pub = await VersionPublisher(mem, policy, fleet=fleet).start()
    with pytest.raises(EngineError) as info:
        async with pub.update():
            pass
    assert info.value.url == "http://gone" and info.value.status is None
    (alert,) = [e.event for e in await history(mem, subjects.alerts(policy))]
    assert alert.engine == "http://gone" and alert.actual is None and "no response" in alert.error
    assert not any(isinstance(e.event, WeightUpdated) for e in await history(mem, subjects.weights(policy)))


async def test_lora_push_loads_stamps_reads_back_and_names_the_adapter(engines: Engines, bus: Bus, policy: str) -> None:
    a, b = engines.add("a"), engines.add("b")
    pub = await VersionPublisher(bus, policy, fleet=EngineFleet([a, b]), pause="retract").start()
    async with pub.update() as version:
        assert version == 1
    adapter = LoraAdapter(name="math", path="/adapters/math-1")
    assert await pub.publish_lora(adapter) == 2
    for url in ("http://a", "http://b"):
        state = engines.states[url]
        assert state.weight_version == "2"
        assert state.lora_adapters["math"].path == "/adapters/math-1"
        assert engines.paths(url)[-5:] == [
            "/pause_generation",
            "/load_lora_adapter",
            "/update_weight_version",
            "/model_info",
            "/continue_generation",
        ]
        assert state.recorded("/load_lora_adapter")[0].body == {
            "lora_name": "math",
            "lora_path": "/adapters/math-1",
            "pinned": False,
        }
    event = (await bus.last(subjects.weights(policy))).event
    assert isinstance(event, WeightUpdated) and (event.version, event.lora) == (2, adapter)
    applied = [e.event for e in await history(bus, subjects.applied(policy)) if e.event.version == 2]
    assert {(x.engine, x.read_back, x.lora) for x in applied} == {
        ("http://a", "2", adapter),
        ("http://b", "2", adapter),
    }
    # Full-weight and LoRA pushes share one sequence.
    async with pub.update() as version:
        assert version == 3


async def test_lora_update_written_by_hand_and_a_refused_load(engines: Engines, policy: str) -> None:
    mem = MemoryBus()
    fleet = EngineFleet([engines.add("a")])
    pub = await VersionPublisher(mem, policy, fleet=fleet).start()
    adapter = LoraAdapter(name="x", path="/p")
    async with pub.update(lora=adapter) as version:
        await fleet.load_lora_adapter(adapter.name, adapter.path)
    assert version == 1 and engines.states["http://a"].weight_version == "1"
    with pytest.raises(EngineError, match="already exists"):
        await pub.publish_lora(adapter)
    assert pub.version == 1 and engines.states["http://a"].weight_version == "1"
    with pytest.raises(ValueError, match="no path"):
        await pub.publish_lora(LoraAdapter(name="y"))


async def test_fleet_from_router_talks_to_workers_only(engines: Engines) -> None:
    engines.add("w1")
    engines.add("w2")
    router_requests: list[str] = []

    def router(request: httpx.Request) -> httpx.Response:
        router_requests.append(f"{request.method} {request.url.path}")
        if request.url.path == "/workers":
            return httpx.Response(200, json={"workers": [{"url": "http://w1"}, {"url": "http://w2/"}]})
        return httpx.Response(404, json={"error": "not found"})

    engines.routes["router"] = router
    fleet = await EngineFleet.from_router("http://router", http=engines.http)
    assert fleet.urls == ("http://w1", "http://w2")
    await stamp_and_verify(fleet, 3)
    assert router_requests == ["GET /workers"]
    assert engines.states["http://w1"].weight_version == "3" and engines.states["http://w2"].weight_version == "3"


async def test_a_failed_pause_resumes_the_engines_that_paused(engines: Engines) -> None:
    fleet = EngineFleet([engines.add("a"), "http://gone"], http=engines.http)
    with pytest.raises(EngineError):
        await fleet.pause("retract")
    assert engines.paths("http://a") == ["/pause_generation", "/continue_generation"]


def test_a_fleet_refuses_duplicates_and_emptiness() -> None:
    with pytest.raises(ValueError, match="twice"):
        EngineFleet(["http://a", "http://a/"])
    with pytest.raises(ValueError, match="at least one"):
        EngineFleet([])
