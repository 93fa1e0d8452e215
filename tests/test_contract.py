"""The external rollout service contract, clause by clause: what docs/contract.md claims weightbus does, run.

One test per clause row of docs/contract.md (miles' "External rollout service contract" and "What to measure",
and Stitch's concepts); each test's name is the one its row gives, and ``tests/test_docs.py`` checks that the rows
and these tests name each other. Each test exercises the real behaviour on a ``MemoryBus`` (one on a real
nats-server) with strict reference engines, and asserts what was recorded: a number never reused, a delta on an
unannounced base rejected, corrupted bytes never loaded, an engine never advertised before its acknowledgement. Where
a thorough test of a clause exists elsewhere, the row links it and this test is a compact end-to-end check.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from tests._builders import updated, wait_until
from tests.producers.conftest import Engines, HookBus, announce_full, loads, truthful, write_safetensors
from weightbus.bus import MemoryBus, NatsBus, subjects
from weightbus.bus.history import read_subject_history
from weightbus.consumers import VersionTracker
from weightbus.consumers.admission import Admission
from weightbus.consumers.replicas import (
    ConvergenceMetrics,
    ReplicaFollower,
    RequestMetrics,
    VersionConstraint,
    VersionRouter,
)
from weightbus.errors import ArtifactDigestError, FencedError, SequenceConflictError, VersionUnavailableError
from weightbus.producers import CatchupMetrics, EngineFleet, FleetCatchup, VersionPublisher, catch_up
from weightbus.producers.artifact import safetensors_artifact, verify_artifact
from weightbus.rl.config import RolloutConfig
from weightbus.rl.rollout import generate_group
from weightbus.rl.task import ReverseDigits
from weightbus.rules.staleness import group_versions, judge
from weightbus.schemas import (
    EngineOutOfSync,
    Event,
    FleetQuarantined,
    PublisherClaimed,
    VersionRejected,
    WeightApplied,
    WeightArtifact,
    WeightUpdated,
    now,
)
from weightbus.schemas.rollouts import Group

A, B = "http://a", "http://b"


@pytest_asyncio.fixture
async def ref() -> AsyncIterator[Engines]:
    """Strict reference engines (the producer tests' ``Engines``), closed after the test."""
    found = Engines()
    yield found
    await found.http.aclose()


@pytest_asyncio.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    memory = MemoryBus()
    yield memory
    await memory.aclose()


def ack(version: int, engine: str, at: float | None = None) -> WeightApplied:
    stamp = time.time() if at is None else at
    return WeightApplied(
        policy="p", version=version, engine=engine, read_back=str(version), ok=True, published_at=stamp
    )


async def publish(bus: MemoryBus, *events: Event) -> None:
    """Store each event on its family's subject of policy ``p``, as a trainer and its engines would."""
    for event in events:
        if isinstance(event, WeightApplied):
            subject = subjects.applied("p")
        elif isinstance(event, EngineOutOfSync | FleetQuarantined | VersionRejected):
            subject = subjects.alerts("p")
        else:
            subject = subjects.weights("p")
        await bus.publish(subject, event, msg_id=f"{subject}:{time.time_ns()}")


async def stored(bus: MemoryBus | NatsBus, subject: str) -> list[Event]:
    return [env.event for env in (await read_subject_history(bus, subject)).events]


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


# --- miles: who owns what --------------------------------------------------------------------------------------


async def test_ownership_training_state_the_trainers_checkpoint_floors_the_counter(bus: MemoryBus) -> None:
    """miles owns "training state and optimizer steps": weightbus keeps none of it, but a trainer restored from its
    checkpoint at step 41 (``floor=41``) never numbers below it, even on a bus that lost everything."""
    pub = await VersionPublisher(bus, "p", floor=41).start()
    async with pub.update() as version:
        pass
    assert version == 42 and pub.state.version == 42


async def test_ownership_conversion_the_announcement_names_the_file_the_trainer_wrote(
    bus: MemoryBus, tmp_path: Path
) -> None:
    """miles owns "conversion to canonical rollout-visible tensors": weightbus converts nothing; the announcement
    names the file the trainer wrote and its digests, and those digests hold the file to what was announced."""
    pub = await VersionPublisher(bus, "p").start()
    version, path = await announce_full(pub, tmp_path)
    [announced] = [e for e in await stored(bus, subjects.weights("p")) if isinstance(e, WeightUpdated)]
    assert announced.version == version and announced.artifact == safetensors_artifact(path)
    assert announced.artifact.tensors[0][0] == "w" and verify_artifact(announced.artifact) is None
    write_safetensors(path, 99)  # the trainer's file changed after the announcement
    problem = verify_artifact(announced.artifact)
    assert problem is not None and problem[0] == "digest_mismatch"


async def test_ownership_numbering_a_fenced_publisher_cannot_announce_and_no_number_is_reused(bus: MemoryBus) -> None:
    """miles owns "policy version numbering and publication": weightbus's fenced counter numbers them; a second
    publisher's claim fences the first, whose update is refused, and the successor never reuses a number."""
    first = await VersionPublisher(bus, "p", trainer_id="first").start()
    async with first.update():
        pass
    second = await VersionPublisher(bus, "p", trainer_id="second").start()
    with pytest.raises(FencedError):
        async with first.update():
            pass
    async with second.update() as taken:
        pass
    numbers = [e.version for e in await stored(bus, subjects.weights("p")) if isinstance(e, WeightUpdated)]
    assert numbers == [1, taken] and taken > first.state.issued  # 2 was reserved by the first: never pushed again


async def test_ownership_replica_health_a_restarted_engine_is_reported_before_the_push(
    bus: MemoryBus, ref: Engines
) -> None:
    """The service owns "replica placement, scaling, and health": weightbus places and scales nothing, but a trainer
    update reports an engine that restarted under it (its boot label) before its push can hide it."""
    fleet = EngineFleet([ref.add("a"), ref.add("b")])
    pub = await VersionPublisher(bus, "p", fleet=fleet, pause="retract").start()
    async with pub.update():
        pass
    ref.states[B].weight_version = "default"  # b restarted
    async with pub.update() as version:
        pass
    alerts = [e for e in await stored(bus, subjects.alerts("p")) if isinstance(e, EngineOutOfSync)]
    assert [(a.engine, a.actual, a.reason) for a in alerts] == [(B, "default", "unexpected_label")]
    assert alerts[0].published_at <= next(
        e.published_at
        for e in await stored(bus, subjects.weights("p"))
        if isinstance(e, WeightUpdated) and e.version == version
    )


async def test_ownership_admission_no_group_that_could_only_be_stale_is_started() -> None:
    """The service owns "admission control": weightbus's own admission is the staleness side only. The ``Admission``
    gate starts at most (bound + 1) x batch groups per version horizon; the next waits for a newer version."""
    current = [1]
    gate = Admission(current=lambda: current[0], max_staleness=0, batch=2, poll_s=0.01)
    slots = [await asyncio.wait_for(gate.acquire(), 1) for _ in range(2)]
    for slot in slots:
        slot.accept()
    waiting = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.1)  # long enough to show the third does not start
    assert not waiting.done()
    gate.drained(2, at=1)
    current[0] = 2
    (await asyncio.wait_for(waiting, 2)).release()


