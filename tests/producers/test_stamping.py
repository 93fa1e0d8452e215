"""Fleets against strict reference engines: wire bodies, update ordering, out-of-sync engines, LoRA, routers."""

from __future__ import annotations

import httpx
import pytest

from weightbus.bus import MemoryBus, subjects
from weightbus.bus.protocol import Bus
from weightbus.errors import EngineError, EngineOutOfSyncError
from weightbus.producers import EngineFleet, VersionPublisher, stamp_and_verify
from weightbus.schemas import EngineOutOfSync, Event, FleetQuarantined, LoraAdapter, VersionReserved, WeightUpdated

from .conftest import Engines, HookBus, history


async def test_stamp_sends_the_exact_body_and_reads_back(engines: Engines) -> None:
    fleet = EngineFleet([engines.add("a"), engines.add("b")])
    stamps = await stamp_and_verify(fleet, 7)
    assert [(s.engine, s.read_back, s.ok) for s in stamps] == [("http://a", "7", True), ("http://b", "7", True)]
    for url in fleet.urls:
        reqs = engines.states[url].requests
        assert [(r.method, r.path, r.body) for r in reqs] == [
            ("GET", "/model_info", None),
            ("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
            ("GET", "/model_info", None),
        ]
    # Engines that already carry the label are read, not stamped again.
    again = await stamp_and_verify(fleet, 7)
    assert [(s.ok, s.stamped) for s in again] == [(True, False), (True, False)]
    assert engines.paths("http://a")[-1:] == ["/model_info"] and len(engines.paths("http://a")) == 4


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
    assert seen == [("publish", ("1", "in_place", 8))]
    assert engines.paths("http://a") == [
        "/model_info",  # start(): the counter resumes above any label an engine carries
        "/pause_generation",
        "/model_info",  # before the push: a restarted engine's "default" is alerted, not hidden by the push
        "/update_weight_version",  # pending:1: nothing served between the push and the stamp carries a number
        "/update_weights_from_disk",
        "/model_info",
        "/update_weight_version",
        "/model_info",
        "/continue_generation",
    ]
    assert state.requests[1].body == {"mode": "in_place"}
    assert state.requests[3].body == {"new_version": "pending:1", "abort_all_requests": False}
    assert state.pause_mode is None and version == 1
    event = (await mem.last(subjects.weights(policy))).event
    assert event.engines == ("http://a",) and event.version == 1
    # A push that carries weight_version folds the stamp into the load: one read, no relabel at all.
    async with pub.update(labels=True) as version:
        await a.update_weights_from_disk("/ckpt/step-2", weight_version=version)
    assert engines.paths("http://a")[-5:] == [
        "/pause_generation",
        "/model_info",
        "/update_weights_from_disk",
        "/model_info",
        "/continue_generation",
    ]
    assert state.weight_version == "2"


async def test_exception_inside_update_quarantines_resumes_and_announces_nothing(
    engines: Engines, bus: Bus, policy: str
) -> None:
    a = engines.add("a")
    pub = await VersionPublisher(bus, policy, trainer_id="t", fleet=EngineFleet([a]), pause="retract").start()
    with pytest.raises(RuntimeError, match="nccl"):
        async with pub.update():
            raise RuntimeError("nccl broadcast failed")
    # The push may have half-happened: the engine never serves again under a number.
    assert engines.paths("http://a") == [
        "/model_info",
        "/pause_generation",
        "/model_info",
        "/update_weight_version",
        "/update_weight_version",
        "/continue_generation",
    ]
    assert engines.states["http://a"].requests[3].body == {"new_version": "pending:1", "abort_all_requests": False}
    assert engines.states["http://a"].requests[4].body == {"new_version": "quarantine:1", "abort_all_requests": False}
    assert engines.states["http://a"].weight_version == "quarantine:1"
    assert isinstance((await bus.last(subjects.weights(policy))).event, VersionReserved)
    assert pub.state.version is None and pub.state.next_version == 2
    (alert,) = [e.event for e in await history(bus, subjects.alerts(policy))]
    assert isinstance(alert, FleetQuarantined)
    assert (alert.label, alert.reason, alert.version, alert.engines, alert.resumed) == (
        "quarantine:1",
        "update_failed",
        1,
        ("http://a",),
        True,
    )
    # The owner's next successful update restores a number.
    async with pub.update() as version:
        assert version == 2
    assert engines.states["http://a"].weight_version == "2"


async def test_an_engine_that_ignores_the_stamp_is_caught(engines: Engines, bus: Bus, policy: str) -> None:
    good, bad = engines.add("good"), engines.add("bad", ignore_version_updates=True)
    pub = await VersionPublisher(bus, policy, trainer_id="t", fleet=EngineFleet([good, bad]), pause="retract").start()
    with pytest.raises(EngineOutOfSyncError) as info:
        async with pub.update() as version:
            assert version == 1
    # It never took the pending label either, so it is never stamped.
    assert (info.value.url, info.value.expected, info.value.actual) == ("http://bad", "pending:1", "default")
    # Nothing announced, the number is used up, the good engine is quarantined, both generate again.
    assert not any(isinstance(e.event, WeightUpdated) for e in await history(bus, subjects.weights(policy)))
    assert pub.state.next_version == 2
    assert engines.states["http://good"].weight_version == "quarantine:1"
    assert engines.states["http://good"].pause_mode is None and engines.states["http://bad"].pause_mode is None
    alerts = [e.event for e in await history(bus, subjects.alerts(policy))]
    assert alerts[0] == EngineOutOfSync(
        policy=policy,
        engine="http://bad",
        expected="1",
        actual="default",
        trainer_id="t",
        published_at=alerts[0].published_at,
        error=alerts[0].error,
    )
    assert "'pending:1'" in alerts[0].error
    assert isinstance(alerts[1], FleetQuarantined) and alerts[1].reason == "update_failed"
    applied = sorted(
        (e.event.engine, e.event.read_back, e.event.ok) for e in await history(bus, subjects.applied(policy))
    )
    assert applied == [("http://bad", "default", False), ("http://good", "1", True)]


async def test_an_engine_that_does_not_answer_is_caught(engines: Engines, policy: str) -> None:
    mem = MemoryBus()
    fleet = EngineFleet([engines.add("a"), "http://gone"], http=engines.http)
    pub = await VersionPublisher(mem, policy, fleet=fleet).start()
    # Its pending relabel fails before the push: the block never runs, the fleet is quarantined.
    with pytest.raises(EngineError) as info:
        async with pub.update():
            pytest.fail("no push to a fleet whose labels cannot be set")
    assert info.value.url == "http://gone" and info.value.status is None
    (quarantined,) = [e.event for e in await history(mem, subjects.alerts(policy))]
    assert quarantined.engines == ("http://a",) and quarantined.failed == ("http://gone",)
    assert "no response" in quarantined.detail
    # A push that labels the engines itself needs no relabel: the stamp's read-back catches the engine.
    with pytest.raises(EngineError) as info:
        async with pub.update(labels=True) as version:
            await fleet.clients[0].update_weights_from_disk("/ckpt", weight_version=version)
    assert info.value.url == "http://gone" and info.value.status is None
    alert = [e.event for e in await history(mem, subjects.alerts(policy))][1]
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
        assert engines.paths(url)[-8:] == [
            "/pause_generation",
            "/model_info",
            "/update_weight_version",
            "/load_lora_adapter",
            "/model_info",
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
    assert pub.state.version == 1 and engines.states["http://a"].weight_version == "quarantine:2"
    # Re-pushing new adapter weights under the same name: unload first.
    assert await pub.publish_lora(LoraAdapter(name="x", path="/p2"), replace=True) == 3
    assert engines.states["http://a"].lora_adapters["x"].path == "/p2"
    assert engines.states["http://a"].weight_version == "3"
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


async def test_the_update_api_refuses_what_it_cannot_mean(engines: Engines, policy: str) -> None:
    mem = MemoryBus()
    fleet = EngineFleet([engines.add("a"), engines.add("b")])
    pub = await VersionPublisher(mem, policy, fleet=fleet).start()
    with pytest.raises(ValueError, match="delta"):
        pub.update(lora=LoraAdapter(name="x", path="/x"), push="full")
    with pytest.raises(ValueError, match="push must be"):
        pub.update(push="half")  # type: ignore[arg-type]
    upd = pub.update()
    with pytest.raises(RuntimeError, match="inside"):
        await upd.before_push()
    async with upd as version:
        assert upd.missing == ()  # a full push covers every engine
        with pytest.raises(ValueError, match="not missing"):
            upd.pushed_missing("http://a")
        await upd.before_push()  # the owner: one fence read, the pending label again
        assert {s.weight_version for s in engines.states.values()} == {f"pending:{version}"}
    assert {s.weight_version for s in engines.states.values()} == {"1"}
    # A delta from 1 covers both; after b restarts it covers only a, and the block may push b the rest.
    async with (delta := pub.update(push="delta")) as version:
        assert delta.missing == ()
    engines.add("b")
    async with (delta := pub.update(push="delta")) as version:
        assert delta.missing == ("http://b",)
        await fleet.load_base("/ckpt/full", engines=["http://b"])
        delta.pushed_missing("http://b")
    assert engines.states["http://b"].weight_version == str(version)
    assert (await mem.last(subjects.weights(policy))).event.engines == ("http://a", "http://b")
