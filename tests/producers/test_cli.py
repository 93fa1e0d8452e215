"""``weightbus publish`` and ``weightbus status`` against the session's nats-server and served reference engines."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from weightbus.bus import connect, free_port
from weightbus.cli import app
from weightbus.producers import VersionPublisher
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine

runner = CliRunner()


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    # setup_logging replaces the root handlers with one bound to the runner's stderr.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def served() -> Iterator[tuple[EngineState, str]]:
    state = EngineState()
    with ServedEngine(create_app(state)) as engine:
        yield state, engine.url


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args))


def test_publish_stamps_verifies_and_prints_the_version(nats_url: str, policy: str, served: Any) -> None:
    state, url = served
    first = invoke("publish", "--policy", policy, "--nats", nats_url, "--engine", url, "--trainer-id", "ops")
    assert first.exit_code == 0, first.output
    assert first.stdout.strip() == "1"
    second = invoke("publish", "--policy", policy, "--nats", nats_url, "--engine", url, "--pause", "retract")
    assert second.exit_code == 0, second.output
    assert second.stdout.strip() == "2"
    assert state.weight_version == "2" and state.pause_mode is None
    assert [r.body for r in state.recorded("/update_weight_version")] == [
        {"new_version": "1", "abort_all_requests": False},
        {"new_version": "2", "abort_all_requests": False},
    ]

    shown = invoke("status", "--policy", policy, "--nats", nats_url, "--engine", url, "--json")
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.stdout)
    assert (doc["version"], doc["epoch"], doc["last_event"]) == (2, 1, "updated")
    assert doc["publisher"].startswith("cli:") and 0 <= doc["age_s"] < 60
    assert doc["engines"] == [{"engine": url, "weight_version": "2", "error": None}]

    # Read-only: status never claims, so the next publish continues from the same epoch chain.
    human = invoke("status", "--policy", policy, "--nats", nats_url, "--engine", url)
    assert human.exit_code == 0 and "version    2" in human.stdout and f"{url}  2  ok" in human.stdout
    third = invoke("publish", "--policy", policy, "--nats", nats_url)
    assert third.stdout.strip() == "3"
    assert json.loads(invoke("status", "--policy", policy, "--nats", nats_url, "--json").stdout)["epoch"] == 2


def test_publish_lora_loads_then_stamps(nats_url: str, policy: str, served: Any) -> None:
    state, url = served
    args = ("publish", "--policy", policy, "--nats", nats_url, "--engine", url, "--lora", "math")
    result = invoke(*args, "--lora-path", "/adapters/math")
    assert result.exit_code == 0, result.output
    assert state.lora_adapters["math"].path == "/adapters/math" and state.weight_version == "1"
    doc = json.loads(invoke("status", "--policy", policy, "--nats", nats_url, "--json").stdout)
    assert doc["lora"] == {"name": "math", "path": "/adapters/math"}
    refused = invoke(*args, "--lora-path", "/adapters/math")
    assert refused.exit_code == 4 and "already exists" in refused.stderr
    assert "nothing was published" in refused.stderr


def test_publish_refuses_an_engine_out_of_sync(nats_url: str, policy: str) -> None:
    state = EngineState(ignore_version_updates=True)
    with ServedEngine(create_app(state)) as engine:
        result = invoke("publish", "--policy", policy, "--nats", nats_url, "--engine", engine.url)
    assert result.exit_code == 4
    assert "stamped weight_version '1' but /model_info reports 'default'" in result.stderr
    doc = json.loads(invoke("status", "--policy", policy, "--nats", nats_url, "--json").stdout)
    assert doc["last_event"] == "claimed" and doc["version"] is None


def test_publish_reports_being_fenced(nats_url: str, policy: str) -> None:
    state = EngineState()
    inner = create_app(state)

    async def usurp_on_stamp(scope: Any, receive: Any, send: Any) -> None:
        # Another trainer claims the counter while the CLI is stamping its engine.
        if scope["type"] == "http" and scope["path"] == "/update_weight_version":
            bus = await connect(nats_url)
            try:
                await VersionPublisher(bus, policy, trainer_id="usurper").start()
            finally:
                await bus.close()
        await inner(scope, receive, send)

    with ServedEngine(usurp_on_stamp) as engine:
        result = invoke("publish", "--policy", policy, "--nats", nats_url, "--engine", engine.url)
    assert result.exit_code == 3
    assert "taken over by 'usurper'" in result.stderr and "nothing was published" in result.stderr
    assert result.stdout == ""


def test_unreachable_nats_and_bad_arguments(policy: str) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    for command in ("publish", "status"):
        result = invoke(command, "--policy", policy, "--nats", dead, "--connect-timeout", "0.5")
        assert result.exit_code == 5, result.output
        assert "cannot connect to NATS" in result.stderr
    assert invoke("publish", "--policy", policy, "--lora-path", "/p").exit_code == 2
    bad = invoke("publish", "--policy", "a.b", "--nats", dead, "--connect-timeout", "0.5")
    assert bad.exit_code == 2 and "invalid policy id 'a.b'" in bad.stderr


def test_status_of_an_unknown_policy(nats_url: str, policy: str) -> None:
    result = invoke("status", "--policy", policy, "--nats", nats_url, "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["version"] is None