# --- miles: policy-version requirements ------------------------------------------------------------------------


async def test_requirement_min_version_goes_only_to_an_engine_at_or_above_it(bus: MemoryBus) -> None:
    """miles: "A minimum version permits any replica at or above the requested version": only engines whose
    acknowledgement of v2 or newer stands are picked, while the fleet converges."""
    await publish(bus, ack(1, B), updated(2, engines=(A, B)), ack(2, A))  # B acknowledged v1 before v2
    async with ReplicaFollower(bus, "p") as follower:
        router = VersionRouter(follower, wait_s=1)
        picks = {
            (p.engine, p.version) for p in [await router.pick(VersionConstraint(min_version=2)) for _ in range(20)]
        }
        assert picks == {(A, 2)}
        assert {(await router.pick(VersionConstraint(min_version=1))).engine for _ in range(40)} == {A, B}


async def test_requirement_exact_version_goes_only_to_the_engine_serving_it(bus: MemoryBus) -> None:
    """miles: "An exact version requires the replica to serve one particular policy": an older engine is picked for its
    own version and for no other; an exact version below the minimum is refused as a request."""
    await publish(bus, ack(2, B), updated(3, engines=(A, B)), ack(3, A))
    async with ReplicaFollower(bus, "p") as follower:
        router = VersionRouter(follower, wait_s=0.1)
        assert {(await router.pick(VersionConstraint(exact_version=2))).engine for _ in range(20)} == {B}
        picked = await router.pick(VersionConstraint(min_version=1, exact_version=3))
        assert (picked.engine, picked.version) == (A, 3)
        with pytest.raises(VersionUnavailableError):
            await router.pick(VersionConstraint(exact_version=1))
    with pytest.raises(ValueError):
        VersionConstraint(min_version=3, exact_version=2)


