"""The rollout process exports the bus metrics: an invalid payload it skipped is counted on its registry.

Before, ``run_rollout`` connected without ``BusMetrics``: the invalid payload was logged but counted on a private
registry, so the dashboard's "Invalid events" panel stayed empty.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from weightbus.bus import connect, subjects
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.rl.rollout import RolloutConfig, run_rollout

pytestmark = pytest.mark.nats


def _invalid_events(registry: CollectorRegistry) -> float:
    return sum(
        sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == "weightbus_invalid_events_total"
    )


async def test_the_rollout_counts_an_invalid_weights_payload_on_its_registry(
    nats_url: str, policy: str, registry: CollectorRegistry
) -> None:
    publisher = await connect(nats_url)
    # A version below zero: decodes as JSON, fails the typed decode.
    bad = b'{"type":"weight.updated","policy":"%s","version":-1,"epoch":0,"trainer_id":"t","published_at":1.0}'
    await publisher.publish_raw(subjects.weights(policy), bad % policy.encode(), msg_id=f"{policy}:bad")
    # Any HTTP server as the router: the rollout waits for one to answer, and nothing is generated before v1.
    router = ServedEngine(create_app(EngineState())).start()
    config = RolloutConfig(router_url=router.url, nats_url=nats_url, policy=policy)
    rollout = asyncio.create_task(run_rollout(config, registry=registry))
    try:
        async with asyncio.timeout(20):
            while _invalid_events(registry) < 1:
                assert not rollout.done(), rollout.exception()
                await asyncio.sleep(0.05)
        assert _invalid_events(registry) == 1
    finally:
        rollout.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await rollout
        await publisher.aclose()
        router.stop()
