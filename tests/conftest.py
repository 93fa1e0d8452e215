"""Shared fixtures: a real nats-server per test session, fresh registries, unique policy ids.

The server is started by this session on 127.0.0.1 with a free port and a temporary store, and stopped
by pid; the machine's own NATS on 4222 is never used.
"""

from __future__ import annotations

import logging
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

# Imported here, at a shallow stack: hypothesis' pytest plugin imports it lazily at the end of a session that
# never needed it, deep in pytest's hooks, where CPython 3.11.7's parser fails with "AST constructor recursion
# depth mismatch" while pytest rewrites it, and the run exits 1 after every test passed.
import hypothesis  # noqa: F401
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from weightbus.bus import BusMetrics, MemoryBus, NatsBus, connect
from weightbus.embedded.server import EmbeddedNats

# A suite started in the background by a non-interactive shell (`make test &`, nohup in a script) inherits SIGINT
# ignored, and every process it starts would too: Python then never raises KeyboardInterrupt, and the tests that
# interrupt a command with SIGINT hang until their timeout. A caught signal is reset to its default across exec,
# so the commands under test get the disposition a terminal gives them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def policy() -> str:
    return f"p-{uuid.uuid4().hex[:12]}"


@pytest_asyncio.fixture
async def nats_bus(nats_url: str, registry: CollectorRegistry) -> AsyncIterator[NatsBus]:
    bus = await connect(nats_url, metrics=BusMetrics(registry), connect_timeout=5)
    yield bus
    await bus.aclose()


@pytest_asyncio.fixture(params=["memory", pytest.param("nats", marks=pytest.mark.nats)])
async def bus(request: pytest.FixtureRequest, registry: CollectorRegistry) -> AsyncIterator[MemoryBus | NatsBus]:
    """The contract fixture: every test using it runs on both buses."""
    if request.param == "memory":
        mem = MemoryBus(BusMetrics(registry))
        yield mem
        await mem.aclose()
    else:
        url = request.getfixturevalue("nats_url")
        nb = await connect(url, metrics=BusMetrics(registry), connect_timeout=5)
        yield nb
        await nb.aclose()


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """CLI commands install their own root handler (``setup_logging``): keep it from leaking into other tests."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
