"""Loading the slime stand-in (``standin/slime``, under slime's module paths) for one test, and its pieces.

``slime_modules`` puts the stand-in first on ``sys.path`` and, at the end, closes weightbus' sessions, stops slime's
worker and loop threads and forgets every ``slime`` module, so the next test starts from a fresh process' state.
``Engine`` is an engine as a custom generate function sees it: the weights it holds label each sample.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._builders import updated
from weightbus.bus import subjects
from weightbus.bus.protocol import Bus

STANDIN = Path(__file__).parent / "standin"
WEIGHTBUS_ROLLOUT = "weightbus.integrations.slime.generate_rollout"
SLIME_ROLLOUT = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


def _forget() -> None:
    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        del sys.modules[name]


@pytest.fixture
def slime_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stand-in importable as ``slime``; a clean slate at the end (see the module)."""
    from weightbus.integrations.slime import abort, rollout

    _forget()
    monkeypatch.syspath_prepend(str(STANDIN))
    import slime.rollout.fully_async_rollout as far  # type: ignore[import-not-found]

    far.POLL_INTERVAL = 0.05  # slime's 1 s between top-ups, shortened: the tests' runs take seconds, not minutes
    try:
        yield
    finally:
        rollout.shutdown()
        abort.forget_functions()
        import slime.rollout.fully_async_rollout as far2
        import slime.utils.async_utils as au  # type: ignore[import-not-found]
        from slime.utils.misc import SingletonMeta  # type: ignore[import-not-found]

        far2._stop_global_worker()
        if au.async_loop is not None:
            au.async_loop.stop()
        SingletonMeta._instances.clear()
        _forget()


def release() -> None:
    """Cancel what runs on slime's background loop: a thread blocked in slime's ``run()`` returns (a failed test)."""
    import slime.utils.async_utils as au  # type: ignore[import-not-found]

    loop = au.async_loop.loop if au.async_loop is not None else None
    if loop is not None and loop.is_running():

        def cancel_all() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()

        loop.call_soon_threadsafe(cancel_all)


async def in_thread(fn: Any, *args: Any, timeout: float = 60) -> Any:
    """``fn(*args)`` in a thread (slime's blocking calls), within ``timeout``; a failure releases slime's loop first,
    so that the thread ends and the test's loop can close."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout)
    except BaseException:
        release()
        raise


def make_args(**overrides: Any) -> argparse.Namespace:
    """slime's namespace, the flags the rollout side reads (defaults as slime's, where it has them)."""
    settings: dict[str, Any] = dict(
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        rollout_global_dataset=True,
        sglang_server_concurrency=4,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        sglang_router_ip="127.0.0.1",
        sglang_router_port=1,
        rollout_max_response_len=8,
        custom_generate_function_path=None,
        data_source_path="slime.rollout.data_source.RolloutDataSourceWithBuffer",
        rollout_function_path=WEIGHTBUS_ROLLOUT,
    )
    return argparse.Namespace(**(settings | overrides))


class Engine:
    """The engines as a custom generate function sees them: ``version`` labels each sample when it answers."""

    def __init__(self, seed: int = 7) -> None:
        self.version = 1
        self.rng = random.Random(seed)
        self.starts: list[int] = []

    async def generate(self, args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
        self.starts.append(sample.group_index)
        await asyncio.sleep(self.rng.uniform(0.001, 0.02))
        sample.weight_versions.append(str(self.version))
        sample.response, sample.response_length = "ok", 2
        sample.status = type(sample).Status.COMPLETED
        return sample


ENGINE = Engine()


async def engine_generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """``--custom-generate-function-path tests.integrations.slime.slime_standin.engine_generate``."""
    return await ENGINE.generate(args, sample, sampling_params)


def fresh_engine() -> Engine:
    global ENGINE
    ENGINE = Engine()
    return ENGINE


async def announce(bus: Bus, policy: str, version: int) -> None:
    """The trainer half's ``WeightUpdated`` for ``version`` (stored once: its msg id)."""
    event = updated(version, policy=policy, trainer="trainer")
    await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:1:{version}")


def oldest(group: list[Any]) -> int:
    """The oldest version a slime group's samples name."""
    return min(int(label) for sample in group for label in sample.weight_versions)
