"""Chaos: a publish that times out while nats-server is down is retried and lands exactly once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from weightbus.bus import connect, subjects
from weightbus.embedded.server import EmbeddedNats
from weightbus.producers import VersionPublisher
from weightbus.schemas import WeightUpdated

from .conftest import history

pytestmark = [pytest.mark.slow, pytest.mark.nats]


async def test_publish_across_a_server_restart_lands_once(
    tmp_path: Path, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="weightbus.bus")
    server = EmbeddedNats(store_dir=tmp_path / "js").start()
    bus = await connect(server.url, publish_timeout=0.5, publish_attempts=20)
    try:
        pub = await VersionPublisher(bus, policy, trainer_id="t").start()
        for _ in range(2):
            async with pub.update():
                pass
        update = pub.update()
        assert await update.__aenter__() == 3
        server.kill()
        publishing = asyncio.create_task(update.__aexit__(None, None, None))
        await asyncio.sleep(1.2)  # at least two publish timeouts while the server is down
        assert not publishing.done()
        await asyncio.to_thread(server.start)
        await asyncio.wait_for(publishing, 20)
        assert pub.state.version == 3
        assert any("retrying with the same Nats-Msg-Id" in r.getMessage() for r in caplog.records)
        async with pub.update() as version:
            assert version == 4
        events = [e.event for e in await history(bus, subjects.weights(policy), idle=1.0)]
        versions = [e.version for e in events if isinstance(e, WeightUpdated)]
        assert versions == [1, 2, 3, 4]
    finally:
        await bus.aclose()
        server.stop()
