"""Stamping only what an engine holds, on a real nats-server: a number never goes on weights it does not name.

The weights an engine holds are observed, not assumed: each reference engine (``HashModel``) generates
from a hash of its weights' fingerprint and the adapter in use, so a greedy generation is compared with
what the weight set its label names would generate. After each scenario every engine that carries a
number must generate exactly what that number's weight set generates; the bus must say which engines
carry it (``WeightUpdated.engines``) and alert the ones left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping

import httpx
import pytest
import pytest_asyncio

from weightbus.bus import NatsBus, subjects
from weightbus.embedded.server import free_port
from weightbus.engines.sglang import SGLangClient
from weightbus.errors import EngineError, PushCoverageError
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.refengine.model import HashModel
from weightbus.schemas import EngineOutOfSync, FleetQuarantined, LoraAdapter, WeightUpdated, parse_version

from .conftest import Engines, history

pytestmark = pytest.mark.nats

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
TOKENS = 12
BOOT = "init"  # the HashModel's boot weights

# version -> (weights fingerprint, adapter or None): what each announced number names in a scenario.
Named = Mapping[int, tuple[str, LoraAdapter | None]]


def _generates(fingerprint: str, adapter: LoraAdapter | None) -> list[int]:
    model, context, out = HashModel(fingerprint), list(PROMPT), []
    for _ in range(TOKENS):
        token = model.next_token(context, adapter.path if adapter is not None else None)
        out.append(token)
        context.append(token)
    return out


async def _violations(clients: list[SGLangClient], named: Named) -> list[str]:
    """Every engine that carries a number but does not generate what that number's weights generate."""
    out: list[str] = []
    for client in clients:
        label = await client.weight_version()
        version = parse_version(label)
        if version is None:
            continue  # not a number: judged stale, whatever it holds
        fingerprint, adapter = named[version]
        try:
            got = await client.generate(
                input_ids=PROMPT,
                sampling_params={"max_new_tokens": TOKENS},
                lora_path=adapter.name if adapter is not None else None,
            )
        except EngineError as exc:
            out.append(f"{client.url} carries {label} but cannot serve its adapter: {exc}")
            continue
        if got.output_ids != _generates(fingerprint, adapter):
            out.append(f"{client.url} carries {label} but does not hold {fingerprint}+{adapter}")
    return out


async def _updates(bus: NatsBus, policy: str) -> dict[int, WeightUpdated]:
    events = [e.event for e in await history(bus, subjects.weights(policy))]
    return {e.version: e for e in events if isinstance(e, WeightUpdated)}


async def _alerts(bus: NatsBus, policy: str) -> list[object]:
    return [e.event for e in await history(bus, subjects.alerts(policy))]