async def test_requirement_no_compatible_replica_is_a_retryable_error_after_the_bound(bus: MemoryBus) -> None:
    """miles: "If no compatible replica is ready, the service returns a retryable response instead of silently serving
    an older policy": after ``wait_s`` a typed, retryable error names what each engine serves; a retry succeeds once an
    engine acknowledges."""
    await publish(bus, updated(4, engines=(A,)), ack(3, A))
    async with ReplicaFollower(bus, "p") as follower:
        router = VersionRouter(follower, wait_s=0.2)
        started = time.monotonic()
        with pytest.raises(VersionUnavailableError) as refused:
            await router.pick(VersionConstraint(min_version=4))
        assert time.monotonic() - started >= 0.2
        assert refused.value.retryable and refused.value.serving == {A: 3} and refused.value.newest == 4
        await publish(bus, ack(4, A))
        assert (await router.pick(VersionConstraint(min_version=4))).version == 4


async def test_requirement_retry_safety_a_refused_request_reached_no_engine(bus: MemoryBus, ref: Engines) -> None:
    """miles: "Retrying a stateful generation is safe only when the integration defines an idempotency and session
    contract": weightbus defines none, so a constrained request it cannot place is refused before anything is sent;
    nothing was generated that a retry would replay."""
    ref.add("a", weight_version="1")
    await publish(bus, updated(1, engines=(A,)), ack(1, A))
    config = RolloutConfig(nats_url="nats://unused", router_url="http://router", policy="p", group_size=2)
    async with ReplicaFollower(bus, "p") as follower:
        with pytest.raises(VersionUnavailableError):
            await generate_group(
                ref.http,
                config,
                ReverseDigits(3),
                Group(prompt_index=0),
                "407.",
                itertools.count(),
                versions=VersionRouter(follower, wait_s=0.1),
                constraint=VersionConstraint(min_version=2),
            )
    assert ref.states[A].recorded("/generate") == []


async def test_requirement_served_version_start_and_end_are_recorded_and_the_start_is_judged(
    bus: MemoryBus, ref: Engines
) -> None:
    """miles: "The response reports which version served the request ... both the version at generation start and at
    generation end": each sample records the version its engine served when the request left and the label its answer
    carried; the drain judges the older, so an activation mid-request never makes a sample fresher."""
    ref.add("a", weight_version="2")
    await publish(bus, updated(2, engines=(A,)), ack(2, A))
    ref.states[A].weight_version = "3"  # activated while its acknowledgement is still on its way
    config = RolloutConfig(nats_url="nats://unused", router_url="http://router", policy="p", group_size=2)
    async with ReplicaFollower(bus, "p") as follower:
        group = await generate_group(
            ref.http,
            config,
            ReverseDigits(3),
            Group(prompt_index=0),
            "407.",
            itertools.count(),
            versions=VersionRouter(follower, wait_s=1),
            constraint=VersionConstraint(min_version=2),
        )
    assert [s.weight_versions for s in group.samples] == [["2", "3"], ["2", "3"]]
    assert group_versions(group).oldest == 2
    assert judge(group_versions(group), 3, max_staleness=0).reason == "stale"  # judged by its start, v2


