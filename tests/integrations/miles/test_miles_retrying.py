"""The miles cell retries bus access by the error axis alone: a retryable bus error until the update timeout,
a final one never; an engine's failure is not the bus's and fails miles' update at once.

The loop's clock and sleep are the module's ``time``; a fake one, advanced by each sleep, stands for the timeout.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

import weightbus.errors as errors
import weightbus.integrations.host.cell as miles_cell
from weightbus.errors import BusError, WeightbusError
from weightbus.integrations.miles.trainer import MILES

_BUS_ERRORS = sorted(
    (c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, BusError)),
    key=lambda c: c.__name__,
)


def _error(cls: type[WeightbusError]) -> WeightbusError:
    """An instance without the class's own arguments: the loop reads only its type and adds a note."""
    exc = cls.__new__(cls)
    exc.args = (f"a {cls.__name__}",)
    return exc


class _FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        self.now += 1e-6  # an attempt takes some time: a failure exactly at the deadline is retried once, not forever
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _FakeTime:
    fake = _FakeTime()
    monkeypatch.setattr(miles_cell, "time", fake)
    return fake


def _retrying(failures: list[BaseException], timeout: float = 60.0) -> tuple[Any, list[int]]:
    """Run the cell's loop over an attempt that raises each planned failure, then returns ``"taken"``."""
    attempts = [0]
    planned = list(failures)

    def attempt() -> str:
        attempts[0] += 1
        if planned:
            raise planned.pop(0)
        return "taken"

    cell = SimpleNamespace(host=MILES, settings=SimpleNamespace(policy="p", update_timeout=timeout))
    result = miles_cell.Cell._retrying(cell, attempt, "taking a version", "nothing was pushed")  # type: ignore[arg-type]
    return result, attempts


@pytest.mark.parametrize("cls", _BUS_ERRORS, ids=lambda c: c.__name__)
def test_a_retryable_bus_error_is_retried_and_a_final_one_is_raised_at_once(
    cls: type[BusError], clock: _FakeTime
) -> None:
    if cls.retryable:
        result, attempts = _retrying([_error(cls), _error(cls)])
        assert (result, attempts, len(clock.slept)) == ("taken", [3], 2)
        assert 0 <= clock.slept[0] <= 0.2 and 0 <= clock.slept[1] <= 0.4  # jittered under 0.2 s doubling
    else:
        with pytest.raises(cls) as info:
            _retrying([_error(cls), _error(cls)])
        assert clock.slept == []
        assert any("does not retry taking a version" in note for note in info.value.__notes__)


def test_an_exhausted_counter_is_not_retried(clock: _FakeTime) -> None:
    with pytest.raises(errors.CounterExhaustedError):
        _retrying([errors.CounterExhaustedError("weightbus.p.weights", "p", 2**53 - 1)])
    assert clock.slept == []


def test_a_retryable_bus_error_is_raised_once_the_timeout_is_spent(clock: _FakeTime) -> None:
    down = errors.BusConnectError("nats://h:1", "refused", "refused")
    with pytest.raises(errors.BusConnectError) as info:
        _retrying([down] * 10_000, timeout=2.5)  # jittered waits may be short: many attempts fit
    assert clock.slept and sum(clock.slept) <= 2.5  # no wait ends past the timeout
    assert any("gave up taking a version after 2.5s" in note for note in info.value.__notes__)


def test_an_engine_error_is_not_the_bus_s_to_retry(clock: _FakeTime) -> None:
    assert errors.EngineError.retryable  # retryable where a loop wraps the engines (the rl trainer's push)
    with pytest.raises(errors.EngineError):
        _retrying([errors.EngineError("http://e1", None, "no answer")])
    assert clock.slept == []
