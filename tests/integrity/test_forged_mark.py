"""A forged counter mark on a real nats-server: it neither wedges the counter nor splits the trackers.

Any trainer credential of a policy can store a ``CounterHighWater`` on ``weightbus.<policy>.counter``.
A mark at 2**53 - 1 used to make every later trainer start exhausted and new trackers hold 2**53 - 1;
a mark at 1010 made the restarted trainer publish v1011+, which trackers already running rejected, so
training stalled. The mark now counts only as far as the weights chain explains it (``rules.marks``),
on both sides: each test asserts from the recorded events and the trackers' own state.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import updated
from tests.roles import PASSWORDS, roles_server
from weightbus.bus import ConnectOptions, NatsBus, connect, subjects
from weightbus.bus.protocol import Bus, PublishAck
from weightbus.consumers import VersionTracker
from weightbus.producers import VersionPublisher
from weightbus.producers.status import read_weights_history
from weightbus.schemas import MAX_VERSION, CounterHighWater, VersionRejected, WeightUpdated, now

from .conftest import history

pytestmark = pytest.mark.nats


async def forge_mark(bus: Bus, policy: str, version: int, tag: str = "f") -> PublishAck:
    """A mark nobody's counter took, stored as any trainer credential of the policy could store it."""
    forged = CounterHighWater(
        policy=policy, version=version, epoch=0, trainer_id="forger", published_at=now(), announced=version
    )
    return await bus.publish(subjects.counter(policy), forged, msg_id=f"{policy}:forged-mark:{tag}")


async def alerts_of(bus: Bus, policy: str, reason: str) -> list[VersionRejected]:
    return [
        e.event
        for e in await history(bus, subjects.alerts(policy), idle=0.1)
        if isinstance(e.event, VersionRejected) and e.event.reason == reason
    ]