# --- miles: publication and replica convergence ----------------------------------------------------------------


async def test_publication_1_a_version_number_names_one_set_of_bytes(bus: MemoryBus) -> None:
    """Requirement 1, "an immutable version identifier": the held version announced again with another manifest
    digest is rejected (``conflicting_artifact``) and the first announcement is kept."""
    pub = await VersionPublisher(bus, "p", trainer_id="t").start()
    async with pub.update(artifact=WeightArtifact(uri="/w1", manifest_digest="sha256:" + "a" * 64)):
        pass
    registry = CollectorRegistry()
    async with VersionTracker(bus, "p", registry=registry) as tracker:
        assert pub.state.last_event is not None
        again = msgspec.structs.replace(
            pub.state.last_event,
            published_at=now(),
            artifact=WeightArtifact(uri="/w1", manifest_digest="sha256:" + "b" * 64),
        )
        await bus.publish(subjects.weights("p"), again, msg_id="again")
        labels = {"policy": "p", "reason": "conflicting_artifact"}
        await wait_until(lambda: sample(registry, "weightbus_events_rejected_total", **labels) == 1)
        assert tracker.current == 1
        assert tracker.state.digest == "sha256:" + "a" * 64


async def test_publication_1_a_delta_on_an_unannounced_base_is_rejected(bus: MemoryBus) -> None:
    """Requirement 1, "its base lineage": a delta whose base was never announced (2, reserved for an update that
    failed; the delta's own number 3 was reserved too) is rejected (``unexplained_base``) by a tracker that holds
    the chain."""
    pub = await VersionPublisher(bus, "p", trainer_id="t").start()
    async with pub.update(artifact=WeightArtifact(uri="/w1")):
        pass
    for _ in range(2):  # 2 and 3 are taken and their pushes fail: no weights ever carried them
        with pytest.raises(RuntimeError):
            async with pub.update():
                raise RuntimeError("push failed")
    registry = CollectorRegistry()
    async with VersionTracker(bus, "p", registry=registry) as tracker:
        assert pub.state.last_event is not None
        forged = msgspec.structs.replace(
            pub.state.last_event,
            version=3,
            published_at=now(),
            artifact=WeightArtifact(uri="/d3", lineage="delta", base=2),
        )
        await bus.publish(subjects.weights("p"), forged, msg_id="forged")
        labels = {"policy": "p", "reason": "unexplained_base"}
        await wait_until(lambda: sample(registry, "weightbus_events_rejected_total", **labels) == 1)
        assert tracker.current == 1


async def test_publication_2_the_announcement_follows_the_stamp_and_read_back(bus: MemoryBus, ref: Engines) -> None:
    """Requirement 2, "atomic visibility of the completed version": ``WeightUpdated(v)`` is published only once every
    engine it names reads back ``v`` (still paused), and an update whose push fails announces nothing."""
    seen: list[tuple[str, int, dict[str, str], bool]] = []

    async def at_publish(subject: str, event: Event) -> None:
        if isinstance(event, WeightUpdated | WeightApplied):
            labels = {url: state.weight_version for url, state in ref.states.items()}
            paused = all(state.pause_mode is not None for state in ref.states.values())
            seen.append((type(event).__name__, event.version, labels, paused))

    fleet = EngineFleet([ref.add("a"), ref.add("b")])
    pub = await VersionPublisher(HookBus(bus, at_publish), "p", fleet=fleet, pause="retract").start()
    async with pub.update() as version:
        pass
    assert seen[0] == ("WeightUpdated", version, {A: str(version), B: str(version)}, True)
    assert sorted(name for name, *_ in seen[1:]) == ["WeightApplied", "WeightApplied"]
    with pytest.raises(RuntimeError):
        async with pub.update() as failed:
            raise RuntimeError("push failed")
    announced = [e.version for e in await stored(bus, subjects.weights("p")) if isinstance(e, WeightUpdated)]
    assert announced == [version] and failed not in announced
    assert {s.weight_version for s in ref.states.values()} == {f"quarantine:{failed}"}


