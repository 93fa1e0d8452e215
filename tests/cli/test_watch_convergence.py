"""``weightbus watch`` shows and measures convergence from the one replica view (``rules.replicas``)."""

from __future__ import annotations

import asyncio
import io
import time

import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console

from tests._builders import updated, wait_until
from weightbus.bus import MemoryBus, subjects
from weightbus.cli.watch import render, watch
from weightbus.consumers.monitor import MonitorState, reduce
from weightbus.consumers.replicas import ConvergenceMetrics
from weightbus.schemas import EngineOutOfSync, WeightApplied

A, B = "http://a", "http://b"


def ack(version: int, engine: str, at: float, policy: str = "p") -> WeightApplied:
    return WeightApplied(
        policy=policy, version=version, engine=engine, read_back=str(version), ok=True, published_at=at
    )


def _state() -> MonitorState:
    state = MonitorState()
    events = [
        ("weights", updated(3, policy="demo", trainer="trainer-a", at=100.0, engines=(A, B))),
        ("applied", ack(3, A, 100.2, "demo")),
        ("applied", ack(3, B, 100.5, "demo")),
        ("weights", updated(4, policy="demo", trainer="trainer-a", at=150.0, engines=(A, B))),
        ("applied", ack(4, A, 150.1, "demo")),
        (
            "alerts",
            EngineOutOfSync(
                policy="demo",
                engine=B,
                expected="4",
                actual="3",
                trainer_id="t",
                published_at=150.2,
                reason="read_back",
            ),
        ),
    ]
    for family, event in events:
        state = reduce(state, f"weightbus.demo.{family}", event, received_at=event.published_at)
    return state


def test_at_80x24_the_replicas_column_shows_how_many_engines_serve_the_newest_version() -> None:
    console = Console(width=80, height=24, record=True, color_system=None)
    console.print(render(_state(), 200.0, fit_height=True))
    lines = console.export_text().splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert "replicas" in "\n".join(lines) and "1/2 on v4" in "\n".join(lines)
    wide = Console(width=250, record=True, color_system=None)
    wide.print(render(_state(), 200.0))
    assert "v3 in 0.50s" in wide.export_text()  # the last version the whole fleet acknowledged


async def test_watch_observes_convergence_of_live_versions_only() -> None:
    bus = MemoryBus()
    registry = CollectorRegistry()
    w, a = subjects.weights("p"), subjects.applied("p")
    old = time.time() - 60
    await bus.publish(w, updated(1, at=old, engines=(A, B)), msg_id="w1")
    await bus.publish(a, ack(1, A, old + 0.1), msg_id="a1")
    await bus.publish(a, ack(1, B, old + 0.3), msg_id="b1")
    convergence = ConvergenceMetrics(registry, (1.0, 0.5))
    watching = asyncio.create_task(
        watch(bus, "weightbus.p.>", count=6, convergence=convergence, console=Console(file=io.StringIO()))
    )

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"policy": "p", **labels})

    await wait_until(lambda: value("weightbus_replicas_serving_newest") == 2)
    assert value("weightbus_version_convergence_seconds_count", share="1") == 0  # history: not observed
    at = time.time()
    await bus.publish(w, updated(2, at=at, engines=(A, B)), msg_id="w2")
    await bus.publish(a, ack(2, A, at + 0.25), msg_id="a2")
    await bus.publish(a, ack(2, B, at + 1.0), msg_id="b2")
    state = await asyncio.wait_for(watching, 5)
    assert state.policies["p"].replicas.engines[B].serving == 2
    assert value("weightbus_version_convergence_seconds_sum", share="1") == pytest.approx(1.0)
    assert value("weightbus_version_convergence_seconds_sum", share="0.5") == pytest.approx(0.25)
    assert value("weightbus_engine_activation_seconds_count") == 2
    assert value("weightbus_unconverged_since_timestamp_seconds") == 0
    await bus.aclose()


def test_a_share_outside_the_fleet_is_a_usage_error() -> None:
    from typer.testing import CliRunner

    from weightbus.cli import app

    result = CliRunner().invoke(app, ["watch", "--converge-share", "1.5", "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 2 and "--converge-share" in result.output
    shown = CliRunner().invoke(app, ["watch", "--help"])
    assert "--converge-share" in shown.output
