"""Admission at slime's top-up gate: ``GatedDataBuffer.get_samples`` hands a prompt group out only with a slot.

Driven by slime's own worker (the stand-in) on a real nats-server. While the horizon is full the worker's top-up
gets ``[]`` and waits, as its own queue gate makes it wait; a new version frees the horizon and it resumes. The
same scenario through slime's own rollout function (the control) never holds: slime has no bound at all. Under a
NATS restart no group is admitted on a guess and nothing handed out is lost.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests._builders import wait_until
from tests.integrations.slime import slime_standin as standin
from tests.integrations.slime.slime_standin import SLIME_ROLLOUT, WEIGHTBUS_ROLLOUT, announce, make_args, oldest
from weightbus.bus import NatsBus
from weightbus.errors import BusError

pytestmark = [pytest.mark.nats, pytest.mark.usefixtures("slime_modules")]

BOUND, BATCH, POOL = 1, 4, 8  # POOL: slime's worker keeps up to 8 groups running and 8 queued
ALLOWANCE = (BOUND + 1) * BATCH  # rules.admission: what may be running or accepted in the horizon


@pytest.fixture
def slime_env(nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_MAX_STALENESS", str(BOUND))
    standin.fresh_engine()
    return policy


def _args(rollout: str) -> Any:
    return make_args(
        rollout_batch_size=BATCH,
        sglang_server_concurrency=POOL,
        rollout_function_path=rollout,
        custom_generate_function_path="tests.integrations.slime.slime_standin.engine_generate",
    )


def _served(manager: Any) -> int:
    return len(manager.data_source.served)


@pytest.mark.parametrize("rollout", [WEIGHTBUS_ROLLOUT, SLIME_ROLLOUT])
async def test_admission_holds_the_top_up_while_the_horizon_is_full_and_resumes(
    nats_bus: NatsBus, slime_env: str, rollout: str
) -> None:
    from slime.ray.rollout import RolloutManager  # type: ignore[import-not-found]

    await announce(nats_bus, slime_env, 1)
    manager = RolloutManager(_args(rollout))
    first = await standin.in_thread(manager.generate, 0, timeout=30)
    assert all(oldest(g) == 1 for g in first)
    if rollout == SLIME_ROLLOUT:
        # The control: slime's own gate lets its pool and its queue fill, past anything the bound allows.
        await wait_until(lambda: _served(manager) > ALLOWANCE, 10, "slime to top up past the allowance")
        return
    from weightbus.integrations.slime.rollout import active_rollout

    session = active_rollout()
    assert session is not None and session.gate is not None
    gate = session.gate
    # The batch trained at v1 and the groups running fill the horizon: the top-up gets [] and waits.
    await wait_until(lambda: _served(manager) == ALLOWANCE and gate.capacity() <= 0, 10, "the horizon to fill")
    await asyncio.sleep(10 * 0.05)  # ten of the worker's top-ups: none may hand out a group
    assert _served(manager) == ALLOWANCE and gate.used <= gate.allowance
    # v3: the batch trained at v1 leaves the horizon (3 - 1 > BOUND), the top-up resumes.
    for version in (2, 3):
        await announce(nats_bus, slime_env, version)
    standin.ENGINE.version = 3
    await wait_until(lambda: _served(manager) > ALLOWANCE, 10, "the top-up to resume")
    second = await standin.in_thread(manager.generate, 1, timeout=30)
    assert [3 - oldest(g) for g in second if 3 - oldest(g) > BOUND] == []
    assert gate.used <= gate.allowance


@pytest.mark.slow
@pytest.mark.usefixtures("quick_outage_timeouts")
@pytest.mark.parametrize("shared", [False, True])
async def test_admission_through_a_nats_restart_admits_nothing_on_a_guess_and_loses_nothing(
    tmp_path: Any, policy: str, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    # The server is this test's own: killed between two rollouts, restarted on its store a while later.
    from slime.ray.rollout import RolloutManager

    from weightbus.bus import connect
    from weightbus.embedded.server import EmbeddedNats
    from weightbus.integrations.slime.rollout import SlimeRollout, active_rollout

    server = EmbeddedNats(store_dir=tmp_path / "store").start()
    monkeypatch.setenv("WEIGHTBUS_NATS", server.url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_MAX_STALENESS", str(BOUND))
    if shared:
        monkeypatch.setenv("WEIGHTBUS_ADMISSION_SHARED", "1")
    standin.fresh_engine()
    grants: list[tuple[bool, int]] = []  # at each top-up: could the tracker say what is current, groups handed out
    hand_out = SlimeRollout.hand_out

    def recording(self: SlimeRollout, num_samples: int) -> list[list[Any]]:
        ready = self.tracker is not None and self.tracker.ready
        out = hand_out(self, num_samples)
        grants.append((ready, len(out)))
        return out

    monkeypatch.setattr(SlimeRollout, "hand_out", recording)
    bus = await connect(server.url, publish_timeout=1.0, publish_attempts=2)

    async def announce_until_stored(version: int) -> None:
        for _ in range(100):
            try:
                await announce(bus, policy, version)
                return
            except BusError:
                await asyncio.sleep(0.1)
        raise AssertionError(f"v{version} was never stored")

    steps, restart_after = 6, 2
    trained: list[tuple[int, Any]] = []
    outage: list[tuple[bool, int]] = []
    try:
        await announce_until_stored(1)
        manager = RolloutManager(_args(WEIGHTBUS_ROLLOUT))
        for step in range(steps):
            version = step + 1
            groups = await standin.in_thread(manager.generate, step, timeout=60)
            trained += [(version, g) for g in groups]
            standin.ENGINE.version = version + 1
            if step == restart_after:
                session = active_rollout()
                assert session is not None and session.tracker is not None
                tracker = session.tracker
                server.kill()
                await wait_until(lambda: not tracker.ready, 20, "the tracker to know it cannot say")  # noqa: B023
                not_ready_at = len(grants)
                await asyncio.sleep(1.0)  # the outage: down a while, as a restart is
                outage = grants[not_ready_at:]
                await asyncio.to_thread(server.start)
            await announce_until_stored(version + 1)
    finally:
        await bus.aclose()
        from weightbus.integrations.slime.rollout import shutdown

        shutdown()
        server.stop()
    assert len(trained) == steps * BATCH  # training went on through the restart
    assert [(v, oldest(g)) for v, g in trained if v - oldest(g) > BOUND] == []
    # No group handed out while the tracker could not say what is current.
    assert [n for ready, n in grants if not ready and n > 0] == []
    assert outage != [] and all(n == 0 for _, n in outage)  # slime's worker kept asking; it got nothing
    # Nothing lost: each group handed out was trained, recycled, or is still in slime's worker (pool and queue).
    source = manager.data_source
    served = [g[0].group_index for g in source.served]
    accounted = len({g[0].group_index for _, g in trained}) + len(source.added)
    assert 0 <= len(served) - accounted <= 2 * POOL


@pytest.mark.slow
@pytest.mark.usefixtures("quick_outage_timeouts")
async def test_a_rollout_waits_out_an_outage_longer_than_its_ready_timeout_and_ends_nothing(
    tmp_path: Any, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # slime's training loop has no retry: a rollout that raised while NATS was down would end a job that, without
    # weightbus, would have gone on. Admission off, so collected groups reach the judge while the bus is down.
    from slime.ray.rollout import RolloutManager

    from weightbus.bus import connect
    from weightbus.embedded.server import EmbeddedNats
    from weightbus.integrations.slime.rollout import active_rollout, shutdown

    server = EmbeddedNats(store_dir=tmp_path / "store").start()
    for name, value in {
        "WEIGHTBUS_NATS": server.url,
        "WEIGHTBUS_POLICY": policy,
        "WEIGHTBUS_MAX_STALENESS": str(BOUND),
        "WEIGHTBUS_ADMISSION": "off",
        "WEIGHTBUS_READY_TIMEOUT": "0.2",
    }.items():
        monkeypatch.setenv(name, value)
    standin.fresh_engine()
    bus = await connect(server.url, publish_timeout=1.0, publish_attempts=2)
    trained: list[tuple[int, Any]] = []
    try:
        await announce(bus, policy, 1)
        manager = RolloutManager(_args(WEIGHTBUS_ROLLOUT))
        trained += [(1, g) for g in await standin.in_thread(manager.generate, 0, timeout=60)]
        standin.ENGINE.version = 2
        await announce(bus, policy, 2)
        session = active_rollout()
        assert session is not None and session.tracker is not None
        tracker = session.tracker
        await wait_until(lambda: tracker.ready and tracker.current == 2, 20, "the tracker to hold v2")
        server.kill()
        await wait_until(lambda: not tracker.ready, 20, "the tracker to know it cannot say")
        rollout = asyncio.ensure_future(standin.in_thread(manager.generate, 1, timeout=60))
        await asyncio.sleep(1.5)  # the outage, held: seven ready timeouts long
        assert not rollout.done(), rollout.exception() if rollout.done() else None  # waiting, not ended
        await asyncio.to_thread(server.start)
        groups = await rollout
        trained += [(2, g) for g in groups]
    finally:
        await bus.aclose()
        shutdown()
        server.stop()
    assert len(groups) == BATCH  # the rollout slime asked for, once the bus was back
    assert [(v, oldest(g)) for v, g in trained if v - oldest(g) > BOUND] == []