async def test_publication_3_a_corrupted_artifact_is_refused_before_any_load(
    bus: MemoryBus, ref: Engines, tmp_path: Path
) -> None:
    """Requirement 3, "final-state checksums": a catch-up checks the announced digests before it touches the engine;
    bytes changed after the announcement are never loaded, the engine is quarantined and the failure counted."""
    pub = await VersionPublisher(bus, "p").start()
    _, path = await announce_full(pub, tmp_path)
    write_safetensors(path, 99)
    client = ref.add("a")
    metrics = CatchupMetrics(CollectorRegistry())
    with pytest.raises(ArtifactDigestError):
        await catch_up(bus, "p", client, metrics=metrics)
    assert loads(ref.states[A]) == [] and ref.states[A].weight_version == "quarantine:1"
    failures = sample(metrics.registry, "weightbus_catchup_failures_total", policy="p", reason="digest_mismatch")
    assert failures == 1


async def test_publication_4_a_new_or_restarted_replica_catches_up_to_the_announced_version(
    bus: MemoryBus, ref: Engines, tmp_path: Path
) -> None:
    """Requirement 4, "a way for a new or restarted replica to materialize a valid base and catch up through later
    versions": ``FleetCatchup`` brings a restarted engine and a lagging one to the announced version from the bus
    alone, each loading the announced file verified, and says so with an acknowledgement."""
    pub = await VersionPublisher(bus, "p").start()
    files = dict([await announce_full(pub, tmp_path) for _ in range(3)])
    fleet = EngineFleet([ref.add("a"), ref.add("b", weight_version="1")])
    metrics = CatchupMetrics(CollectorRegistry())
    done = await FleetCatchup(bus, "p", fleet, metrics=metrics).poll_once()
    assert {url: r.outcome for url, r in done.items()} == {A: "caught_up", B: "caught_up"}  # type: ignore[union-attr]
    for url in (A, B):
        state = ref.states[url]
        assert state.weight_version == "3" and truthful(state, files)
    acks = [(e.engine, e.version) for e in await stored(bus, subjects.applied("p")) if isinstance(e, WeightApplied)]
    assert sorted(acks) == [(A, 3), (B, 3)]
    assert sample(metrics.registry, "weightbus_catchup_total", policy="p", outcome="caught_up") == 2


async def test_publication_5_an_engine_is_not_advertised_before_its_activation_acknowledgement(
    bus: MemoryBus, ref: Engines
) -> None:
    """Requirement 5, "an activation acknowledgement before a replica advertises the new version": while the
    engines' ``WeightApplied`` events are held back, the announced version is served by no engine in the replica
    view and no request can be routed to it; each engine is advertised from its own acknowledgement."""
    gate = asyncio.Event()

    async def hold_acks(subject: str, event: Event) -> None:
        if isinstance(event, WeightApplied):
            await gate.wait()

    fleet = EngineFleet([ref.add("a"), ref.add("b")])
    pub = await VersionPublisher(HookBus(bus, hold_acks), "p", fleet=fleet, pause="retract").start()
    async with ReplicaFollower(bus, "p") as follower:

        async def update() -> int:
            async with pub.update() as version:
                pass
            return version

        running = asyncio.create_task(update())
        await follower.wait_until(lambda v: v.newest == 1 or None, 5)
        assert follower.view.serving(exact_version=1) == ()
        with pytest.raises(VersionUnavailableError):
            await VersionRouter(follower, wait_s=0.1).pick(VersionConstraint(exact_version=1))
        gate.set()
        await asyncio.wait_for(running, 5)
        assert await follower.wait_until(lambda v: v.serving(exact_version=1) == (A, B) or None, 5)


# --- miles: what to measure ------------------------------------------------------------------------------------


