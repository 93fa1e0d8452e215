"""ops/nats/auth.conf as shipped: every role can do its job, and every forbidden action is refused.

The server runs the shipped file (only its port and store are overridden on the command line). Each role
first does its normal work (a positive control, so a config that refuses everything fails too), then
tries every forbidden action; each must end in ``PermissionDeniedError``, the typed error a user sees,
never in a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from nats.js.api import ConsumerConfig, StreamConfig, SubjectTransform

from tests.roles import AUTH_CONF, ENV, PASSWORDS
from weightbus.bus import ConnectOptions, Deliver, NatsBus, connect, subjects
from weightbus.bus.stream import StreamRequirements, create_or_upgrade
from weightbus.consumers import VersionTracker
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import PermissionDeniedError
from weightbus.producers import VersionPublisher
from weightbus.schemas import DrainReport

pytestmark = pytest.mark.nats

ROLES = ("trainer", "trainer-policy-a", "rollout", "monitor")


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(config=AUTH_CONF, env=ENV) as srv:
        yield srv


async def as_role(server: EmbeddedNats, role: str, *, ensure: bool = True) -> NatsBus:
    opts = ConnectOptions(user=role, password=PASSWORDS[role])
    return await connect(server.url, options=opts, ensure_stream=ensure, connect_timeout=5)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stream(server: EmbeddedNats) -> AsyncIterator[None]:
    admin = await as_role(server, "admin", ensure=False)
    await create_or_upgrade(admin.js, "WEIGHTBUS", StreamRequirements(), replicas=1)
    yield
    await admin.close()


def drain(policy: str) -> DrainReport:
    return DrainReport(
        policy=policy, consumer="r", seq=1, current=1, kept=1, recycled=0, dropped=0, published_at=time.time()
    )


async def refused(bus: NatsBus, op: Awaitable[Any]) -> PermissionDeniedError:
    started = time.monotonic()
    with pytest.raises(PermissionDeniedError) as info:
        await bus.guard(lambda action, subject: True, op)
    assert time.monotonic() - started < 1.5, "a refusal must not wait for a timeout"
    return info.value


pytest_mark_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_mark_module_loop
async def test_each_role_can_do_its_job(server: EmbeddedNats, stream: None) -> None:
    trainer = await as_role(server, "trainer")
    scoped = await as_role(server, "trainer-policy-a")
    rollout = await as_role(server, "rollout")
    monitor = await as_role(server, "monitor")
    try:
        pub = await VersionPublisher(trainer, "policy-b", trainer_id="t-b").start()
        async with pub.update() as v1:
            pass
        pub_a = await VersionPublisher(scoped, "policy-a", trainer_id="t-a").start()
        async with pub_a.update() as va:
            pass
        assert (v1, va) == (1, 1)
        async with VersionTracker(rollout, "policy-b") as tracker:
            assert await tracker.wait_ready(timeout=5) == 1
        await rollout.publish(subjects.drains("policy-b"), drain("policy-b"), msg_id="roles:drain:1")
        await rollout.publish_raw(subjects.alerts("policy-b"), b"{}", msg_id="roles:alert:1")
        last = await monitor.last(subjects.weights("policy-b"))
        assert last is not None and last.event.version == 1  # type: ignore[union-attr]
        for reader in (rollout, monitor):  # the counter's high-water mark, written by each trainer's update
            mark = await reader.last(subjects.counter("policy-b"))
            assert mark is not None and mark.event.version == 2  # type: ignore[union-attr]
        async with asyncio.timeout(5), monitor.subscribe("weightbus.>", deliver=Deliver.LAST_PER_SUBJECT) as sub:
            seen = {(await sub.__anext__()).subject for _ in range(5)}  # the "{}" alert is skipped as invalid
        assert seen == {
            subjects.weights("policy-a"),
            subjects.weights("policy-b"),
            subjects.counter("policy-a"),
            subjects.counter("policy-b"),
            subjects.drains("policy-b"),
        }
    finally:
        for bus in (trainer, scoped, rollout, monitor):
            await bus.close()


def _forbidden_api(bus: NatsBus) -> dict[str, Awaitable[Any]]:
    js = bus.js
    transform = StreamConfig(
        name="WEIGHTBUS",
        subjects=["weightbus.>"],
        subject_transform=SubjectTransform(src="weightbus.*.drains", dest="weightbus.{{wildcard(1)}}.weights"),
    )
    return {
        "stream update (subject transform)": js.update_stream(transform),
        "stream purge": js.purge_stream("WEIGHTBUS"),
        "stream purge of one subject": js.purge_stream("WEIGHTBUS", subject="weightbus.policy-b.weights"),
        "stream delete": js.delete_stream("WEIGHTBUS"),
        "message delete": js.delete_msg("WEIGHTBUS", 1),
        "stream create": js.add_stream(StreamConfig(name="EVIL", subjects=["evil.>"])),
        "durable consumer": js.add_consumer("WEIGHTBUS", ConsumerConfig(durable_name="evil")),
        "named consumer": js.add_consumer(
            "WEIGHTBUS", ConsumerConfig(name="evil", filter_subject="weightbus.policy-b.weights")
        ),
    }


def _forbidden_publishes(role: str) -> list[str]:
    other = (
        [subjects.weights("policy-b"), subjects.counter("policy-b"), subjects.applied("policy-b")]
        if role != "trainer"
        else []
    )
    drains = [subjects.drains("policy-b")] if role != "rollout" else []
    alerts = [subjects.alerts("policy-b")] if role in ("monitor", "trainer-policy-a") else []
    return [*other, *drains, *alerts, "weightbus.policy-b.other", "$JS.API.STREAM.PURGE.WEIGHTBUS"]


@pytest_mark_module_loop
@pytest.mark.parametrize("role", ROLES)
async def test_every_forbidden_action_is_refused(server: EmbeddedNats, stream: None, role: str) -> None:
    bus = await as_role(server, role)
    try:
        for what, op in _forbidden_api(bus).items():
            err = await refused(bus, op)
            assert err.action == "publish" and err.subject.lower().startswith("$js.api."), (role, what, err)
        for subject in _forbidden_publishes(role):
            # Through the weightbus publish path: the typed error, not "no acknowledgement".
            started = time.monotonic()
            with pytest.raises(PermissionDeniedError) as info:
                await bus.publish_raw(subject, b"{}", msg_id=f"roles:{role}:{subject}")
            assert info.value.subject == subject and time.monotonic() - started < 1.5, (role, subject)

        # Sniffing the subjects directly (outside the stream's consumers) is refused.
        async def _sniff() -> None:
            await bus.client.subscribe("weightbus.>")
            await bus.client.flush()
            await bus.client.flush()  # a second round trip: the refusal is on the wire by then

        err = await refused(bus, _sniff())
        assert err.action == "subscribe"
        # A consumer delivering onto the weights subject (a forgery loop) never gets created.
        with pytest.raises(Exception) as loop:  # noqa: B017 - refused by permissions or by the server's cycle check
            await bus.guard(
                lambda a, s: True,
                bus.js.add_consumer(
                    "WEIGHTBUS",
                    ConsumerConfig(deliver_subject="weightbus.policy-b.weights", filter_subject="weightbus.*.drains"),
                    timeout=10,
                ),
            )
        # Under load the refusal can also surface as the request's timeout; what matters is that no consumer
        # was created, which a successful add_consumer would have returned.
        assert (
            "cycle" in str(loop.value)
            or isinstance(loop.value, PermissionDeniedError)
            or "timeout" in str(loop.value).lower()
        ), repr(loop.value)
    finally:
        await bus.close()


@pytest_mark_module_loop
async def test_scoped_trainer_cannot_claim_another_policy(server: EmbeddedNats, stream: None) -> None:
    bus = await as_role(server, "trainer-policy-a")
    try:
        with pytest.raises(PermissionDeniedError) as info:
            await VersionPublisher(bus, "policy-b", trainer_id="intruder").start()
        assert info.value.subject == subjects.weights("policy-b")
    finally:
        await bus.close()


@pytest_mark_module_loop
async def test_a_client_cannot_create_the_stream_without_admin(tmp_path: Path) -> None:
    with EmbeddedNats(config=AUTH_CONF, env=ENV, store_dir=tmp_path / "js") as fresh:
        with pytest.raises(PermissionDeniedError) as info:
            await as_role(fresh, "rollout")
        assert "stream.create" in info.value.subject.lower()
