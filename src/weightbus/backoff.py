"""How long a retry loop waits, and the loops that wait so: the one home of weightbus's retry schedule.

``Backoff`` is the schedule, pure (no clock, no I/O; the randomness is injectable): after failed attempt ``n`` the
wait is drawn uniformly from ``[0, min(cap_s, first_s * factor ** (n - 1))]`` ("full jitter"), so clients that
failed together do not retry together; its budget is at most ``attempts`` calls and no wait past ``deadline_s``.
Jitter only shortens a wait: a jittered schedule never waits longer in total than its ceilings, nor past its
deadline. ``retry_async`` and ``retry_sync`` run one call under a schedule: they retry only what ``retry_on``
accepts (by default an error whose class says ``retryable``, see ``weightbus.errors``), and once the budget is
spent raise the last error with a note saying how many attempts over how long. A cancel is never retried: it
ends a wait at once and propagates. The glossary's **backoff** points here; nothing else tells it.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from weightbus.errors import is_retryable

__all__ = ["Backoff", "retry_async", "retry_sync"]

_T = TypeVar("_T")

#: What a loop does before each wait: ``(the error, the attempt that failed (1 = the first call), the wait in s)``.
_OnRetry = Callable[[Exception, int, float], object]


@dataclass(frozen=True, slots=True)
class Backoff:
    """An exponential schedule with full jitter and a budget.

    Attributes:
        first_s: the ceiling of the first wait, in seconds (0: never wait, for tests).
        cap_s: no wait is longer.
        factor: each ceiling is this times the previous one (1: a fixed ceiling).
        deadline_s: the total budget from the start of the first attempt: no wait ends after it, and a failure
            after it is final (None: no deadline).
        attempts: the most calls, the first included (None: no limit).

    Raises:
        ValueError: a negative time, a factor below 1 or fewer than one attempt.
    """

    first_s: float = 0.1
    cap_s: float = 2.0
    factor: float = 2.0
    deadline_s: float | None = None
    attempts: int | None = None

    def __post_init__(self) -> None:
        if self.first_s < 0 or self.cap_s < 0 or (self.deadline_s is not None and self.deadline_s < 0):
            raise ValueError(f"backoff times must be >= 0, got {self}")
        if self.factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {self.factor}")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"backoff attempts must be >= 1, got {self.attempts}")

    def ceiling(self, attempt: int) -> float:
        """The longest wait after failed attempt ``attempt`` (1 = the first call): never decreasing, at most
        ``cap_s``."""
        if attempt < 1:
            raise ValueError(f"attempts count from 1, got {attempt}")
        top = min(self.first_s, self.cap_s)
        if self.factor == 1 or top == 0 or top == self.cap_s:
            return top
        # From this attempt on the cap holds; computing factor ** n past it could overflow a float.
        if attempt - 1 >= math.log(self.cap_s / self.first_s, self.factor):
            return self.cap_s
        return min(self.cap_s, self.first_s * self.factor ** (attempt - 1))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """A wait after failed attempt ``attempt``, drawn from ``[0, ceiling(attempt)]``, budget aside.

        ``rng`` None draws from ``random``'s shared generator (reseeded in a forked child, so forked processes do
        not draw alike).
        """
        uniform = rng.uniform if rng is not None else random.uniform
        return max(0.0, uniform(0.0, self.ceiling(attempt)))

    def next_delay(self, attempt: int, elapsed_s: float, rng: random.Random | None = None) -> float | None:
        """The wait after failed attempt ``attempt``, ``elapsed_s`` after the first attempt began; None: give up.

        The wait is ``delay(attempt)`` cut to what is left before the deadline; None once ``attempts`` calls
        were made or the deadline has passed.
        """
        if self.attempts is not None and attempt >= self.attempts:
            return None
        wait = self.delay(attempt, rng)
        if self.deadline_s is not None:
            left = self.deadline_s - elapsed_s
            if left < 0:
                return None
            wait = min(wait, left)
        return wait

    def gave_up(self, attempts: int, elapsed_s: float) -> str:
        """The note a loop adds to the error it raises when this budget is spent."""
        budget = [f"at most {self.attempts} attempts"] if self.attempts is not None else []
        if self.deadline_s is not None:
            budget.append(f"deadline {self.deadline_s:g} s")
        return f"weightbus gave up after {attempts} attempts over {elapsed_s:.2f} s ({', '.join(budget)})"


def _after_failure(
    exc: Exception,
    attempt: int,
    elapsed_s: float,
    backoff: Backoff,
    retry_on: Callable[[Exception], bool],
    on_retry: _OnRetry | None,
    rng: random.Random | None,
) -> float | None:
    """The wait before the next attempt, or None when ``exc`` is to be raised (noted if the budget is spent)."""
    if not retry_on(exc):
        return None
    wait = backoff.next_delay(attempt, elapsed_s, rng)
    if wait is None:
        exc.add_note(backoff.gave_up(attempt, elapsed_s))
        return None
    if on_retry is not None:
        on_retry(exc, attempt, wait)
    return wait


async def retry_async(
    call: Callable[[], Awaitable[_T]],
    backoff: Backoff,
    *,
    retry_on: Callable[[Exception], bool] = is_retryable,
    on_retry: _OnRetry | None = None,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> _T:
    """``await call()`` until it returns, retrying what ``retry_on`` accepts on ``backoff``'s schedule.

    Args:
        call: one attempt.
        backoff: the schedule and its budget.
        retry_on: whether an error may be retried (default: its class says ``retryable``). Only ``Exception``
            is ever caught: a cancel, ``KeyboardInterrupt`` or ``SystemExit`` propagates at once.
        on_retry: called before each wait (the loop's own log line, its metric).
        rng: the jitter's generator (tests pass a seeded one).
        clock: monotonic seconds, for the deadline.
        sleep: how to wait (tests pass a fake one).

    Raises:
        Exception: the last error, at once if ``retry_on`` refuses it, else with a note once the budget is spent.
    """
    started = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except Exception as exc:
            wait = _after_failure(exc, attempt, clock() - started, backoff, retry_on, on_retry, rng)
            if wait is None:
                raise
        await sleep(wait)  # outside the except block: a cancel here is not chained to the retried error


def retry_sync(
    call: Callable[[], _T],
    backoff: Backoff,
    *,
    retry_on: Callable[[Exception], bool] = is_retryable,
    on_retry: _OnRetry | None = None,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> _T:
    """``call()`` until it returns, retrying what ``retry_on`` accepts: ``retry_async`` for blocking code.

    Raises:
        Exception: the last error, at once if ``retry_on`` refuses it, else with a note once the budget is spent.
    """
    started = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except Exception as exc:
            wait = _after_failure(exc, attempt, clock() - started, backoff, retry_on, on_retry, rng)
            if wait is None:
                raise
        sleep(wait)
