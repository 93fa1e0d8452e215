"""What weightbus tells an operator is true: a deleted stream is not called "JetStream is not enabled", the command
``StreamConfigError`` recommends is one the CLI accepts and that fixes the stream, and the history the docs give
is the one the code requires.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from tests._builders import updated
from weightbus.bus import connect, subjects
from weightbus.bus.stream import DEFAULT_HISTORY
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import BusError, StreamConfigError, StreamNotFoundError

pytestmark = pytest.mark.nats

ROOT = Path(__file__).parents[2]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A server of this test alone: its stream gets deleted or misconfigured."""
    with EmbeddedNats(store_dir=tmp_path / "js") as srv:
        yield srv


@pytest_asyncio.fixture
async def admin(server: EmbeddedNats) -> AsyncIterator[nats.js.JetStreamContext]:
    nc = await nats.connect(server.url)
    yield nc.jetstream()
    await nc.close()


async def test_a_deleted_stream_is_named_as_such_not_as_jetstream_disabled(server: EmbeddedNats, admin) -> None:
    bus = await connect(server.url)
    try:
        assert bus.direct  # the reads that used to say "JetStream is not enabled"
        subject = subjects.weights("diag")
        event = updated(1, policy="diag", epoch=0)
        await bus.publish(subject, event, msg_id="diag:1")
        await admin.delete_stream("WEIGHTBUS")
        for read in (bus.last_seq, bus.last):
            with pytest.raises(StreamNotFoundError) as info:
                await read(subject)
            assert info.value.stream == "WEIGHTBUS" and "does not exist" in str(info.value)
            assert "not enabled" not in str(info.value) and "-js" not in str(info.value)
            assert "weightbus stream create" in str(info.value)
        # Recreated (as every client does on connect), the same bus reads again.
        await bus.ensure_stream()
        assert await bus.last_seq(subject) == 0
    finally:
        await bus.aclose()


async def test_a_server_without_jetstream_is_still_named_as_such(tmp_path: Path) -> None:
    plain = EmbeddedNats(store_dir=tmp_path / "plain", args=["--jetstream=false"]).start()
    try:
        bus = await connect(plain.url, ensure_stream=False)
        try:
            for direct in (False, True):
                bus.direct = direct
                with pytest.raises(BusError, match="JetStream is not enabled") as info:
                    await bus.last_seq(subjects.weights("diag"))
                assert not isinstance(info.value, StreamNotFoundError)
        finally:
            await bus.aclose()
    finally:
        plain.stop()


def _weightbus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weightbus", *args], capture_output=True, text=True, timeout=60)


async def test_the_fix_stream_config_error_recommends_is_accepted_and_fixes_it(server: EmbeddedNats, admin) -> None:
    await admin.add_stream(
        StreamConfig(
            name="WEIGHTBUS",
            subjects=["weightbus.>"],
            storage=StorageType.FILE,
            max_msgs_per_subject=8,
            discard=DiscardPolicy.OLD,
            duplicate_window=120.0,
        )
    )
    with pytest.raises(StreamConfigError) as info:
        await connect(server.url)
    commands = re.findall(r"`(weightbus [^`]+)`", str(info.value))
    assert commands, f"no command recommended in {info.value}"
    for command in commands:
        done = _weightbus(*command.split()[1:], "--nats", server.url)
        assert done.returncode == 0, f"`{command}` failed: {done.stderr}"
    bus = await connect(server.url)
    await bus.aclose()


def _stated_histories() -> dict[str, list[int]]:
    ops = (ROOT / "docs" / "operations.md").read_text()
    conf = (ROOT / "ops" / "nats" / "single.conf").read_text()
    return {
        "docs/operations.md": [
            *map(int, re.findall(r"(\d+) events per subject", ops)),
            *map(int, re.findall(r"`max_msgs_per_subject` ≥ (\d+)", ops)),
            *map(int, re.findall(r"more than (\d+) events on one subject", ops)),
        ],
        "ops/nats/single.conf": list(map(int, re.findall(r"history per subject \((\d+) by default\)", conf))),
    }


async def test_a_stream_created_as_the_docs_say_is_accepted(server: EmbeddedNats, admin) -> None:
    stated = _stated_histories()
    assert all(stated.values()), f"a history number is no longer found where it was: {stated}"
    numbers = {n for found in stated.values() for n in found}
    assert numbers == {DEFAULT_HISTORY}, f"the docs say {stated}; the code requires {DEFAULT_HISTORY}"
    # What an operator following docs/operations.md creates by hand, a client accepts.
    (history,) = numbers
    await admin.add_stream(
        StreamConfig(
            name="WEIGHTBUS",
            subjects=["weightbus.>"],
            storage=StorageType.FILE,
            max_msgs_per_subject=history,
            discard=DiscardPolicy.OLD,
            duplicate_window=120.0,
        )
    )
    bus = await connect(server.url)
    await bus.aclose()


async def test_reads_on_a_closed_bus_raise_weightbus_errors_not_nats_py_ones(nats_url: str) -> None:
    bus = await connect(nats_url, name="closed-reads")
    await bus.aclose()
    subject = subjects.weights("diag-closed")
    for read in (bus.last_seq, bus.last):
        with pytest.raises(BusError) as info:
            await read(subject)
        assert type(info.value).__module__ == "weightbus.errors"
