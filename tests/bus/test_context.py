"""Every bus is an async context manager that closes on leaving, and ``aclose()`` is the one close verb."""

from __future__ import annotations

import inspect
import os
import socket

import pytest
from prometheus_client import CollectorRegistry

from weightbus.bus import MemoryBus
from weightbus.bus.identity import process_identity
from weightbus.bus.metrics import BusMetrics
from weightbus.bus.nats import connect
from weightbus.consumers.admission.shared import SharedBudget
from weightbus.consumers.tracker import VersionTracker


async def test_memory_bus_closes_on_leaving() -> None:
    async with MemoryBus() as bus:
        sub = bus.subscribe("weightbus.p.weights")
    with pytest.raises(StopAsyncIteration):
        await sub.__anext__()


@pytest.mark.nats
async def test_nats_bus_closes_on_leaving(nats_url: str) -> None:
    async with await connect(nats_url, metrics=BusMetrics(CollectorRegistry())) as bus:
        assert await bus.last_seq("weightbus.p.weights") == 0
    assert bus.client.is_closed


@pytest.mark.parametrize("cls", [MemoryBus, VersionTracker, SharedBudget])
def test_async_objects_close_with_aclose_only(cls: type) -> None:
    assert inspect.iscoroutinefunction(cls.aclose)
    assert not hasattr(cls, "close") and not hasattr(cls, "stop")


def test_process_identity_is_host_and_pid() -> None:
    base = f"{socket.gethostname()}:{os.getpid()}"
    assert process_identity() == base
    assert process_identity("miles") == f"miles:{base}"
