"""``weightbus trainer --metrics-port``: the registry it serves is the one its publisher exports the updates to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import weightbus.cli.rl as cli_rl
import weightbus.rl.trainer as trainer
from weightbus.bus import MemoryBus
from weightbus.cli import app
from weightbus.producers import VersionPublisher


def test_the_served_registry_holds_the_trainers_update_phases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[CollectorRegistry] = []
    publishers: list[VersionPublisher] = []  # the gauges follow a live publisher only (held weakly)

    def start_metrics(port: int | None, registry: CollectorRegistry, addr: str = "127.0.0.1") -> None:
        assert port == 9464
        served.append(registry)

    async def run_trainer(config: Any, *, registry: CollectorRegistry | None = None, **_: Any) -> int:
        # What run_trainer does with the registry it is given: its publisher's updates go there.
        pub = await VersionPublisher(MemoryBus(), config.policy, registry=registry).start()
        publishers.append(pub)
        async with pub.update() as version:
            return version

    monkeypatch.setattr(cli_rl, "start_metrics", start_metrics)
    monkeypatch.setattr(trainer, "run_trainer", run_trainer)
    args = ["trainer", "--router", "http://127.0.0.1:9", "--nats", "nats://127.0.0.1:9", "--policy", "p"]
    args += ["--run-dir", str(tmp_path / "run"), "--steps", "1", "--metrics-port", "9464", "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (registry,) = served
    for phase in ("take", "push", "announce"):
        labels = {"policy": "p", "phase": phase, "outcome": "announced"}
        assert registry.get_sample_value("weightbus_update_phase_seconds_count", labels) == 1
    assert registry.get_sample_value("weightbus_publisher_version", {"policy": "p"}) == 1
