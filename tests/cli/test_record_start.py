"""``weightbus record`` says at start what it records: new events only (the default) or the retained history."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests._builders import updated
from weightbus.bus import connect, subjects
from weightbus.bus.trace import read_trace
from weightbus.cli import app

pytestmark = pytest.mark.nats
runner = CliRunner()


def _store(url: str, policy: str, *versions: int) -> None:
    async def go() -> None:
        bus = await connect(url, connect_timeout=5)
        try:
            for v in versions:
                event = updated(v, policy=policy)
                await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:{v}")
        finally:
            await bus.aclose()

    asyncio.run(go())


def test_record_says_what_it_records(nats_url: str, policy: str, tmp_path: Path) -> None:
    _store(nats_url, policy, 1, 2)
    base = ["record", "--nats", nats_url, "--subjects", subjects.weights(policy), "--count", "2"]
    # The default records new events only: on this idle subject it records nothing and says why.
    idle = runner.invoke(app, [*base, "--out", str(tmp_path / "new.jsonl"), "--duration", "1"])
    assert idle.exit_code == 0, idle.output
    first = idle.stderr.splitlines()[0]
    assert first.startswith(f"recording {subjects.weights(policy)} to {tmp_path / 'new.jsonl'}: new events only")
    assert "--deliver all" in first and "recorded 0 events" in idle.stderr
    # --deliver all records the retained history from its start.
    history = runner.invoke(app, [*base, "--out", str(tmp_path / "all.jsonl"), "--duration", "10", "--deliver", "all"])
    assert history.exit_code == 0, history.output
    assert "the retained history from its start" in history.stderr.splitlines()[0]
    assert len(list(read_trace(tmp_path / "all.jsonl"))) == 2
