"""Reusable pieces of the chaos suite: servers and clusters with their own stores, kills by pid, a recorder of
every event of a policy, the invariants checked on what was recorded, and a figure report per scenario.

Every scenario asserts from what the bus stored and what the recorder received, never from logs:
0 versions lost, duplicated or regressed; every tracker ends at the last version; bounded memory.
Figures (recovery time, failed updates, ...) are printed as one ``CHAOS`` line per scenario and, when
``WEIGHTBUS_CHAOS_REPORT`` names a file, appended to it as JSON lines (docs/operations.md keeps the table).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio

from weightbus.bus import Deliver, Envelope, NatsBus, connect, subjects
from weightbus.embedded.cluster import EmbeddedCluster
from weightbus.embedded.server import EmbeddedNats
from weightbus.schemas import WeightUpdated

__all__ = [
    "DisconnectMark",
    "EventRecorder",
    "Figures",
    "assert_versions_exact",
    "kill_pid",
    "nats_py_tasks",
    "report",
    "rss_mib",
    "stream_leader",
]

CLUSTER_CONF = Path(__file__).parents[2] / "ops" / "nats" / "cluster.conf"


def kill_pid(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` (a process this test started); a process already gone is fine."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return


def nats_py_tasks() -> list[asyncio.Task[Any]]:
    """The running tasks whose coroutine is nats-py's (a client's read loop, pinger, flusher, reconnection...)."""
    root = os.path.dirname(nats.__file__)
    found = []
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "cr_code", None)
        if not task.done() and code is not None and code.co_filename.startswith(root):
            found.append(task)
    return found


class DisconnectMark(logging.Handler):
    """Records the loop time of weightbus's "disconnected from NATS" warning: nats-py logs it through the
    disconnected callback in the same step in which its reconnection task starts waiting ``reconnect_time_wait``
    before the first attempt, so the attempt's moment is known to within the loop's timer resolution."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("disconnected from NATS"):
            self.at = asyncio.get_running_loop().time()

    def __enter__(self) -> DisconnectMark:
        logging.getLogger("weightbus.bus").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("weightbus.bus").removeHandler(self)


def rss_mib() -> float:
    """Resident memory of this process now, in MiB (from /proc; the peak from getrusage elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def stream_leader(bus: NatsBus) -> str | None:
    """The server name leading the stream (``cluster.leader`` of its info); None on a single server."""
    info = await bus.js.stream_info(bus.stream)
    return info.cluster.leader if info.cluster is not None else None


@dataclass
class EventRecorder:
    """Records every event on ``weightbus.<policy>.>`` from its own connection, from the first stored one.

    ``events`` holds ``(subject, stream sequence, event, receive time)`` in arrival order.
    """

    bus: NatsBus
    policy: str
    events: list[tuple[str, int | None, Any, float]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def start(self) -> EventRecorder:
        sub = self.bus.subscribe(f"weightbus.{self.policy}.>", deliver=Deliver.ALL)
        await sub.start()

        async def _run() -> None:
            async with sub:
                async for env in sub:
                    self._add(env)

        self._task = asyncio.create_task(_run())
        return self

    def _add(self, env: Envelope) -> None:
        self.events.append((env.subject, env.seq, env.event, time.monotonic()))

    def weight_versions(self) -> list[int]:
        """Versions of the ``WeightUpdated`` events on the weights subject, in arrival order."""
        weights = subjects.weights(self.policy)
        return [e.version for s, _, e, _ in self.events if s == weights and isinstance(e, WeightUpdated)]

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def assert_versions_exact(versions: list[int], last: int, announced: list[int] | None = None) -> None:
    """The recorded versions are exactly the announced ones (1..last by default), each once, never going back.

    A number may be skipped only by an update that failed after its reservation (never reissued): pass
    the versions the loop saw announced, and they must be exactly what the bus recorded.
    """
    expected = announced if announced is not None else list(range(1, last + 1))
    dup = sorted({v for v in versions if versions.count(v) > 1})
    back = [(a, b) for a, b in zip(versions, versions[1:], strict=False) if b <= a]
    lost = sorted(set(expected) - set(versions))
    assert not dup, f"duplicated versions {dup}"
    assert not back, f"regressions {back[:5]}"
    assert not lost, f"lost versions {lost}"
    assert versions == expected


@dataclass
class Figures:
    """What a scenario measured; printed and optionally appended to ``WEIGHTBUS_CHAOS_REPORT``."""

    scenario: str
    values: dict[str, Any] = field(default_factory=dict)


def report(scenario: str, **values: Any) -> Figures:
    """Print one ``CHAOS`` line with the scenario's figures (and append them to the report file, if any)."""
    figures = Figures(scenario, values)
    print(f"CHAOS {scenario}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    target = os.environ.get("WEIGHTBUS_CHAOS_REPORT")
    if target:
        with open(target, "a") as out:
            out.write(json.dumps({"scenario": scenario, **values}) + "\n")
    return figures


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmbeddedCluster]:
    """Three nats-servers from ops/nats/cluster.conf on free loopback ports, each with its own store."""
    with EmbeddedCluster(tmp_path / "cluster", config=CLUSTER_CONF) as running:
        yield running


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server of this test alone, with a store that survives ``kill()`` + ``start()``."""
    server = EmbeddedNats(store_dir=tmp_path / "store", log_file=tmp_path / "nats.log").start()
    yield server
    server.stop()


@pytest_asyncio.fixture
async def open_buses() -> AsyncIterator[list[NatsBus]]:
    """A list the test appends its connections to; all are closed at the end."""
    buses: list[NatsBus] = []
    yield buses
    for bus in buses:
        await bus.aclose()


async def connect_many(url: str, n: int, into: list[NatsBus], **kwargs: Any) -> list[NatsBus]:
    """``n`` separate connections (one per simulated process), registered in ``into`` for closing."""
    made = [await connect(url, name=f"chaos-{i}", **kwargs) for i in range(n)]
    into.extend(made)
    return made