class _EngineProcess:
    """``weightbus engine`` in a subprocess on a fixed port: killed with SIGKILL, restarted on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        args = [sys.executable, "-m", "weightbus", "engine", "--port", str(self.port), "--token-delay", "0"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        async with httpx.AsyncClient() as http:
            for _ in range(600):
                assert self.proc.poll() is None, "the engine exited"
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/health", timeout=1)).status_code == 200:
                        return
                await asyncio.sleep(0.05)
        raise AssertionError("the engine did not come up")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest_asyncio.fixture
async def processes() -> AsyncIterator[list[_EngineProcess]]:
    procs = [_EngineProcess(), _EngineProcess()]
    try:
        await asyncio.gather(*(p.start() for p in procs))
        yield procs
    finally:
        for p in procs:
            p.kill()


async def test_a_lora_push_after_an_engine_restart_never_stamps_the_restarted_engine(
    nats_bus: NatsBus, policy: str, processes: list[_EngineProcess]
) -> None:
    e1, e2 = processes
    async with httpx.AsyncClient(timeout=30) as http:
        fleet = EngineFleet([e1.url, e2.url], http=http)
        clients = list(fleet.clients)
        pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet, pause="retract").start()
        async with pub.update() as version:  # a full push of W1 to both engines
            assert version == 1
            for client in clients:
                await client.update_weights_from_disk("/ckpt/w1")
        e2.kill()
        await e2.start()  # back with its base weights and the label "default"
        adapter = LoraAdapter(name="math", path="/adapters/math-2")
        assert await pub.publish_lora(adapter) == 2
        named: dict[int, tuple[str, LoraAdapter | None]] = {1: ("/ckpt/w1", None), 2: ("/ckpt/w1", adapter)}
        assert await _violations(clients, named) == []
        assert await clients[1].weight_version() == "quarantine:2"
        updates = await _updates(nats_bus, policy)
        assert updates[2].engines == (e1.url,) and updates[2].lora == adapter
        alerts = await _alerts(nats_bus, policy)
        reasons = {(a.engine, a.reason, a.actual) for a in alerts if isinstance(a, EngineOutOfSync)}
        assert reasons == {(e2.url, "unexpected_label", "default"), (e2.url, "not_covered", "default")}
        # A full push covers it again.
        async with pub.update() as version:
            assert version == 3
            for client in clients:
                await client.update_weights_from_disk("/ckpt/w3")
        named[3] = ("/ckpt/w3", None)
        assert [await c.weight_version() for c in clients] == ["3", "3"]
        assert await _violations(clients, named) == []
        assert (await _updates(nats_bus, policy))[3].engines == (e1.url, e2.url)


async def test_in_a_lora_only_run_a_restarted_engine_with_the_new_adapter_holds_the_version(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    clients = [engines.add("e1"), engines.add("e2")]
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=EngineFleet(clients), pause="retract").start()
    a1, a2 = LoraAdapter(name="math-1", path="/adapters/math-1"), LoraAdapter(name="math-2", path="/adapters/math-2")
    assert await pub.publish_lora(a1) == 1
    engines.add("e2")  # restarted: the boot base, "default", no adapter
    assert await pub.publish_lora(a2) == 2
    assert [await c.weight_version() for c in clients] == ["2", "2"]
    assert await _violations(clients, {1: (BOOT, a1), 2: (BOOT, a2)}) == []
    assert (await _updates(nats_bus, policy))[2].engines == ("http://e1", "http://e2")
    # A restarted trainer reads the same from the history: every announcement since the first claim was LoRA.
    successor = await VersionPublisher(
        nats_bus, policy, trainer_id="t2", fleet=EngineFleet(clients), pause="retract"
    ).start()
    engines.add("e1")
    a4 = LoraAdapter(name="math-4", path="/adapters/math-4")
    assert await successor.publish_lora(a4) == 4  # 3 was reserved ahead by the predecessor
    assert [await c.weight_version() for c in clients] == ["4", "4"]
    assert await _violations(clients, {4: (BOOT, a4)}) == []


async def test_after_a_purged_history_a_restarted_engine_is_not_assumed_to_hold_the_base(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    clients = [engines.add("e1"), engines.add("e2")]
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=EngineFleet(clients)).start()
    a1 = LoraAdapter(name="math-1", path="/adapters/math-1")
    assert await pub.publish_lora(a1) == 1
    await pub.settle()  # the mark after the last announcement (deferred by mark_delay) is written
    await nats_bus.js.purge_stream(nats_bus.stream, subject=subjects.weights(policy))
    successor = await VersionPublisher(nats_bus, policy, trainer_id="t2", fleet=EngineFleet(clients)).start()
    engines.add("e2")
    a2 = LoraAdapter(name="math-2", path="/adapters/math-2")
    assert await successor.publish_lora(a2) == 3  # 2 was reserved ahead by the predecessor (the counter's mark)
    # The history no longer shows how the engines booted: only the engine at 1 is known to hold the base.
    assert [await c.weight_version() for c in clients] == ["3", "quarantine:3"]
    assert await _violations(clients, {3: (BOOT, a2)}) == []
    assert (await _updates(nats_bus, policy))[3].engines == ("http://e1",)


async def test_publish_lora_with_the_base_pushes_the_missing_part_first(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    clients = [engines.add("e1"), engines.add("e2")]
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=EngineFleet(clients), pause="retract").start()
    async with pub.update() as version:
        for client in clients:
            await client.update_weights_from_disk("/ckpt/w1", weight_version=version)
    engines.add("e2")
    adapter = LoraAdapter(name="math", path="/adapters/math-2")
    assert await pub.publish_lora(adapter, base="/ckpt/w1") == 2
    assert [await c.weight_version() for c in clients] == ["2", "2"]
    assert await _violations(clients, {2: ("/ckpt/w1", adapter)}) == []
    assert (await _updates(nats_bus, policy))[2].engines == ("http://e1", "http://e2")
    # Only the restarted engine got the base, and without a version (it is stamped with the others).
    (load,) = engines.states["http://e2"].recorded("/update_weights_from_disk")
    assert load.body["model_path"] == "/ckpt/w1" and load.body["weight_version"] is None
    assert len(engines.states["http://e1"].recorded("/update_weights_from_disk")) == 1  # the push of 1
    assert not any(getattr(a, "reason", None) == "not_covered" for a in await _alerts(nats_bus, policy))


async def test_a_delta_that_covers_no_engine_announces_nothing_and_quarantines_the_fleet(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    clients = [engines.add("e1"), engines.add("e2")]
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=EngineFleet(clients), pause="retract").start()
    async with pub.update() as version:
        for client in clients:
            await client.update_weights_from_disk("/ckpt/w1", weight_version=version)
    engines.add("e1")
    engines.add("e2")  # both restarted
    with pytest.raises(PushCoverageError) as info:
        await pub.publish_lora(LoraAdapter(name="math", path="/adapters/math-2"))
    assert info.value.missing == ("http://e1", "http://e2")
    assert [await c.weight_version() for c in clients] == ["quarantine:2", "quarantine:2"]
    assert sorted(await _updates(nats_bus, policy)) == [1]
    (quarantined,) = [a for a in await _alerts(nats_bus, policy) if isinstance(a, FleetQuarantined)]
    assert quarantined.version == 2 and quarantined.resumed
    # A disk delta (not an adapter) on engines that no longer hold the previous weights: the same.
    with pytest.raises(PushCoverageError):
        async with pub.update(push="delta") as version:
            for client in clients:
                await client.update_weights_from_disk("/ckpt/delta-3")
    assert [await c.weight_version() for c in clients] == ["quarantine:3", "quarantine:3"]
