"""Connecting never rewrites an operator's stream; the admin command creates or upgrades it explicitly."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
import pytest_asyncio
from nats.js.api import DiscardPolicy, StorageType, StreamConfig, SubjectTransform

from weightbus.bus import connect
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import StreamConfigError

pytestmark = pytest.mark.nats


@pytest.fixture
def server() -> Iterator[EmbeddedNats]:
    """A server per test: deny_delete, once set, cannot be taken back."""
    with EmbeddedNats() as srv:
        yield srv


@pytest_asyncio.fixture
async def admin(server: EmbeddedNats) -> AsyncIterator[nats.js.JetStreamContext]:
    """A raw nats-py JetStream context on a server with no WEIGHTBUS stream yet."""
    nc = await nats.connect(server.url)
    yield nc.jetstream()
    await nc.close()


def operator_stream(**overrides: object) -> StreamConfig:
    base: dict[str, object] = {
        "name": "WEIGHTBUS",
        "subjects": ["weightbus.>"],
        "storage": StorageType.FILE,
        "max_msgs_per_subject": 300,
        "duplicate_window": 300.0,
        "max_bytes": 50_000_000,
        "discard": DiscardPolicy.OLD,
    }
    base.update(overrides)
    return StreamConfig(**base)  # type: ignore[arg-type]


async def test_connect_creates_a_missing_stream_with_the_replicas_asked(server: EmbeddedNats, admin) -> None:
    bus = await connect(server.url)
    await bus.aclose()
    info = await admin.stream_info("WEIGHTBUS")
    assert info.config.subjects == ["weightbus.>"]
    assert info.config.storage == StorageType.FILE
    assert info.config.max_msgs_per_subject == 256 and info.config.duplicate_window == 120
    assert info.config.num_replicas == 1
    assert info.config.max_consumers == 10_000  # not the server's default (1,000 on nats-server 2.15)


async def test_connect_leaves_an_operator_stream_alone(server: EmbeddedNats, admin) -> None:
    await admin.add_stream(operator_stream(deny_delete=True, deny_purge=True))
    before = (await admin.stream_info("WEIGHTBUS")).config
    for history in (4, 64):  # a client needing less history must not trim everyone's
        bus = await connect(server.url, history=history)
        await bus.aclose()
    after = (await admin.stream_info("WEIGHTBUS")).config
    assert after == before
    assert after.max_bytes == 50_000_000 and after.max_msgs_per_subject == 300
    assert after.deny_delete and after.deny_purge


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"max_msgs_per_subject": 8}, "max_msgs_per_subject is 8, needs at least 256"),
        ({"duplicate_window": 10.0}, "duplicate_window is 10s, needs at least 120s"),
        ({"storage": StorageType.MEMORY}, "storage is memory, needs file"),
        ({"subjects": ["weightbus.a.>"]}, "do not cover weightbus.>"),
        (
            {"subject_transform": SubjectTransform(src="weightbus.*.drains", dest="weightbus.{{wildcard(1)}}.weights")},
            "subject transform",
        ),
        ({"discard": DiscardPolicy.NEW}, "discard is new"),
    ],
)
async def test_connect_refuses_a_stream_that_does_not_fit_and_names_why(
    server: EmbeddedNats, admin, overrides: dict[str, object], named: str
) -> None:
    await admin.add_stream(operator_stream(**overrides))
    before = (await admin.stream_info("WEIGHTBUS")).config
    with pytest.raises(StreamConfigError) as info:
        await connect(server.url)
    assert named in str(info.value) and info.value.cause == "stream"
    assert any(named in m for m in info.value.mismatches)
    assert (await admin.stream_info("WEIGHTBUS")).config == before  # left unchanged


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightbus.cli", "stream", *args], capture_output=True, text=True, timeout=60
    )


async def test_admin_command_upgrades_and_check_reports(server: EmbeddedNats, admin) -> None:
    await admin.add_stream(operator_stream(max_msgs_per_subject=8, duplicate_window=10.0))
    bad = _cli("check", "--nats", server.url)
    assert bad.returncode == 1, bad.stderr
    assert "max_msgs_per_subject is 8" in bad.stderr and "duplicate_window is 10s" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert "consumers 0 of the server's default (1,000 on nats-server 2.15" in bad.stdout

    done = _cli("create", "--nats", server.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("upgraded:")
    config = (await admin.stream_info("WEIGHTBUS")).config
    assert config.max_msgs_per_subject == 256 and config.duplicate_window == 120
    assert config.deny_delete and config.deny_purge
    assert config.max_bytes == 50_000_000  # an operator's limit is kept
    assert config.max_consumers == 10_000  # none was set: the server's default (1,000) is raised

    again = _cli("create", "--nats", server.url)
    assert again.returncode == 0 and again.stdout.startswith("unchanged:"), again.stderr
    ok = _cli("check", "--nats", server.url)
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.stderr
    assert "consumers 0 of 10000" in ok.stdout  # how close the stream is to refusing the next tracker
    # With deny_delete/deny_purge on, weightbus clients still connect (they used to fail).
    bus = await connect(server.url)
    await bus.aclose()
    # deny_purge refuses purges; deny_delete refuses deleting single events (deleting the whole stream
    # is kept from non-admins by permissions, see test_roles.py).
    await admin.publish("weightbus.p.weights", b"{}")
    with pytest.raises(nats.js.errors.APIError, match="purge not permitted"):
        await admin.purge_stream("WEIGHTBUS")
    with pytest.raises(nats.js.errors.APIError, match="not permitted"):
        await admin.delete_msg("WEIGHTBUS", 1)


async def test_admin_command_creates_a_missing_stream(server: EmbeddedNats, admin) -> None:
    done = _cli("create", "--nats", server.url, "--allow-purge")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("created:")
    assert "deny_delete true" in done.stdout and "deny_purge false" in done.stdout
    config = (await admin.stream_info("WEIGHTBUS")).config
    assert config.deny_delete and not config.deny_purge


def test_check_of_a_missing_stream_is_one_line(server: EmbeddedNats) -> None:
    out = _cli("check", "--nats", server.url)
    assert out.returncode == 1 and "does not exist" in out.stderr and len(out.stderr.strip().splitlines()) == 1


async def test_the_admin_command_keeps_a_consumer_limit_the_operator_set(server: EmbeddedNats, admin) -> None:
    await admin.add_stream(operator_stream(max_consumers=50))
    unset = _cli("check", "--nats", server.url)
    assert "consumers 0 of 50" in unset.stdout, unset.stderr
    done = _cli("create", "--nats", server.url)
    assert done.returncode == 0, done.stderr
    assert (await admin.stream_info("WEIGHTBUS")).config.max_consumers == 50


async def test_a_tracker_past_the_streams_consumer_limit_is_deaf_and_says_why_then_subscribes_once_one_leaves(
    server: EmbeddedNats, admin
) -> None:
    # nats-server 2.15 caps a stream that sets no limit at 1,000 consumers; every tracker holds one. The
    # tracker past the limit must not look ready, must say what to raise, and must get in once there is room.
    from prometheus_client import CollectorRegistry

    from tests._builders import wait_until
    from weightbus.consumers import VersionTracker
    from weightbus.consumers.tracker.metrics import TrackerMetrics
    from weightbus.errors import TrackerNotReadyError
    from weightbus.producers import VersionPublisher

    await admin.add_stream(operator_stream(max_consumers=4))
    bus = await connect(server.url)
    metrics = TrackerMetrics(CollectorRegistry())
    trackers: list[VersionTracker] = []
    try:
        pub = await VersionPublisher(bus, "p-limit").start()
        async with pub.update():
            pass

        def deaf() -> list[VersionTracker]:
            return [t for t in trackers if t.deaf_reason is not None and not t.ready]

        # History reads hold short-lived consumers too, so the limit is reached after a few trackers.
        while not deaf():
            assert len(trackers) < 8, "four consumers should not hold eight trackers"
            tracker = VersionTracker(bus, "p-limit", metrics=metrics, retry_delay=0.05, max_retry_delay=0.2)
            trackers.append(await tracker.start())
            await wait_until(lambda t=tracker: t.ready or t.deaf_reason is not None, 20, "ready or deaf")
        shut_out = deaf()[0]
        with pytest.raises(TrackerNotReadyError, match="max_consumers"):
            shut_out.current  # noqa: B018  # reading the version of a deaf tracker is an error, not a guess
        assert "max_consumers" in (shut_out.deaf_reason or "") and "weightbus stream create" in (
            shut_out.deaf_reason or ""
        )
        for tracker in [t for t in trackers if t.ready]:
            await tracker.aclose()  # room again: the one shut out gets in by itself
        assert await shut_out.wait_ready(30) == 1
    finally:
        for tracker in trackers:
            await tracker.aclose()
        await bus.aclose()


async def test_a_history_read_gives_its_consumer_back_within_about_a_second(server: EmbeddedNats, admin) -> None:
    # Each history read is an ephemeral ordered consumer; the server keeps one whose reader has gone for the
    # consumer's inactive threshold (5 s unless set). Readers in a loop near the stream's consumer limit (a
    # trainer's claim retries, trackers resubscribing) then fill it with their own leftovers.
    import asyncio
    import time

    from weightbus.bus import subjects
    from weightbus.bus.history import read_subject_history
    from weightbus.producers import VersionPublisher
    from weightbus.schemas import WeightUpdated

    bus = await connect(server.url)
    try:
        async with VersionPublisher(bus, "p-reads", mark_delay=0) as pub:
            async with pub.update():
                pass
        for _ in range(10):
            history = await read_subject_history(bus, subjects.weights("p-reads"))
            assert [e.event.version for e in history.events if isinstance(e.event, WeightUpdated)] == [1]
        start = time.monotonic()
        while (await admin.stream_info("WEIGHTBUS")).state.consumer_count > 0:
            assert time.monotonic() - start < 3.0, "history reads still hold consumers after 3 s"
            await asyncio.sleep(0.1)
    finally:
        await bus.aclose()
