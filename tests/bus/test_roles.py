"""ops/nats/auth.conf as shipped: every role can do its job, and every forbidden action is refused.

The server runs the shipped file (only its port and store are overridden on the command line). Each role
first does its normal work (a positive control, so a config that refuses everything fails too), then
tries every forbidden action; each must end in ``PermissionDeniedError``, the typed error a user sees,
never in a timeout. The trainer and rollout roles are per policy: a credential of policy-a is refused on
every subject of policy-b (its counter, its mark, its admission ledger, its batch requests), and the
documented way to add a policy gives a new policy the same two roles.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from nats.js.api import ConsumerConfig, StreamConfig, SubjectTransform

from tests.roles import AUTH_CONF, ENV, PASSWORDS, password_env, roles_server
from weightbus.bus import ConnectOptions, Deliver, NatsBus, connect, subjects
from weightbus.bus.stream import StreamRequirements, create_or_upgrade
from weightbus.consumers import VersionTracker
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import PermissionDeniedError
from weightbus.producers import VersionPublisher
from weightbus.schemas import MAX_VERSION, CounterHighWater, DrainReport

pytestmark = pytest.mark.nats

ROLES = ("trainer-policy-a", "rollout-policy-a", "trainer-policy-b", "rollout-policy-b", "monitor")


def own_policy(role: str) -> str | None:
    """The policy a per-policy role is scoped to (None for monitor)."""
    return role.split("-", 1)[1] if role.startswith(("trainer-", "rollout-")) else None


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
    await admin.aclose()


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
    trainer_a = await as_role(server, "trainer-policy-a")
    trainer_b = await as_role(server, "trainer-policy-b")
    rollout_a = await as_role(server, "rollout-policy-a")
    rollout_b = await as_role(server, "rollout-policy-b")
    monitor = await as_role(server, "monitor")
    try:
        pub_b = await VersionPublisher(trainer_b, "policy-b", trainer_id="t-b").start()
        async with pub_b.update() as v1:
            pass
        await pub_b.settle()  # the mark after v1 (deferred by mark_delay), under the trainer's credential
        pub_a = await VersionPublisher(trainer_a, "policy-a", trainer_id="t-a").start()
        async with pub_a.update() as va:
            pass
        assert (v1, va) == (1, 1)
        for rollout, policy in ((rollout_a, "policy-a"), (rollout_b, "policy-b")):
            async with VersionTracker(rollout, policy) as tracker:
                assert await tracker.wait_ready(timeout=5) == 1
            await rollout.publish(subjects.drains(policy), drain(policy), msg_id=f"roles:drain:{policy}")
            await rollout.publish_raw(subjects.alerts(policy), b"{}", msg_id=f"roles:alert:{policy}")
            await rollout.publish_raw(subjects.admission(policy), b"{}", msg_id=f"roles:admission:{policy}")
        last = await monitor.last(subjects.weights("policy-b"))
        assert last is not None and last.event.version == 1  # type: ignore[union-attr]
        for reader in (rollout_b, monitor):  # the counter's high-water mark, written by each trainer's update
            mark = await reader.last(subjects.counter("policy-b"))
            assert mark is not None and mark.event.version == 2  # type: ignore[union-attr]
        async with asyncio.timeout(5), monitor.subscribe("weightbus.>", deliver=Deliver.LAST_PER_SUBJECT) as sub:
            seen = {(await sub.__anext__()).subject for _ in range(6)}  # the "{}" payloads are skipped as invalid
        assert seen == {
            subjects.weights("policy-a"),
            subjects.weights("policy-b"),
            subjects.counter("policy-a"),
            subjects.counter("policy-b"),
            subjects.drains("policy-a"),
            subjects.drains("policy-b"),
        }
    finally:
        for bus in (trainer_a, trainer_b, rollout_a, rollout_b, monitor):
            await bus.aclose()


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
    own = own_policy(role)
    forbidden: list[str] = []
    for policy in ("policy-a", "policy-b"):
        trainer = [subjects.weights(policy), subjects.counter(policy), subjects.applied(policy)]
        rollout = [subjects.drains(policy), subjects.admission(policy)]
        if policy != own:  # another policy's subjects: every one of them, the batch requests too
            forbidden += [*trainer, *rollout, subjects.alerts(policy), f"weightbus-rpc.{policy}.batches"]
        elif role.startswith("trainer-"):
            forbidden += rollout
        else:
            forbidden += trainer
    return [*forbidden, "weightbus.policy-b.other", "$JS.API.STREAM.PURGE.WEIGHTBUS"]


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
        await bus.aclose()


@pytest_mark_module_loop
@pytest.mark.parametrize(("role", "other"), [("rollout-policy-a", "policy-b"), ("rollout-policy-b", "policy-a")])
async def test_a_rollout_serves_its_own_policys_batch_requests_only(
    server: EmbeddedNats, stream: None, role: str, other: str
) -> None:
    bus = await as_role(server, role)
    try:

        async def _serve_other() -> None:
            await bus.client.subscribe(f"weightbus-rpc.{other}.batches")
            await bus.client.flush()
            await bus.client.flush()  # a second round trip: the refusal is on the wire by then

        err = await refused(bus, _serve_other())
        assert err.action == "subscribe" and other in err.subject
    finally:
        await bus.aclose()


@pytest_mark_module_loop
async def test_a_trainer_cannot_claim_or_mark_another_policys_counter(server: EmbeddedNats, stream: None) -> None:
    bus = await as_role(server, "trainer-policy-a")
    try:
        with pytest.raises(PermissionDeniedError) as info:
            await VersionPublisher(bus, "policy-b", trainer_id="intruder").start()
        assert info.value.subject == subjects.weights("policy-b")
        forged = CounterHighWater(policy="policy-b", version=MAX_VERSION, epoch=0, trainer_id="x", published_at=1.0)
        with pytest.raises(PermissionDeniedError) as info:
            await bus.publish(subjects.counter("policy-b"), forged, msg_id="roles:forged-mark")
        assert info.value.subject == subjects.counter("policy-b")
    finally:
        await bus.aclose()


def test_the_documented_block_adds_a_policy(tmp_path: Path) -> None:
    """The copy-paste block of ops/nats/auth.conf, renamed as its header says, gives a new policy its two roles."""
    script = (
        "P=new_policy-9; V=$(printf %s \"$P\" | tr 'a-z-' 'A-Z_'); "
        f"sed -n '/# BEGIN policy-a$/,/# END policy-a$/p' {AUTH_CONF} | sed \"s/policy-a/$P/g; s/POLICY_A/$V/g\""
    )
    block = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert "trainer-new_policy-9" in block and "policy-a" not in block
    text = AUTH_CONF.read_text()
    config = tmp_path / "auth.conf"
    config.write_text(text.replace("  users: [\n", "  users: [\n" + block, 1))
    env = {**ENV, password_env("trainer-new_policy-9"): "np-1", password_env("rollout-new_policy-9"): "np-2"}

    async def check(url: str) -> None:
        trainer = await connect(url, options=ConnectOptions(user="trainer-new_policy-9", password="np-1"))
        rollout = await connect(url, options=ConnectOptions(user="rollout-new_policy-9", password="np-2"))
        try:
            pub = await VersionPublisher(trainer, "new_policy-9", trainer_id="t").start()
            async with pub.update() as version:
                assert version == 1
            async with VersionTracker(rollout, "new_policy-9") as tracker:
                assert tracker.current == 1
            await rollout.publish(subjects.drains("new_policy-9"), drain("new_policy-9"), msg_id="np:drain")
            with pytest.raises(PermissionDeniedError):
                await trainer.publish_raw(subjects.counter("policy-a"), b"{}", msg_id="np:forged")
            with pytest.raises(PermissionDeniedError):
                await rollout.publish_raw(subjects.admission("policy-a"), b"{}", msg_id="np:ledger")
        finally:
            await trainer.aclose()
            await rollout.aclose()

    with roles_server(tmp_path / "js", config=config, env=env) as srv:
        asyncio.run(check(srv.url))


@pytest_mark_module_loop
async def test_a_client_cannot_create_the_stream_without_admin(tmp_path: Path) -> None:
    with EmbeddedNats(config=AUTH_CONF, env=ENV, store_dir=tmp_path / "js") as fresh:
        with pytest.raises(PermissionDeniedError) as info:
            await as_role(fresh, "rollout-policy-a")
        assert "stream.create" in info.value.subject.lower()
