"""The miles integration's Prometheus endpoint: ``WEIGHTBUS_METRICS_PORT`` (the buffer) and
``WEIGHTBUS_TRAINER_METRICS_PORT`` (rank 0's cells) serve one registry per process, scraped over HTTP here.

The buffer runs with the stand-ins of ``test_miles`` (no miles installed); a cell connects to the suite's
nats-server without claiming (no engines).
"""

from __future__ import annotations

import argparse
import logging
from argparse import Namespace

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.integrations.miles.test_miles import DataBufferConstructorInput, announce, args, entry
from weightbus.bus import MemoryBus, serve_metrics
from weightbus.embedded.server import free_port
from weightbus.integrations.host.cell import Cell
from weightbus.integrations.host.metrics import process_metrics, serving
from weightbus.integrations.miles import MilesSettings, WeightbusDataBuffer
from weightbus.integrations.miles.trainer import MILES


async def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample the endpoint serves, by name and labels."""
    async with httpx.AsyncClient() as client:
        response = await client.get(url, timeout=5)
    response.raise_for_status()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def refused(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as client:
            await client.get(url, timeout=2)
    except httpx.TransportError:
        return True
    return False


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


async def test_a_drain_is_served_on_the_metrics_port_until_aclose(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("WEIGHTBUS_METRICS_PORT", str(port))
    bus = MemoryBus()
    await announce(bus, policy, 5)
    unused: list[object] = []
    buf = WeightbusDataBuffer(DataBufferConstructorInput(args(policy), unused.append), bus=bus)
    assert serving() == [url(port)]
    await buf.put(stale := entry(0, "3"))
    await buf.put(fresh := entry(10, "5", "4"))
    assert await buf.get(current_version=2) is fresh and unused == [stale.prompt_group]
    buf.get_metrics()  # the window's end: its counters reach the registry
    samples = await scrape(url(port))
    assert value(samples, "weightbus_groups_total", policy=policy, action="kept", reason="fresh") == 1
    assert value(samples, "weightbus_groups_total", policy=policy, action="recycled", reason="stale") == 1
    assert value(samples, "weightbus_current_version", policy=policy) == 5
    assert value(samples, "weightbus_tracker_ready", policy=policy) == 1
    assert value(samples, "weightbus_drain_current_version", policy=policy) == 5
    assert value(samples, "weightbus_group_staleness_count", policy=policy) == 2
    await buf.aclose()
    assert serving() == [] and await refused(url(port))


async def test_without_a_port_nothing_is_served(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTBUS_METRICS_PORT", raising=False)
    bus = MemoryBus()
    await announce(bus, policy, 1)
    buf = WeightbusDataBuffer(DataBufferConstructorInput(args(policy), print), bus=bus)
    await buf.put(kept := entry(0, "1"))
    assert await buf.get() is kept
    buf.get_metrics()
    assert serving() == [] and buf.stage.metrics is None  # nothing listens, nothing is counted
    await buf.aclose()


async def test_buffers_of_one_process_share_the_registry_and_the_port(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("WEIGHTBUS_METRICS_PORT", str(port))
    bus = MemoryBus()
    other = f"{policy}-b"
    for p in (policy, other):
        await announce(bus, p, 2)
    # Two of one policy and one of another: no family is registered twice, the port is bound once.
    bufs = [WeightbusDataBuffer(DataBufferConstructorInput(args(p), print), bus=bus) for p in (policy, policy, other)]
    assert serving() == [url(port)]
    for i, buf in enumerate(bufs):
        await buf.put(kept := entry(10 * i, "2"))
        assert await buf.get() is kept
        buf.get_metrics()
    samples = await scrape(url(port))
    assert value(samples, "weightbus_groups_total", policy=policy, action="kept", reason="fresh") == 2
    assert value(samples, "weightbus_groups_total", policy=other, action="kept", reason="fresh") == 1
    assert value(samples, "weightbus_current_version", policy=other) == 2
    await bufs[0].aclose()
    await bufs[2].aclose()
    assert not await refused(url(port))  # the last holder closes it
    await bufs[1].aclose()
    assert serving() == [] and await refused(url(port))


def test_a_port_that_is_not_one_is_refused(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("0", "70000", "http"):
        monkeypatch.setenv("WEIGHTBUS_METRICS_PORT", bad)
        with pytest.raises(ValueError, match="WEIGHTBUS_METRICS_PORT"):
            WeightbusDataBuffer(DataBufferConstructorInput(args(policy), print), bus=MemoryBus())
    monkeypatch.delenv("WEIGHTBUS_METRICS_PORT")
    with pytest.raises(ValueError, match="WEIGHTBUS_TRAINER_METRICS_PORT"):
        MilesSettings.from_args(Namespace(weightbus_policy=policy, weightbus_trainer_metrics_port=-1))


async def test_a_taken_port_is_an_error_line_and_the_buffer_runs_on(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    blocker = serve_metrics(port, CollectorRegistry())  # another server holds the port
    try:
        bus = MemoryBus()
        await announce(bus, policy, 1)
        with caplog.at_level(logging.ERROR, logger="weightbus.integrations.miles"):
            # The miles arg (``--weightbus-metrics-port``) instead of the environment.
            config = args(policy, weightbus_metrics_port=port)
            buf = WeightbusDataBuffer(DataBufferConstructorInput(config, print), bus=bus)
        assert serving() == []
        await buf.put(kept := entry(0, "1"))
        assert await buf.get() is kept
        await buf.aclose()
    finally:
        blocker.close()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"rollout metrics on 127.0.0.1:{port}" in errors[0].getMessage()


@pytest.mark.nats
async def test_both_halves_in_one_process_serve_one_port(
    nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_METRICS_PORT", str(port))
    monkeypatch.setenv("WEIGHTBUS_TRAINER_METRICS_PORT", str(port))
    settings = MilesSettings.from_args(Namespace(weightbus_policy=policy))
    assert settings.trainer_metrics == ("127.0.0.1", port)
    cells = [Cell(MILES, settings, Namespace()), Cell(MILES, settings, Namespace())]  # two updaters of rank 0
    try:
        for cell in cells:
            cell.publisher.connect()
            # The connection counts invalid payloads on the process' registry, the one the port serves.
            assert cell.publisher._bus is not None and cell.publisher._bus.metrics is process_metrics().bus  # type: ignore[attr-defined]
        bus = MemoryBus()
        await announce(bus, policy, 3)
        buf = WeightbusDataBuffer(DataBufferConstructorInput(args(policy), print), bus=bus)
        assert serving() == [url(port)]
        await buf.put(kept := entry(0, "3"))
        assert await buf.get() is kept
        buf.get_metrics()
        samples = await scrape(url(port))
        assert value(samples, "weightbus_invalid_events_total", family="weights", reason="malformed") == 0
        assert value(samples, "weightbus_groups_total", policy=policy, action="kept", reason="fresh") == 1
        await buf.aclose()
        assert serving() == [url(port)]  # the cells still hold it
    finally:
        for cell in cells:
            cell.close()
    assert serving() == [] and await refused(url(port))


async def test_the_generate_function_brings_the_metrics_flags_to_miles_parser(policy: str) -> None:
    from weightbus.integrations.miles import generate

    # miles' parse_args calls ``add_arguments`` of the --custom-generate-function-path function.
    parser = generate.add_arguments(argparse.ArgumentParser())  # type: ignore[attr-defined]
    port = free_port()
    parsed = parser.parse_args(["--weightbus-metrics-port", str(port), "--weightbus-trainer-metrics-port", "9104"])
    assert MilesSettings.from_args(Namespace(weightbus_policy=policy, **vars(parsed))).trainer_metrics == (
        "127.0.0.1",
        9104,
    )
    buf = WeightbusDataBuffer(DataBufferConstructorInput(args(policy, **vars(parsed)), print), bus=MemoryBus())
    assert serving() == [url(port)]
    await buf.aclose()
    assert serving() == []
