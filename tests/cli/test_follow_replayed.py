"""Restarting ``weightbus follow`` does not re-report a rogue event still in the retained history.

The first follower to see the incident logs it at ERROR and publishes its alert; every later one
replays it, finds the alert retained, and says so once at INFO.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from tests._builders import updated
from weightbus.bus import connect, subjects
from weightbus.cli import app
from weightbus.schemas import WeightUpdated

pytestmark = pytest.mark.nats
runner = CliRunner()


def _store(url: str, *events: WeightUpdated) -> None:
    async def go() -> None:
        bus = await connect(url, connect_timeout=5)
        try:
            for e in events:
                await bus.publish(subjects.weights(e.policy), e, msg_id=f"{e.policy}:{e.trainer_id}:{e.version}")
        finally:
            await bus.aclose()

    asyncio.run(go())


def _logs(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_a_restarted_follow_summarises_replayed_incidents_once_at_info(nats_url: str, policy: str) -> None:
    _store(
        nats_url,
        *(updated(v, policy=policy, trainer="trainer-a", epoch=1) for v in (1, 2, 3)),
        updated(1, policy=policy, trainer="rogue", epoch=0),
        updated(2, policy=policy, trainer="rogue", epoch=0),
    )
    args = ["follow", "--policy", policy, "--nats", nats_url, "--duration", "2", "-v"]
    runs = [runner.invoke(app, args) for _ in range(3)]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    first, *restarts = [_logs(r.stderr) for r in runs]
    assert len([e for e in first if e["level"] == "error"]) == 2  # new incidents: alerted and logged
    for logs in restarts:
        assert [e for e in logs if e["level"] == "error"] == []
        summaries = [e for e in logs if "alerted already" in str(e["msg"])]
        assert len(summaries) == 1 and summaries[0]["level"] == "info" and summaries[0]["incidents"] == 2, logs
    # The follower still holds the higher version and prints the rogue events as held, every time.
    assert all(f"{policy}: v3" in r.stdout for r in runs)