async def test_measure_update_phases_from_pause_to_resume_are_observed(bus: MemoryBus, ref: Engines) -> None:
    """miles: "Trainer encode and publish" and "Activation pause": weightbus times the trainer's update by phase (the
    push block, the stamp, the announcement; pause to resume), once per update; encoding is the trainer's own."""
    registry = CollectorRegistry()
    fleet = EngineFleet([ref.add("a")])
    pub = await VersionPublisher(bus, "p", fleet=fleet, pause="retract", registry=registry).start()
    update = pub.update()
    async with update:
        await asyncio.sleep(0.05)  # stands for the push
    for phase in ("take", "pause", "relabel", "push", "stamp", "announce", "resume"):
        labels = {"policy": "p", "phase": phase, "outcome": "announced"}
        assert sample(registry, "weightbus_update_phase_seconds_count", **labels) == 1, phase
    push = sample(registry, "weightbus_update_phase_seconds_sum", policy="p", phase="push", outcome="announced")
    assert push >= 0.05 and push == pytest.approx(update.phases["push"])


async def test_measure_publication_size_the_announcement_carries_no_weight_bytes(
    bus: MemoryBus, tmp_path: Path
) -> None:
    """miles: "Publication size and changed-byte density": weightbus measures neither; it moves no weights. An
    announcement of a 4 MiB file stays a small event naming it (uri and digests), whatever the file's size."""
    path = tmp_path / "big.safetensors"
    write_safetensors(path, 1)
    with path.open("ab") as f:
        f.write(bytes(4 << 20))  # trailing bytes: part of the file's digest, not of the event
    pub = await VersionPublisher(bus, "p").start()
    async with pub.update(artifact=safetensors_artifact(path)):
        pass
    [announced] = [e for e in await stored(bus, subjects.weights("p")) if isinstance(e, WeightUpdated)]
    assert announced.artifact is not None and announced.artifact.uri == str(path)
    assert len(msgspec.json.encode(announced)) < 2048


async def test_measure_version_convergence_is_timed_from_the_events(bus: MemoryBus, ref: Engines) -> None:
    """miles: "Version convergence": from a version's announcement to the acknowledgement that brought its whole fleet
    to it, in the events' own times; and each engine's activation from the same announcement."""
    registry = CollectorRegistry()
    fleet = EngineFleet([ref.add("a"), ref.add("b")])
    pub = await VersionPublisher(bus, "p", fleet=fleet, pause="retract").start()
    async with ReplicaFollower(bus, "p", metrics=ConvergenceMetrics(registry).for_policy("p")) as follower:
        async with pub.update() as version:
            pass
        await follower.wait_until(lambda v: v.serving(exact_version=version) == (A, B) or None, 5)
    [announced] = [e for e in await stored(bus, subjects.weights("p")) if isinstance(e, WeightUpdated)]
    acks = [e.published_at for e in await stored(bus, subjects.applied("p")) if isinstance(e, WeightApplied)]
    converged = sample(registry, "weightbus_version_convergence_seconds_sum", policy="p", share="1")
    assert converged == pytest.approx(max(acks) - announced.published_at)
    assert sample(registry, "weightbus_engine_activation_seconds_count", policy="p") == 2
    activation = sample(registry, "weightbus_engine_activation_seconds_sum", policy="p")
    assert activation == pytest.approx(sum(t - announced.published_at for t in acks))


async def test_measure_request_version_lag_is_observed_per_pick(bus: MemoryBus) -> None:
    """miles: "Request version lag": per constrained request, served minus requested, and newest announced minus
    served."""
    registry = CollectorRegistry()
    await publish(bus, updated(5, engines=(A, B)), ack(3, A), ack(5, B))
    async with ReplicaFollower(bus, "p") as follower:
        router = VersionRouter(follower, wait_s=1, metrics=RequestMetrics(registry).for_policy("p"))
        await router.pick(VersionConstraint(exact_version=3))
        await router.pick(VersionConstraint(min_version=4))
    assert sample(registry, "weightbus_request_version_over_requested_sum", policy="p") == 0 + 1  # 3-3, 5-4
    assert sample(registry, "weightbus_request_version_behind_newest_sum", policy="p") == 2 + 0  # 5-3, 5-5