async def wait_alerts(bus: Bus, policy: str, reason: str, timeout: float = 10.0) -> list[VersionRejected]:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (found := await alerts_of(bus, policy, reason)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    return found


def rejected_total(registry: CollectorRegistry, policy: str, reason: str) -> float:
    return registry.get_sample_value("weightbus_events_rejected_total", {"policy": policy, "reason": reason}) or 0.0


def announced(events: list) -> list[int]:
    return [e.event.version for e in events if isinstance(e.event, WeightUpdated)]


@pytest.mark.parametrize("forged", [1010, MAX_VERSION], ids=["1010", "max"])
async def test_a_forged_mark_neither_wedges_nor_splits_the_policy(nats_bus: NatsBus, policy: str, forged: int) -> None:
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    for _ in range(11):
        async with pub.update():
            pass
    async with VersionTracker(nats_bus, policy, observer="running", check_interval=0.2) as running:
        assert running.current == 11
        ack = await forge_mark(nats_bus, policy, forged)
        # The trainer restarts (no fleet, no checkpoint): it resumes above what the chain explains (12 was
        # reserved by the announcement of 11), not above the forged mark, and is never exhausted.
        restarted = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
        assert restarted.state.next_version == 13
        async with restarted.update() as version:
            assert version == 13
        assert await running.wait_for(13, 10) == 13  # the tracker that was running follows
        fresh_registry = CollectorRegistry()
        async with VersionTracker(nats_bus, policy, registry=fresh_registry, observer="fresh") as fresh:
            assert fresh.current == 13  # a new tracker agrees
            assert rejected_total(fresh_registry, policy, "unexplained_mark") == 1
            assert rejected_total(fresh_registry, policy, "counter_reset") == 0
        # And again: a second restart and the running tracker still agree.
        again = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
        async with again.update() as version:
            assert version == 15
        assert await running.wait_for(15, 10) == 15
    weights = await history(nats_bus, subjects.weights(policy))
    assert announced(weights) == [*range(1, 12), 13, 15]  # strictly above the true ones, none above the chain
    (alert,) = await wait_alerts(nats_bus, policy, "unexplained_mark")  # once, for the fleet and the trainers
    assert (alert.event_type, alert.incoming, alert.event_seq, alert.publisher) == (
        "CounterHighWater",
        forged,
        ack.seq,
        "forger",
    )
    assert await alerts_of(nats_bus, policy, "counter_reset") == []
    assert await alerts_of(nats_bus, policy, "unexplained_claim") == []
    # status folds the same rule: the counter line is the explained mark, the forged one is listed.
    status = await read_weights_history(nats_bus, policy)
    assert status.state.version == 15 and status.issued is not None and status.issued <= 16
    assert [u.mark.version for u in status.unexplained_marks] == [forged]


async def test_a_mark_forged_while_the_trainer_runs_is_superseded_and_never_credited_later(
    nats_bus: NatsBus, policy: str
) -> None:
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    for _ in range(3):
        async with pub.update():
            pass
    await forge_mark(nats_bus, policy, 1010)
    # The running owner's next take finds the forged mark newest: it stores its own after it.
    for _ in range(2):
        async with pub.update():
            pass
    await pub.settle()  # the mark after the last announcement (deferred by mark_delay) is written
    newest = await nats_bus.last(subjects.counter(policy))
    assert newest is not None and isinstance(newest.event, CounterHighWater) and newest.event.version == 6
    # Then the whole weights history is evicted (264 low writes; 256 are retained): only the marks remain,
    # and the forged one, superseded by a lower mark, is void; the real ones keep their guarantee.
    for i in range(264):
        low = updated(1, policy=policy, epoch=0, trainer="rogue")
        await nats_bus.publish(subjects.weights(policy), low, msg_id=f"{policy}:low:{i}")
    restarted = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    async with restarted.update() as version:
        assert version == 7  # above the real mark (6, reserved by the announcement of 5), not 1011
    registry = CollectorRegistry()
    async with VersionTracker(nats_bus, policy, registry=registry) as tracker:
        assert tracker.current == 7
        assert rejected_total(registry, policy, "unexplained_mark") == 1


class Follower:
    """A ``weightbus follow --json`` process (a rollout's tracker) under the policy's rollout credential."""

    def __init__(self, url: str, policy: str, out: Path, env: dict[str, str]) -> None:
        self.out = out
        self._file = out.open("w")
        self._log = out.with_suffix(".log").open("w")
        argv = [sys.executable, "-m", "weightbus", "follow", "--policy", policy, "--nats", url, "--json"]
        self.popen = subprocess.Popen(argv, stdout=self._file, stderr=self._log, env=env)

    def versions(self) -> list[int | None]:
        lines = [ln for ln in self.out.read_text().splitlines() if ln.startswith("{")]
        return [json.loads(ln)["version"] for ln in lines]

    def wait_for(self, version: int, timeout: float = 60.0) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while version not in self.versions():
            assert self.popen.poll() is None, self.out.read_text()
            assert time.monotonic() < deadline, f"never saw v{version}: {self.out.read_text()}"
            time.sleep(0.1)
        return self.versions()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._file.close()
        self._log.close()


def _env(user: str) -> dict[str, str]:
    return {**os.environ, "WEIGHTBUS_USER": user, "WEIGHTBUS_PASSWORD": PASSWORDS[user]}


async def _as(url: str, user: str) -> NatsBus:
    return await connect(url, options=ConnectOptions(user=user, password=PASSWORDS[user]))


@pytest.mark.slow
@pytest.mark.parametrize("forged", [1010, MAX_VERSION], ids=["1010", "max"])
def test_a_forged_mark_with_a_trainer_credential_stops_no_real_process(tmp_path: Path, forged: int) -> None:
    """Real processes under the shipped roles: running and new trackers follow a restarted trainer past the mark."""
    policy = "policy-a"
    followers: list[Follower] = []
    with roles_server(tmp_path / "js") as server:
        url = server.url

        async def first_trainer() -> None:
            bus = await _as(url, "trainer-policy-a")
            try:
                pub = await VersionPublisher(bus, policy, trainer_id="t").start()
                for _ in range(11):
                    async with pub.update():
                        pass
            finally:
                await bus.aclose()

        async def forge() -> int:
            bus = await _as(url, "trainer-policy-a")  # the policy's own trainer credential, as the issue found
            try:
                return (await forge_mark(bus, policy, forged)).seq
            finally:
                await bus.aclose()

        try:
            asyncio.run(first_trainer())
            rollout = _env("rollout-policy-a")
            followers += [Follower(url, policy, tmp_path / f"running-{i}.jsonl", rollout) for i in (0, 1)]
            for f in followers:
                f.wait_for(11)
            forged_seq = asyncio.run(forge())
            published = []
            for _ in range(2):  # the trainer restarts twice, as a process, with no fleet and no checkpoint
                run = subprocess.run(
                    [sys.executable, "-m", "weightbus", "publish", "--policy", policy, "--nats", url]
                    + ["--no-engines", "--takeover", "--trainer-id", "t"],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    env=_env("trainer-policy-a"),
                )
                assert run.returncode == 0, run.stderr
                published.append(int(run.stdout.strip()))
            assert published == [13, 14]  # 12 was reserved by the announcement of 11
            for f in followers:
                assert f.wait_for(14)[-2:] == [13, 14]  # the trackers that were running follow
            fresh = Follower(url, policy, tmp_path / "fresh.jsonl", rollout)
            followers.append(fresh)
            assert fresh.wait_for(14) == [14]  # a new tracker agrees at once

            async def recorded() -> None:
                bus = await _as(url, "monitor")
                try:
                    weights = await history(bus, subjects.weights(policy))
                    assert announced(weights) == [*range(1, 12), 13, 14]
                    (alert,) = await wait_alerts(bus, policy, "unexplained_mark")
                    assert (alert.incoming, alert.event_seq) == (forged, forged_seq)
                    assert await alerts_of(bus, policy, "counter_reset") == []
                    registry = CollectorRegistry()
                    async with VersionTracker(bus, policy, registry=registry) as tracker:
                        assert tracker.current == 14
                        assert rejected_total(registry, policy, "unexplained_mark") == 1
                finally:
                    await bus.aclose()

            asyncio.run(recorded())
            status = subprocess.run(
                [sys.executable, "-m", "weightbus", "status", "--policy", policy, "--nats", url, "--json"],
                capture_output=True,
                text=True,
                timeout=60,
                env=_env("monitor"),
            )
            doc = json.loads(status.stdout)
            assert (status.returncode, doc["version"]) == (0, 14), status.stderr
            assert [m["version"] for m in doc["unexplained_marks"]] == [forged]
        finally:
            for f in followers:
                f.stop()
