"""Record and replay: the committed fixture trace, the library API on both buses, and the CLI."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests._builders import updated
from weightbus.bus import Deliver, MemoryBus, NatsBus, subjects
from weightbus.bus.trace import TraceRecord, read_trace, record, replay
from weightbus.schemas import PublisherClaimed, WeightUpdated, decode

FIXTURE = Path(__file__).parent.parent / "fixtures" / "trace.jsonl"


def test_fixture_trace_is_a_valid_ordered_trace() -> None:
    records = list(read_trace(FIXTURE))
    assert len(records) == 18
    assert [r.received_at for r in records] == sorted(r.received_at for r in records)
    events = [decode(r.subject, bytes(r.event)) for r in records]
    versions = [e.version for e in events if isinstance(e, WeightUpdated)]
    assert versions == [1, 2, 3, 4, 1]  # the last one is the rogue regression
    claims = [e for e in events if isinstance(e, PublisherClaimed)]
    assert [(c.trainer_id, c.epoch) for c in claims] == [("trainer-a", 0), ("trainer-b", 1)]


def test_read_trace_names_the_bad_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(FIXTURE.read_bytes().splitlines()[0] + b"\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(read_trace(bad))


async def _replayed_events(bus: MemoryBus | NatsBus, suffix: str | None) -> list[tuple[str, bytes]]:
    records = list(read_trace(FIXTURE))
    acks = await replay(records, bus, msg_id_suffix=suffix)
    assert len(acks) == len(records) and not any(a.duplicate for a in acks)
    assert [a.seq for a in acks] == sorted(a.seq for a in acks)
    return [(r.subject, bytes(r.event)) for r in records]


async def test_replay_into_memory_bus_preserves_order_and_payloads() -> None:
    bus = MemoryBus()
    sent = await _replayed_events(bus, None)
    sub = bus.subscribe("weightbus.>", deliver=Deliver.ALL)
    got = [(e.subject, e.data) async for e in _take(sub, len(sent))]
    assert got == sent
    # Replaying again keeps the recorded ids: every event is recognised as a duplicate.
    again = await replay(read_trace(FIXTURE), bus)
    assert all(a.duplicate for a in again)
    last = await bus.last(subjects.weights("fixture"))
    assert last is not None and last.event.version == 1  # type: ignore[union-attr]


async def _take(sub, n: int):  # type: ignore[no-untyped-def]
    count = 0
    async for env in sub:
        yield env
        count += 1
        if count == n:
            break
    await sub.aclose()


@pytest.mark.nats
async def test_replay_into_nats_twice_with_new_ids(nats_bus: NatsBus) -> None:
    suffix = f":{uuid.uuid4().hex}"
    sent = await _replayed_events(nats_bus, suffix)
    # The trace's recorded conditions (expected last sequence 0) must not block a replay.
    sent2 = await _replayed_events(nats_bus, suffix + "b")
    assert sent == sent2


async def test_record_writes_one_line_per_valid_event() -> None:
    bus = MemoryBus()
    out = io.BytesIO()
    task = asyncio.create_task(record(bus, out, count=2))
    await asyncio.sleep(0)
    w = subjects.weights("rec")
    await bus.publish_raw(w, b"garbage", msg_id="g")
    for v in (1, 2):
        event = updated(v, policy="rec", epoch=0, at=1.0)
        await bus.publish(w, event, msg_id=f"rec:{v}")
    assert await asyncio.wait_for(task, 5) == 2
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["subject"] == w and first["event"]["version"] == 1 and first["headers"]["Nats-Msg-Id"] == "rec:1"
    assert first["v"] == 1 and isinstance(first["received_at"], float)
    # The documented keys, and nothing the format does not name.
    assert set(first) == set(TraceRecord.__struct_fields__)


async def test_record_stops_after_duration() -> None:
    bus = MemoryBus()
    out = io.BytesIO()
    assert await record(bus, out, duration=0.1) == 0
    assert out.getvalue() == b""


@pytest.mark.nats
def test_cli_replay_then_record_round_trip(nats_url: str, tmp_path: Path) -> None:
    exe = [sys.executable, "-m", "weightbus.cli"]
    out = tmp_path / "again.jsonl"
    recorder = subprocess.Popen(
        [*exe, "record", "--out", str(out), "--count", "18", "--duration", "20", "--nats", nats_url],
        stderr=subprocess.PIPE,
    )
    try:
        # The recorder subscribes with deliver=new: replay once it says what it records (it subscribes next,
        # long before the replay process has started and connected).
        for line in recorder.stderr or ():
            if line.startswith(b"recording "):
                break
        replayed = subprocess.run(
            [*exe, "replay", str(FIXTURE), "--new-ids", "--force", "--nats", nats_url],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert replayed.returncode == 0, replayed.stderr
        assert "replayed 18 new events" in replayed.stderr
        _, err = recorder.communicate(timeout=30)
    finally:
        recorder.kill()
    assert recorder.returncode == 0, err
    got = [(r.subject, bytes(r.event)) for r in read_trace(out)]
    want = [(r.subject, bytes(r.event)) for r in read_trace(FIXTURE)]
    assert got == want


def test_cli_replay_against_dead_nats_fails_clearly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "weightbus.cli", "replay", str(FIXTURE), "--nats", "nats://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 5
    assert "cannot connect to NATS at nats://127.0.0.1:9" in result.stderr
