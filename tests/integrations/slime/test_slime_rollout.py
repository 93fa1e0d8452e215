"""The rollout half inside slime's fully-async rollout (``--rollout-function-path
weightbus.integrations.slime.generate_rollout``), driven by slime's own worker, queue, data buffer and
RolloutManager (the stand-in) on a real nats-server.

The trainer publishes a new version after each rollout, two at a time, while slime's worker keeps a pool of
groups running and a queue of finished ones warm: queued groups fall behind. Each test runs the same scenario
through slime's own rollout function as well (the control), where the checks fail: slime has no bound at all.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._builders import wait_until
from tests.integrations.slime import slime_standin as standin
from tests.integrations.slime.slime_standin import SLIME_ROLLOUT, WEIGHTBUS_ROLLOUT, announce, make_args, oldest
from weightbus.bus import NatsBus

pytestmark = [pytest.mark.nats, pytest.mark.usefixtures("slime_modules")]

BOUND, STEP, STEPS, QUEUE = 1, 2, 5, 4  # QUEUE: slime's worker concurrency (4 groups x 1 engine)


@pytest.fixture
def slime_env(nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_MAX_STALENESS", str(BOUND))
    monkeypatch.setenv("WEIGHTBUS_ADMISSION", "off")  # the drain alone: admission has its own tests
    standin.fresh_engine()
    return policy


async def _train(bus: NatsBus, policy: str, rollout: str, steps: int = STEPS) -> tuple[Any, list[tuple[int, Any]]]:
    """``steps`` rollouts, the version two higher after each; (the manager, [(version at return, group)])."""
    from slime.ray.rollout import RolloutManager  # type: ignore[import-not-found]

    args = make_args(
        rollout_function_path=rollout,
        custom_generate_function_path="tests.integrations.slime.slime_standin.engine_generate",
    )
    await announce(bus, policy, 1)
    manager = RolloutManager(args)
    trained: list[tuple[int, Any]] = []
    for step in range(steps):
        groups = await standin.in_thread(manager.generate, step, timeout=60)
        trained += [(standin.ENGINE.version, group) for group in groups]
        # The training step: meanwhile slime's worker fills its queue with groups of the weights trained now.
        await wait_until(lambda: _worker().queue_size() >= QUEUE, 10, "slime's queue to fill")
        for _ in range(STEP):
            standin.ENGINE.version += 1
            await announce(bus, policy, standin.ENGINE.version)
        if rollout == WEIGHTBUS_ROLLOUT:
            from weightbus.integrations.slime.rollout import active_rollout

            session = active_rollout()
            assert session is not None and session.tracker is not None
            tracker, version = session.tracker, standin.ENGINE.version
            await wait_until(lambda: tracker.current == version, 5, "the tracker to follow")  # noqa: B023
    return manager, trained


def _worker() -> Any:
    import slime.rollout.fully_async_rollout as far  # type: ignore[import-not-found]

    return far._global_worker


def _over_bound(trained: list[tuple[int, Any]]) -> list[tuple[int, int]]:
    return [(version, oldest(group)) for version, group in trained if version - oldest(group) > BOUND]


@pytest.mark.parametrize("on_stale", ["recycle", "drop"])
async def test_stale_groups_are_recycled_or_dropped_by_the_bound(
    nats_bus: NatsBus, slime_env: str, monkeypatch: pytest.MonkeyPatch, on_stale: str
) -> None:
    monkeypatch.setenv("WEIGHTBUS_ON_STALE", on_stale)
    manager, trained = await _train(nats_bus, slime_env, WEIGHTBUS_ROLLOUT)
    from weightbus.integrations.slime.rollout import active_rollout

    session = active_rollout()
    assert session is not None
    assert len(trained) == STEPS * 4
    assert _over_bound(trained) == []  # no trained group exceeds the bound
    metrics = [m for m in manager.metrics if m]
    not_kept = sum(m["weightbus/recycled"] + m["weightbus/dropped"] for m in metrics)
    assert not_kept > 0  # the scenario does make groups stale
    assert sum(m["rollout/fully_async/stale_groups_filtered"] for m in metrics) == not_kept
    source = manager.data_source
    if on_stale == "recycle":
        assert sum(m["weightbus/recycled"] for m in metrics) == not_kept == len(session.recycled)
        # Recycled pristine, as handed out: no labels, no response; slime regenerates them from the prompt.
        assert len(source.added) == not_kept
        assert all(s.weight_versions == [] and s.response_length == 0 for g in source.added for s in g)
        assert all(s.status.value == "pending" for g in source.added for s in g)
    else:
        assert source.added == [] and session.recycled == []
    # Nothing lost: every group handed out was trained, recycled, dropped (counted), or is still in slime's worker.
    served = [g[0].group_index for g in source.served]
    trained_keys = {g[0].group_index for _, g in trained}
    recycled = [g[0].group_index for g in session.recycled]
    in_worker = len(served) - len(trained_keys) - len(recycled) - sum(m["weightbus/dropped"] for m in metrics)
    assert 0 <= in_worker <= 2 * 4  # at most slime's pool plus its queue


async def test_control_slime_alone_trains_groups_over_any_bound(nats_bus: NatsBus, slime_env: str) -> None:
    # slime's own fully-async rollout in the same scenario: the queue's groups are trained however old.
    manager, trained = await _train(nats_bus, slime_env, SLIME_ROLLOUT)
    assert len(trained) == STEPS * 4
    assert _over_bound(trained) != []
    assert manager.data_source.added == []  # nothing is recycled but aborted groups
