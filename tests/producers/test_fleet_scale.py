"""Fleets of many engines over real HTTP: every engine of a step at once, a bound on requests in flight, small pools.

The engines are ``bench/fake_sglang.py`` (one process, one port per engine, the 0.5.23 bodies); what they saw is read
from the timestamps and counters that server records itself, never from timing the client.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from weightbus.bus import MemoryBus
from weightbus.bus.protocol import PublishAck
from weightbus.errors import EngineOutOfSyncError
from weightbus.producers import EngineFleet
from weightbus.producers.stamping import alert_unexpected_labels, stamp_and_verify
from weightbus.schemas import Event

from .conftest import Engines

FAKE = Path(__file__).resolve().parents[2] / "bench" / "fake_sglang.py"

Record = tuple[int, str, float, float, int]


class FakeFleet:
    """The fake SGLang process: its engines' URLs, and what it recorded."""

    def __init__(self, proc: subprocess.Popen[bytes], control: int, ports: list[int]) -> None:
        self.proc = proc
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{control}", timeout=10)

    async def records(self) -> list[Record]:
        got = (await self.http.get("/_records")).json()
        return [tuple(r) for r in got["records"]]  # type: ignore[misc]

    async def stats(self) -> dict[str, int]:
        stats: dict[str, int] = (await self.http.get("/_stats")).json()
        return stats


@pytest.fixture
def fake_fleet_factory() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()  # the server serves until its stdin closes
        proc.wait(timeout=10)
        proc.stdout.close()


async def _start(procs: list[subprocess.Popen[bytes]], engines: int, delay: float) -> FakeFleet:
    cmd = [sys.executable, str(FAKE), "--engines", str(engines), "--delay", str(delay)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    procs.append(proc)
    assert proc.stdout is not None
    hello = json.loads(await asyncio.to_thread(proc.stdout.readline))
    return FakeFleet(proc, hello["control"], hello["ports"])


@pytest_asyncio.fixture
async def slow32(fake_fleet_factory: list[subprocess.Popen[bytes]]) -> AsyncIterator[FakeFleet]:
    fake = await _start(fake_fleet_factory, 32, 0.2)
    yield fake
    await fake.http.aclose()


def _peak_overlap(rows: list[Record]) -> int:
    edges = sorted([(r[2], 1) for r in rows] + [(r[3], -1) for r in rows])
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


async def test_a_step_reaches_every_engine_before_any_answers(slow32: FakeFleet) -> None:
    """No engine waits for another's answer: 32 engines that take 200 ms each, every pause arrives first."""
    async with EngineFleet(slow32.urls) as fleet:
        await fleet.pause("retract")
        await fleet.resume()
    rows = await slow32.records()
    for path in ("/pause_generation", "/continue_generation"):
        step = [r for r in rows if r[1] == path]
        assert sorted(r[0] for r in step) == sorted(int(u.rsplit(":", 1)[1]) for u in slow32.urls)
        assert max(r[2] for r in step) < min(r[3] for r in step), path  # the last arrival before the first answer
        assert _peak_overlap(step) == 32
    # One connection per engine, kept alive from the pause to the resume.
    assert (await slow32.stats())["accepted"] == 32


async def test_max_in_flight_bounds_what_the_engines_hold_at_once(slow32: FakeFleet) -> None:
    async with EngineFleet(slow32.urls[:12], max_in_flight=4) as fleet:
        labels = await fleet.read_versions()
    assert set(labels.values()) == {"default"}
    rows = [r for r in await slow32.records() if r[1] == "/model_info"]
    assert len(rows) == 12 and _peak_overlap(rows) == 4
    # Three waves of four: each wave arrives after the previous one's answers.
    rows.sort(key=lambda r: r[2])
    for first, second in zip(rows[0:8:4], rows[4:12:4], strict=True):
        assert second[2] >= first[3]
    with pytest.raises(ValueError, match="max_in_flight"):
        EngineFleet(slow32.urls, max_in_flight=0)


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's RSS from /proc")
async def test_a_fleet_of_256_urls_shares_one_tls_context() -> None:
    """A client with a TLS context of its own per engine took 210 MiB (and 6 s) for 256 engines."""
    urls = [f"http://10.0.{i // 200}.{i % 200 + 1}:30000" for i in range(256)]
    before = _rss_mib()
    fleet = EngineFleet(urls)
    try:
        assert _rss_mib() - before < 50
        assert fleet.urls == tuple(urls)
    finally:
        await fleet.aclose()


class _BarrierBus(MemoryBus):
    """A bus whose alerts all wait until ``n`` of them are under way: alerts sent one by one never finish."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.started = 0
        self.all_started = asyncio.Event()

    async def publish(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str,
        expected_last_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        if subject.endswith(".alerts"):
            self.started += 1
            if self.started >= self.n:
                self.all_started.set()
            await self.all_started.wait()
        ack = await super().publish(subject, event, msg_id=msg_id, expected_last_seq=expected_last_seq, headers=headers)
        return ack


async def test_a_fleet_restarted_whole_is_alerted_in_one_round_trip() -> None:
    bus = _BarrierBus(64)
    labels: dict[str, str | object] = {f"http://e{i}": "default" for i in range(64)}
    async with asyncio.timeout(5):
        flagged = await alert_unexpected_labels(bus, "p", "t", 8, 7, labels)  # type: ignore[arg-type]
    assert flagged == list(labels)


async def test_a_fleet_out_of_sync_whole_is_alerted_in_one_round_trip(engines: Engines) -> None:
    fleet = EngineFleet([engines.add(f"e{i}", ignore_version_updates=True) for i in range(16)])
    bus = _BarrierBus(16)
    with pytest.raises(EngineOutOfSyncError):
        async with asyncio.timeout(5):
            await stamp_and_verify(fleet, 3, bus=bus, policy="p")
    assert bus.started == 16
