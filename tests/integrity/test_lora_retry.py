"""A ``publish_lora`` that fails after its load leaves no adapter behind: a plain retry works (reference engines).

The load of an adapter is a delta push; when it covers no engine (both restarted after a full push) the
update fails its coverage check and nothing is announced. The adapter it loaded used to stay loaded, so the
retry, with the base this time, failed with SGLang's "already exists".
"""

from __future__ import annotations

import pytest

from weightbus.bus import NatsBus, subjects
from weightbus.errors import PushCoverageError
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.schemas import LoraAdapter, WeightUpdated

from .conftest import Engines, history

pytestmark = pytest.mark.nats


async def test_a_lora_push_that_fails_its_coverage_check_unloads_it_and_a_plain_retry_works(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    clients = [engines.add("e1"), engines.add("e2")]
    fleet = EngineFleet(clients)
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t", fleet=fleet, pause="retract").start()
    async with pub.update() as version:
        for client in clients:
            await client.update_weights_from_disk("/ckpt/w1", weight_version=version)
    engines.add("e1")
    engines.add("e2")  # both restarted: neither holds the base the adapter is a delta of
    adapter = LoraAdapter(name="math", path="/adapters/math-2")
    with pytest.raises(PushCoverageError):
        await pub.publish_lora(adapter)
    # Nothing announced, and the load this call made is undone on every engine.
    assert [engines.states[url].lora_adapters for url in fleet.urls] == [{}, {}]
    # The retry, with the base: no "already exists"; 2 was burned by the failed update.
    assert await pub.publish_lora(adapter, base="/ckpt/w1") == 3
    assert [list(engines.states[url].lora_adapters) for url in fleet.urls] == [["math"], ["math"]]
    assert [await c.weight_version() for c in clients] == ["3", "3"]
    updates = [e.event for e in await history(nats_bus, subjects.weights(policy)) if isinstance(e.event, WeightUpdated)]
    assert [(u.version, u.lora) for u in updates] == [(1, None), (3, adapter)]
