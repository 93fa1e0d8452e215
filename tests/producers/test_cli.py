"""``weightbus publish`` and ``weightbus status`` against the session's nats-server and served reference engines."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from weightbus.bus import connect, subjects
from weightbus.cli import app
from weightbus.embedded.server import free_port
from weightbus.producers import VersionPublisher
from weightbus.producers.artifact import checkpoint_artifact
from weightbus.producers.status import read_weights_history
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import WeightUpdated

from .conftest import write_checkpoint, write_safetensors

runner = CliRunner()


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
    args = ("publish", "--policy", policy, "--nats", nats_url, "--engine", url, "--pause", "retract")
    refused = invoke(*args)  # 'ops' published a moment ago: alive
    assert refused.exit_code == 3 and "owned by 'ops', alive" in refused.stderr and refused.stdout == ""
    assert state.pause_mode is None and state.weight_version == "1"
    second = invoke(*args, "--takeover")
    assert second.exit_code == 0, second.output
    assert second.stdout.strip() == "2"
    assert state.weight_version == "2" and state.pause_mode is None
    # Each update marks the engines pending (non-numeric) before its push, then stamps the number.
    assert [r.body["new_version"] for r in state.recorded("/update_weight_version")] == [
        "pending:1",
        "1",
        "pending:2",
        "2",
    ]
    assert {r.body["abort_all_requests"] for r in state.recorded("/update_weight_version")} == {False}

    shown = invoke("status", "--policy", policy, "--nats", nats_url, "--engine", url, "--json")
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.stdout)
    assert (doc["version"], doc["epoch"], doc["last_event"]) == (2, 1, "updated")
    assert doc["publisher"].startswith("cli:") and 0 <= doc["age_s"] < 60
    assert doc["engines"] == [{"engine": url, "weight_version": "2", "error": None}]
    replicas = doc["replicas"]
    assert (replicas["newest"], replicas["serving_newest"], replicas["fleet"], replicas["converged"]) == (2, 1, 1, True)
    assert replicas["last_converged"]["version"] == 2 and 0 <= replicas["last_converged"]["seconds"] < 5
    assert replicas["engines"][0]["engine"] == url and replicas["engines"][0]["serving"] == 2

    # Read-only: status never claims, so the next publish continues from the same epoch chain.
    human = invoke("status", "--policy", policy, "--nats", nats_url, "--engine", url)
    assert human.exit_code == 0 and "version    2" in human.stdout and f"{url}  2  ok" in human.stdout
    assert "replicas   1/1 engines acknowledged serving v2" in human.stdout
    assert "converged  v2 reached its whole fleet" in human.stdout
    third = invoke("publish", "--policy", policy, "--nats", nats_url, "--no-engines")
    assert third.stdout.strip() == "3"
    assert json.loads(invoke("status", "--policy", policy, "--nats", nats_url, "--json").stdout)["epoch"] == 2


def test_publish_lora_loads_then_stamps_and_re_pushes_the_same_name(nats_url: str, policy: str, served: Any) -> None:
    state, url = served
    args = ("publish", "--policy", policy, "--nats", nats_url, "--engine", url, "--lora-adapter", "math")
    result = invoke(*args, "--lora-path", "/adapters/math")
    assert result.exit_code == 0, result.output
    assert state.lora_adapters["math"].path == "/adapters/math" and state.weight_version == "1"
    doc = json.loads(invoke("status", "--policy", policy, "--nats", nats_url, "--json").stdout)
    assert doc["lora"] == {"name": "math", "path": "/adapters/math"}
    # The same adapter name again (the next training step): unloaded, loaded from the new path, stamped.
    again = invoke(*args, "--lora-path", "/adapters/math-step2")
    assert again.exit_code == 0, again.output
    assert again.stdout.strip() == "2" and state.lora_adapters["math"].path == "/adapters/math-step2"
    assert [r.body["lora_name"] for r in state.recorded("/unload_lora_adapter")] == ["math"]
    refused = invoke(*args, "--lora-path", "/adapters/math", "--no-lora-replace")
    assert refused.exit_code == 4 and "already exists" in refused.stderr
    # Refused: nothing announced, and the engine is quarantined (its adapter may not match a number).
    assert "nothing was published" in refused.stderr and state.weight_version == "quarantine:3"


def test_a_lora_load_refused_by_one_engine_is_undone_on_the_others(nats_url: str, policy: str) -> None:
    good, bad = EngineState(), EngineState()
    inner = create_app(bad)

    async def refuse_lora(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/load_lora_adapter":
            await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"out of adapter memory"})
            return
        await inner(scope, receive, send)

    with ServedEngine(create_app(good)) as g, ServedEngine(refuse_lora) as b:
        args = ("publish", "--policy", policy, "--nats", nats_url, "--engine", g.url, "--engine", b.url)
        result = invoke(*args, "--lora-adapter", "math", "--lora-path", "/adapters/math")
    assert result.exit_code == 4 and "out of adapter memory" in result.stderr, result.output
    assert "math" not in good.lora_adapters and good.weight_version == "quarantine:1"
    assert [r.body["lora_name"] for r in good.recorded("/unload_lora_adapter")] == ["math"]


def test_publish_refuses_an_engine_out_of_sync(nats_url: str, policy: str) -> None:
    state = EngineState(ignore_version_updates=True)
    with ServedEngine(create_app(state)) as engine:
        result = invoke("publish", "--policy", policy, "--nats", nats_url, "--engine", engine.url)
    assert result.exit_code == 4
    # The engine ignores relabels: it never took the pending label, so it is never stamped.
    assert "stamped weight_version 'pending:1' but /model_info reports 'default'" in result.stderr
    shown = invoke("status", "--policy", policy, "--nats", nats_url, "--json")
    doc = json.loads(shown.stdout)
    assert doc["last_event"] == "reserved" and doc["version"] is None
    assert shown.exit_code == 4  # never published


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
                await bus.aclose()
        await inner(scope, receive, send)

    with ServedEngine(usurp_on_stamp) as engine:
        result = invoke("publish", "--policy", policy, "--nats", nats_url, "--engine", engine.url)
    assert result.exit_code == 3
    assert "taken over by 'usurper'" in result.stderr and "nothing was published" in result.stderr
    assert result.stdout == ""


def test_unreachable_nats_and_bad_arguments(policy: str) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    for command in ("publish", "status"):
        result = invoke(command, "--policy", policy, "--nats", dead, "--connect-timeout", "0.5", "--no-engines")
        if command == "status":
            result = invoke(command, "--policy", policy, "--nats", dead, "--connect-timeout", "0.5")
        assert result.exit_code == 5, result.output
        assert "cannot connect to NATS" in result.stderr
    assert invoke("publish", "--policy", policy, "--lora-path", "/p").exit_code == 2
    bad = invoke("publish", "--policy", "a.b", "--nats", dead, "--connect-timeout", "0.5", "--no-engines")
    assert bad.exit_code == 2 and "invalid policy id 'a.b'" in bad.stderr


def test_status_of_an_unknown_policy(nats_url: str, policy: str) -> None:
    result = invoke("status", "--policy", policy, "--nats", nats_url, "--json")
    assert result.exit_code == 4
    assert json.loads(result.stdout)["version"] is None


def _stored(nats_url: str, policy: str) -> int:
    """How many events the weights subject holds (a claim too)."""

    async def read() -> int:
        async with await connect(nats_url) as bus:
            return await bus.last_seq(subjects.weights(policy))

    return asyncio.run(read())


def _announced(nats_url: str, policy: str) -> list[WeightUpdated]:
    async def read() -> list[WeightUpdated]:
        async with await connect(nats_url) as bus:
            history = await read_weights_history(bus, policy)
            return list(history.updates)

    return asyncio.run(read())


def test_publish_announces_the_artifact_and_a_restarted_engine_is_caught_up_from_it(
    nats_url: str, policy: str, served: Any, tmp_path: Path
) -> None:
    state, url = served
    checkpoint = write_checkpoint(tmp_path / "step-1")
    base = ("publish", "--policy", policy, "--nats", nats_url, "--engine", url, "--trainer-id", "ops")
    first = invoke(*base, "--artifact", str(checkpoint))
    assert first.exit_code == 0, first.output
    [update] = _announced(nats_url, policy)
    assert update.artifact == checkpoint_artifact(checkpoint)  # the directory, with its manifest digest
    adapter = write_safetensors(tmp_path / "adapter.safetensors", 2)
    lora = ("--lora-adapter", "math", "--lora-path", str(adapter), "--artifact", str(adapter))
    second = invoke(*base, *lora)
    assert second.exit_code == 0, second.output
    delta = _announced(nats_url, policy)[-1].artifact
    assert delta is not None and (delta.lineage, delta.base, delta.uri) == ("delta", 1, str(adapter))
    shown = json.loads(invoke("status", "--policy", policy, "--nats", nats_url, "--json").stdout)["artifact"]
    assert shown == {"uri": str(adapter), "lineage": "delta", "base": 1, "manifest_digest": delta.manifest_digest}
    human = invoke("status", "--policy", policy, "--nats", nats_url).stdout
    assert f"artifact   {adapter} (delta on v1, {delta.manifest_digest})" in human

    state.weight_version, state.lora_adapters = "default", {}  # the engine restarted with its boot weights
    caught = invoke("catchup", "--policy", policy, "--nats", nats_url, "--engine", url)
    assert caught.exit_code == 0, caught.output
    assert (state.weight_version, state.model_path) == ("2", str(checkpoint))
    assert state.lora_adapters["math"].path == str(adapter)


def test_publish_refuses_an_artifact_it_cannot_digest_before_touching_anything(
    nats_url: str, policy: str, served: Any, tmp_path: Path
) -> None:
    state, url = served
    base = ("publish", "--policy", policy, "--nats", nats_url, "--engine", url, "--pause", "retract")
    missing = invoke(*base, "--artifact", str(tmp_path / "nowhere"))
    assert missing.exit_code == 2 and "is not a file or a directory" in missing.stderr
    os.mkfifo(tmp_path / "fifo")  # read forever if it were hashed
    fifo = invoke(*base, "--artifact", str(tmp_path / "fifo"))
    assert fifo.exit_code == 2 and "is not a file or a directory" in fifo.stderr
    other = write_safetensors(tmp_path / "other.safetensors", 1)
    mismatch = invoke(*base, "--lora-adapter", "a", "--lora-path", "/adapters/a", "--artifact", str(other))
    assert mismatch.exit_code == 2 and "is not the adapter --lora-path loads" in mismatch.stderr
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 16)
    unreadable = invoke(*base, "--artifact", str(tmp_path / "weights.bin"))
    assert unreadable.exit_code == 2 and "not a safetensors file" in unreadable.stderr
    no_base = invoke(*base, "--lora-adapter", "a", "--artifact", str(write_safetensors(tmp_path / "a.st", 1)))
    assert no_base.exit_code == 2 and "has none" in no_base.stderr
    # Refused before the claim: no engine request, nothing claimed or announced.
    assert state.requests == []
    assert _announced(nats_url, policy) == [] and _stored(nats_url, policy) == 0


def test_publish_announces_nothing_when_the_artifact_changes_while_the_engines_load_it(
    nats_url: str, policy: str, served: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightbus.cli import publish as command

    state, url = served
    base = ("publish", "--policy", policy, "--nats", nats_url, "--engine", url, "--trainer-id", "ops")
    assert invoke(*base).exit_code == 0
    adapter = write_safetensors(tmp_path / "adapter.safetensors", 2)
    push = command.push_lora_adapter

    async def trainer_rewrites_it_during_the_push(*args: Any, **kwargs: Any) -> None:
        await push(*args, **kwargs)
        write_safetensors(adapter, 3)  # the engines may have read either

    monkeypatch.setattr(command, "push_lora_adapter", trainer_rewrites_it_during_the_push)
    refused = invoke(*base, "--lora-adapter", "math", "--lora-path", str(adapter), "--artifact", str(adapter))
    assert refused.exit_code == 2 and "changed after it was hashed" in refused.stderr
    assert [u.version for u in _announced(nats_url, policy)] == [1]  # v2 never announced
    assert state.weight_version == "quarantine:2"  # the update's own cleanup: its adapter may match no digest
