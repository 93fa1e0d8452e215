"""A tracker survives a nats-server restart: it keeps its version and follows updates published afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated
from weightbus.bus import BusMetrics, connect, subjects
from weightbus.consumers.tracker.tracker import VersionTracker
from weightbus.embedded.server import EmbeddedNats

pytestmark = pytest.mark.nats


async def test_tracker_follows_across_a_server_restart(
    tmp_path: Path, policy: str, registry: CollectorRegistry
) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "store").start()
    try:
        bus = await connect(server.url, metrics=BusMetrics(registry), connect_timeout=5)
        try:
            await bus.publish(subjects.weights(policy), updated(1, policy=policy), msg_id=f"{policy}:1")
            async with VersionTracker(bus, policy, registry=registry, retry_delay=0.1) as tracker:
                assert await tracker.wait_ready(5) == 1
                server.kill()
                server.start()  # same port, same store
                await bus.publish(subjects.weights(policy), updated(2, policy=policy), msg_id=f"{policy}:2")
                assert await tracker.wait_for(2, 15) == 2
        finally:
            await bus.aclose()
    finally:
        server.stop()
