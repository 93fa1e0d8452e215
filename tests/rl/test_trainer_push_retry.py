"""The trainer's push retries by the error axis alone: a retryable error until ``_PUSH_PATIENCE``, a final one never.

The loop's clock is the module's ``time``; a fake one, advanced by each failed attempt, stands for the 60 s.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

import weightbus.errors as errors
import weightbus.rl.trainer as rl_trainer
from weightbus.errors import WeightbusError

_ERRORS = sorted(
    (c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, WeightbusError)),
    key=lambda c: c.__name__,
)


def _error(cls: type[WeightbusError]) -> WeightbusError:
    """An instance without the class's own arguments: the loop reads only its type and its message."""
    exc = cls.__new__(cls)
    exc.args = (f"a {cls.__name__}",)
    return exc


class _Pushes:
    """Stands for the trainer: each ``_push_once`` raises the next planned error, then announces ``version``."""

    def __init__(self, failures: list[BaseException], clock: list[float], step_s: float) -> None:
        self.failures = list(failures)
        self.clock = clock
        self.step_s = step_s
        self.attempts = 0

    async def _push_once(self, pub: Any, fleet: Any) -> int:
        self.attempts += 1
        self.clock[0] += self.step_s
        if self.failures:
            raise self.failures.pop(0)
        return 7


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(rl_trainer, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(rl_trainer, "_PUSH_RETRY_DELAY", 0.0)
    return now


async def _push(pushes: _Pushes) -> int:
    return await rl_trainer._Trainer.push(pushes, SimpleNamespace(state=SimpleNamespace(next_version=7)), fleet=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", _ERRORS, ids=lambda c: c.__name__)
async def test_a_retryable_error_is_retried_and_a_final_one_is_raised_at_once(
    cls: type[WeightbusError], clock: list[float]
) -> None:
    pushes = _Pushes([_error(cls), _error(cls)], clock, step_s=1.0)
    if cls.retryable:
        assert await _push(pushes) == 7
        assert pushes.attempts == 3
    else:
        with pytest.raises(cls):
            await _push(pushes)
        assert pushes.attempts == 1


async def test_an_exhausted_counter_is_not_retried_for_the_patience(clock: list[float]) -> None:
    exhausted = errors.CounterExhaustedError("weightbus.p.weights", "p", 2**53 - 1)
    pushes = _Pushes([exhausted], clock, step_s=0.0)
    with pytest.raises(errors.CounterExhaustedError):
        await _push(pushes)
    assert pushes.attempts == 1 and clock[0] == 1000.0


async def test_a_retryable_error_is_raised_once_the_patience_is_spent(clock: list[float]) -> None:
    down = errors.PublishError("weightbus.p.weights", "no acknowledgement")
    pushes = _Pushes([down] * 100, clock, step_s=rl_trainer._PUSH_PATIENCE / 4)
    with pytest.raises(errors.PublishError):
        await _push(pushes)
    assert pushes.attempts == 5  # the fifth failure lands past the deadline


async def test_an_error_of_no_weightbus_kind_is_not_retried(clock: list[float]) -> None:
    pushes = _Pushes([OSError("disk full")], clock, step_s=0.0)
    with pytest.raises(OSError, match="disk full"):
        await _push(pushes)
    assert pushes.attempts == 1