# --- Stitch's concepts -----------------------------------------------------------------------------------------


async def test_stitch_run_epoch_a_new_run_claims_a_new_epoch_and_numbers_continue(bus: MemoryBus) -> None:
    """Stitch's run epoch forks the version space per run; weightbus never forks it: a new run's publisher claims a
    higher epoch and continues above every number issued before, so one number names one set of weights ever."""
    old = await VersionPublisher(bus, "p", trainer_id="run-1").start()
    async with old.update():
        pass
    new = await VersionPublisher(bus, "p", trainer_id="run-2").start()
    async with new.update() as version:
        pass
    claims = [e for e in await stored(bus, subjects.weights("p")) if isinstance(e, PublisherClaimed)]
    assert [c.trainer_id for c in claims] == ["run-1", "run-2"] and claims[1].epoch > claims[0].epoch
    assert version > old.state.issued
    async with VersionTracker(bus, "p") as tracker:
        assert (tracker.current, tracker.state.epoch) == (version, claims[1].epoch)


@pytest.mark.nats
async def test_stitch_pointer_cas_a_publish_on_a_stale_sequence_is_refused(nats_bus: NatsBus, policy: str) -> None:
    """Stitch's compare-and-swap of its ``latest`` pointer: weightbus's is JetStream's conditional publish on the
    subject's expected last sequence (a real nats-server here); a writer that lost the race stores nothing."""
    subject = subjects.weights(policy)
    first = await nats_bus.publish(subject, updated(1, policy=policy), msg_id=f"{policy}:1", expected_last_seq=0)
    await nats_bus.publish(subject, updated(2, policy=policy), msg_id=f"{policy}:2", expected_last_seq=first.seq)
    with pytest.raises(SequenceConflictError):
        await nats_bus.publish(subject, updated(9, policy=policy), msg_id=f"{policy}:9", expected_last_seq=first.seq)
    assert [e.version for e in await stored(nats_bus, subject) if isinstance(e, WeightUpdated)] == [1, 2]


async def test_stitch_activation_ack_a_quarantine_withdraws_what_was_acknowledged(bus: MemoryBus) -> None:
    """Stitch's replica reports a version only after activating it; weightbus's engine serves a version from its ok
    ``WeightApplied`` on, until an alert or quarantine naming it says otherwise (then it serves nothing known)."""
    await publish(bus, updated(1, engines=(A,)), ack(1, A))
    async with ReplicaFollower(bus, "p") as follower:
        assert (await follower.wait_ready(5)).engines[A].serving == 1
        quarantine = FleetQuarantined(
            policy="p", label="quarantine:2", reason="update_failed", version=2, trainer_id="t",
            published_at=time.time(), engines=(A,),
        )  # fmt: skip
        await publish(bus, quarantine)
        await follower.wait_until(lambda v: v.engines[A].serving is None or None, 5)
        with pytest.raises(VersionUnavailableError):
            await VersionRouter(follower, wait_s=0.1).pick(VersionConstraint(min_version=1))


async def test_stitch_reconcile_a_late_follower_holds_the_newest_and_never_a_lower_one(bus: MemoryBus) -> None:
    """Stitch's replicas reconcile against a monotonic pointer, so a missed notification only delays; a weightbus
    tracker started after every announcement (it missed them all) replays the history to the newest, and a lower
    version is counted as a regression, never taken."""
    pub = await VersionPublisher(bus, "p").start()
    for _ in range(3):
        async with pub.update():
            pass
    registry = CollectorRegistry()
    async with VersionTracker(bus, "p", registry=registry) as tracker:
        assert tracker.current == 3
        await publish(bus, updated(1, trainer="rogue"))
        await wait_until(lambda: sample(registry, "weightbus_version_regressions_total", policy="p") == 1)
        assert tracker.current == 3
