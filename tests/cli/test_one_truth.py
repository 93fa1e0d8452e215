"""``status`` and ``watch`` show what every tracker holds: a rogue lower version stored last is flagged, not shown."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from tests._builders import updated
from weightbus.bus import connect, subjects
from weightbus.cli import app
from weightbus.consumers import VersionTracker
from weightbus.producers import VersionPublisher
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import WeightUpdated

pytestmark = pytest.mark.nats

runner = CliRunner()


async def _store_then_track(url: str, policy: str, *events: WeightUpdated) -> int | None:
    bus = await connect(url)
    try:
        for e in events:
            await bus.publish(subjects.weights(policy), e, msg_id=f"{policy}:{e.trainer_id}:{e.epoch}:{e.version}")
        async with VersionTracker(bus, policy) as tracker:
            return await tracker.wait_ready(timeout=10)
    finally:
        await bus.aclose()


def test_status_and_watch_hold_what_trackers_hold_and_flag_the_rogue(nats_url: str, policy: str) -> None:
    held = asyncio.run(
        _store_then_track(
            nats_url,
            policy,
            *(updated(v, policy=policy, trainer="trainer-a", epoch=1) for v in (1, 2, 3, 4)),
            updated(1, policy=policy, trainer="rogue", epoch=0),
        )
    )
    assert held == 4  # what a tracker started now holds

    shown = runner.invoke(app, ["status", "--policy", policy, "--nats", nats_url])
    assert shown.exit_code == 7, shown.output  # the newest stored event was rejected
    assert "version    4" in shown.stdout and "publisher  trainer-a" in shown.stdout
    assert "REJECTED   v1 by rogue" in shown.stdout and "below v4" in shown.stdout

    doc = json.loads(runner.invoke(app, ["status", "--policy", policy, "--nats", nats_url, "--json"]).stdout)
    assert (doc["version"], doc["publisher"], doc["latest_rejected"], doc["exit_code"]) == (4, "trainer-a", True, 7)
    assert [(r["version"], r["held"], r["trainer_id"]) for r in doc["rejected"]] == [(1, 4, "rogue")]

    args = ["watch", "--policy", policy, "--nats", nats_url, "--count", "5", "--duration", "10"]
    watched = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert watched.exit_code == 0, watched.output
    assert "4 (rejected v1 by rogue)" in watched.stdout and "regression_seen" in watched.stdout


def test_status_exit_codes_for_monitoring(nats_url: str, policy: str) -> None:
    assert runner.invoke(app, ["status", "--policy", policy, "--nats", nats_url]).exit_code == 4  # never published
    asyncio.run(_store_then_track(nats_url, policy, updated(5, policy=policy, trainer="trainer-a", epoch=1)))
    state = EngineState()
    with ServedEngine(create_app(state)) as engine:
        args = ["status", "--policy", policy, "--nats", nats_url, "--engine", engine.url]
        out_of_sync = runner.invoke(app, args)
        assert out_of_sync.exit_code == 3 and "OUT OF SYNC (bus says 5)" in out_of_sync.stdout
        state.weight_version = "5"
        assert runner.invoke(app, args).exit_code == 0
    help_text = runner.invoke(app, ["status", "--help"]).stdout
    assert all(f" {code} " in " ".join(help_text.split()) for code in range(2, 8))


def test_status_and_publish_send_the_api_key(nats_url: str, policy: str, monkeypatch: Any) -> None:
    state = EngineState(api_key="s3cret")
    with ServedEngine(create_app(state)) as engine:
        base = ["--policy", policy, "--nats", nats_url, "--engine", engine.url]
        denied = runner.invoke(app, ["publish", *base])
        assert denied.exit_code == 4 and "401" in denied.stderr
        published = runner.invoke(app, ["publish", *base, "--api-key", "s3cret"])
        assert published.exit_code == 0, published.output
        monkeypatch.setenv("WEIGHTBUS_API_KEY", "s3cret")
        shown = runner.invoke(app, ["status", *base])
        # The refused attempt used up (and quarantined) version 1; the next one is 2.
        assert shown.exit_code == 0 and f"{engine.url}  2  ok" in shown.stdout


async def _publish_updates(url: str, policy: str, n: int) -> None:
    bus = await connect(url)
    try:
        async with VersionPublisher(bus, policy, trainer_id="trainer-a") as pub:  # leaving it writes the mark
            for _ in range(n):
                async with pub.update():
                    pass
    finally:
        await bus.aclose()


def test_status_shows_the_counter_high_water_mark(nats_url: str, policy: str) -> None:
    asyncio.run(_publish_updates(nats_url, policy, 3))
    shown = runner.invoke(app, ["status", "--policy", policy, "--nats", nats_url])
    assert shown.exit_code == 0, shown.output
    # Each announcement reserves the next number: after v3 the mark covers v4.
    assert "version    3" in shown.stdout and "counter    v4 (every number up to it issued or reserved)" in shown.stdout
    doc = json.loads(runner.invoke(app, ["status", "--policy", policy, "--nats", nats_url, "--json"]).stdout)
    assert (doc["version"], doc["counter_issued"]) == (3, 4)
