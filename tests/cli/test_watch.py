"""``weightbus watch`` and ``weightbus follow`` against the session's nats-server (CliRunner and subprocesses)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests._builders import updated
from weightbus.bus import connect, subjects
from weightbus.bus.trace import TraceRecord, write_record
from weightbus.cli import app
from weightbus.cli.watch import render
from weightbus.consumers.monitor import MonitorState, reduce
from weightbus.schemas import DrainReport, Event, VersionRegressed, encode

pytestmark = pytest.mark.nats


def publish(url: str, *items: tuple[str, Event, str]) -> None:
    async def _go() -> None:
        bus = await connect(url, connect_timeout=5)
        try:
            for subject, event, msg_id in items:
                await bus.publish(subject, event, msg_id=msg_id)
        finally:
            await bus.aclose()

    asyncio.run(_go())


def weights_item(policy: str, version: int, *, epoch: int = 1, trainer: str = "trainer-a") -> tuple[str, Event, str]:
    event = updated(version, policy=policy, epoch=epoch, trainer=trainer)
    return subjects.weights(policy), event, f"{policy}:w:{version}:{epoch}"


def drain_item(policy: str) -> tuple[str, Event, str]:
    report = DrainReport(
        policy=policy,
        consumer="rm-0",
        seq=1,
        current=3,
        kept=7,
        recycled=2,
        dropped=1,
        published_at=time.time(),
        staleness_avg=1.5,
        staleness_max=4,
    )
    return subjects.drains(policy), report, f"{policy}:drain:1"


def alert_item(policy: str) -> tuple[str, Event, str]:
    alert = VersionRegressed(
        policy=policy,
        current=3,
        incoming=1,
        incoming_epoch=2,
        publisher="cell-1",
        action="hold",
        observer="rm-0",
        published_at=time.time(),
    )
    return subjects.alerts(policy), alert, f"{policy}:alert:1"


def test_watch_json_prints_one_wire_object_per_event_with_its_subject(nats_url: str, policy: str) -> None:
    publish(nats_url, weights_item(policy, 2), weights_item(policy, 3), drain_item(policy), alert_item(policy))
    result = CliRunner().invoke(
        app, ["watch", "--json", "--policy", policy, "--nats", nats_url, "--count", "3", "--duration", "10"]
    )
    assert result.exit_code == 0, result.output
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    by_subject = {o["subject"]: o for o in objects}
    assert set(by_subject) == {subjects.weights(policy), subjects.drains(policy), subjects.alerts(policy)}
    assert len(objects) == 3  # LAST_PER_SUBJECT: only v3 of the weights subject
    assert by_subject[subjects.weights(policy)]["type"] == "weight.updated"
    assert by_subject[subjects.weights(policy)]["version"] == 3
    assert by_subject[subjects.drains(policy)]["kept"] == 7
    assert by_subject[subjects.alerts(policy)]["type"] == "alert.version_regressed"


def test_watch_duration_ends_a_quiet_watch(nats_url: str, policy: str) -> None:
    started = time.monotonic()
    result = CliRunner().invoke(app, ["watch", "--json", "--policy", policy, "--nats", nats_url, "--duration", "0.5"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert 0.5 <= time.monotonic() - started < 5


def test_watch_table_shows_version_drains_and_alerts(nats_url: str, policy: str) -> None:
    publish(nats_url, weights_item(policy, 12, epoch=4, trainer="trainer-z"), drain_item(policy), alert_item(policy))
    result = CliRunner().invoke(
        app,
        ["watch", "--policy", policy, "--nats", nats_url, "--count", "3", "--duration", "10"],
        env={"COLUMNS": "250"},
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert policy in out and "trainer-z" in out
    assert "7/2/1" in out  # last drain kept/recycled/dropped
    assert "1.50 / 4" in out  # staleness avg / max
    assert "version_regressed" in out and "v3 → v1" in out


def test_render_marks_a_regression_seen_on_the_weights_subject() -> None:
    state = MonitorState()
    for v in (57, 1):
        event = updated(v, trainer="a", at=100.0)
        state = reduce(state, "weightbus.p.weights", event, received_at=100.5, live=True)
    console = Console(record=True, width=250, color_system=None)
    console.print(render(state, now=110.0))
    text = console.export_text()
    assert "57 (rejected v1 by a)" in text and "regression_seen" in text and "v57 → v1" in text


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", _MAIN, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()  # by its own pid
        proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


_MAIN = "import sys; from weightbus.cli import main; sys.argv[0] = 'weightbus'; main()"


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    return line


def test_watch_json_streams_live_events(nats_url: str, policy: str) -> None:
    publish(nats_url, weights_item(policy, 1))
    proc = _spawn("watch", "--json", "--policy", policy, "--nats", nats_url, "--count", "2", "--duration", "20")
    try:
        assert json.loads(_line(proc))["version"] == 1  # replayed: the subscription is live now
        publish(nats_url, weights_item(policy, 2))
        live = json.loads(_line(proc))
        assert (live["subject"], live["version"]) == (subjects.weights(policy), 2)
        assert proc.wait(timeout=10) == 0
    finally:
        _reap(proc)


def test_follow_prints_the_current_version_then_changes_and_exits_3_on_raise(nats_url: str, policy: str) -> None:
    publish(nats_url, weights_item(policy, 57))
    proc = _spawn("follow", "--policy", policy, "--json", "--regression", "raise", "--nats", nats_url)
    try:
        first = json.loads(_line(proc))
        assert (first["version"], first["action"], first["replayed"]) == (57, "adopted", True)
        publish(nats_url, weights_item(policy, 58))
        second = json.loads(_line(proc))
        assert (second["version"], second["action"], second["replayed"]) == (58, "advanced", False)
        assert second["lag"] is not None and second["lag"] < 5
        publish(nats_url, weights_item(policy, 1, epoch=2, trainer="cell-1"))
        assert proc.wait(timeout=10) == 3
        assert proc.stderr is not None and "went back from 58 to 1" in proc.stderr.read()
    finally:
        _reap(proc)


def test_follow_reports_a_never_published_policy(nats_url: str, policy: str) -> None:
    result = CliRunner().invoke(app, ["follow", "--policy", policy, "--nats", nats_url, "--duration", "0.3"])
    assert result.exit_code == 0, result.output
    assert "no version published yet" in result.stdout


def test_bad_policy_is_a_usage_error(nats_url: str) -> None:
    result = CliRunner().invoke(app, ["watch", "--policy", "a.b", "--nats", nats_url, "--duration", "0.1"])
    assert result.exit_code == 2


def test_watch_sees_a_replayed_trace(nats_url: str, policy: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    with open(trace, "wb") as f:
        for subject, event, msg_id in (weights_item(policy, 4), drain_item(policy)):
            rec = TraceRecord(
                subject=subject,
                received_at=time.time(),
                event=msgspec.Raw(encode(event)),
                headers={"Nats-Msg-Id": msg_id},
            )
            write_record(f, rec)
    replayed = CliRunner().invoke(app, ["replay", str(trace), "--nats", nats_url])
    assert replayed.exit_code == 0, replayed.output
    result = CliRunner().invoke(
        app, ["watch", "--json", "--policy", policy, "--nats", nats_url, "--count", "2", "--duration", "10"]
    )
    assert result.exit_code == 0, result.output
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(o["subject"], o["type"]) for o in objects] == [
        (subjects.weights(policy), "weight.updated"),
        (subjects.drains(policy), "drain.report"),
    ]


def test_render_shows_waste_and_bias() -> None:
    from weightbus.schemas import DrainReport

    report = DrainReport(
        policy="p",
        consumer="rm-0",
        seq=1,
        current=5,
        kept=1,
        recycled=1,
        dropped=0,
        published_at=100.0,
        tokens_generated=200,
        tokens_trained=150,
        tokens_not_trained={"stale": 50},
        by_length={"kept": {"0-16": 1}, "recycled": {"257-1024": 1}},
    )
    state = reduce(MonitorState(), "weightbus.p.drains", report, received_at=100.5, live=True)
    console = Console(record=True, width=250, color_system=None)
    console.print(render(state, now=110.0))
    text = console.export_text()
    assert "waste and bias" in text
    assert "tokens: 200 generated, 25.0% not trained (stale 25.0%)" in text
    assert "kept by length: 0-16 100%, 257-1024 0%" in text
