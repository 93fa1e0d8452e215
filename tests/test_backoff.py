"""``weightbus.backoff``: the schedule's bounds, cap, deadline and jitter, and the loops that run a call under it.

The schedule is pure: tests draw from a seeded ``random.Random``. The loops take a fake clock and sleep where the
time is the point, and asyncio's own sleep where a cancel must land in it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest

from tests._builders import wait_until
from weightbus.backoff import Backoff, retry_async, retry_sync
from weightbus.errors import FencedError, PublishError, TrackerNotReadyError


class _Clock:
    """A monotonic clock moved only by the fake sleep and by each attempt's own ``step_s``."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


def _down() -> PublishError:
    return PublishError("weightbus.p.weights", "no acknowledgement")


# -- the schedule ----------------------------------------------------------------------------------


def test_ceilings_double_from_the_first_and_stop_at_the_cap() -> None:
    b = Backoff(first_s=0.1, cap_s=2.0)
    assert [b.ceiling(n) for n in range(1, 8)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])


def test_the_cap_is_monotone_and_never_overflows() -> None:
    b = Backoff(first_s=0.001, cap_s=30.0, factor=10.0)
    ceilings = [b.ceiling(n) for n in (*range(1, 50), 10**4, 10**9)]
    assert ceilings == sorted(ceilings)
    assert max(ceilings) == 30.0 and ceilings[-1] == 30.0


@pytest.mark.parametrize(
    "backoff",
    [Backoff(), Backoff(first_s=0.5, cap_s=0.5), Backoff(first_s=3.0, cap_s=1.0), Backoff(first_s=0.0)],
    ids=["default", "fixed", "first above cap", "zero"],
)
def test_every_wait_lies_between_zero_and_its_ceiling(backoff: Backoff) -> None:
    rng = random.Random(7)
    for attempt in range(1, 40):
        for _ in range(50):
            wait = backoff.delay(attempt, rng)
            assert 0.0 <= wait <= backoff.ceiling(attempt) <= backoff.cap_s


def test_jitter_spreads_the_waits_over_the_whole_ceiling() -> None:
    """Full jitter: uniform below the ceiling, so two clients that failed together rarely wait alike."""
    rng = random.Random(2024)
    b = Backoff(first_s=0.1, cap_s=2.0)
    waits = [b.delay(4, rng) for _ in range(2000)]  # ceiling 0.8
    assert min(waits) < 0.05 and max(waits) > 0.75
    assert statistics.mean(waits) == pytest.approx(0.4, abs=0.03)
    assert statistics.pstdev(waits) == pytest.approx(0.8 / 12**0.5, abs=0.03)
    assert len({round(w, 3) for w in waits}) > 700  # not a handful of values


def test_the_same_seed_draws_the_same_schedule_and_another_does_not() -> None:
    b = Backoff()
    first = [b.delay(n, random.Random(1)) for n in range(1, 6)]
    assert first == [b.delay(n, random.Random(1)) for n in range(1, 6)]
    assert first != [b.delay(n, random.Random(2)) for n in range(1, 6)]


def test_the_attempt_budget_counts_the_first_call() -> None:
    b = Backoff(attempts=3)
    rng = random.Random(0)
    assert b.next_delay(1, 0.0, rng) is not None
    assert b.next_delay(2, 0.0, rng) is not None
    assert b.next_delay(3, 0.0, rng) is None


def test_no_wait_ends_after_the_deadline_and_a_failure_past_it_is_final() -> None:
    b = Backoff(first_s=10.0, cap_s=10.0, deadline_s=5.0)
    rng = random.Random(3)
    for elapsed in (0.0, 1.0, 4.9, 5.0):
        wait = b.next_delay(1, elapsed, rng)
        assert wait is not None and 0.0 <= wait <= 5.0 - elapsed
    assert b.next_delay(1, 5.01, rng) is None


def test_jitter_never_waits_longer_in_total_than_the_unjittered_schedule() -> None:
    b = Backoff(first_s=0.1, cap_s=2.0, attempts=5)
    rng = random.Random(11)
    for _ in range(200):
        total = sum(w for n in range(1, 5) if (w := b.next_delay(n, 0.0, rng)) is not None)
        assert total <= 0.1 + 0.2 + 0.4 + 0.8


@pytest.mark.parametrize(
    "kwargs",
    [{"first_s": -1.0}, {"cap_s": -0.1}, {"factor": 0.5}, {"deadline_s": -1.0}, {"attempts": 0}],
)
def test_a_schedule_that_cannot_work_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Backoff().ceiling(0)


# -- the loops -------------------------------------------------------------------------------------


async def test_a_retryable_error_is_retried_until_the_call_returns() -> None:
    clock = _Clock()
    failures: list[BaseException] = [_down(), TrackerNotReadyError("p", "deaf", "lost"), _down()]
    seen: list[tuple[str, int, float]] = []

    async def call() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    result = await retry_async(
        call,
        Backoff(first_s=0.1, cap_s=2.0),
        on_retry=lambda exc, n, wait: seen.append((type(exc).__name__, n, wait)),
        rng=random.Random(5),
        clock=clock,
        sleep=clock.asleep,
    )
    assert result == "done"
    assert [(name, n) for name, n, _ in seen] == [("PublishError", 1), ("TrackerNotReadyError", 2), ("PublishError", 3)]
    assert clock.slept == [wait for _, _, wait in seen]
    assert all(0 <= w <= Backoff(first_s=0.1, cap_s=2.0).ceiling(n) for _, n, w in seen)


@pytest.mark.parametrize(
    "error",
    [FencedError("p", "another", 2, 7), OSError("disk full"), ValueError("bad")],
    ids=lambda e: type(e).__name__,
)
async def test_a_final_error_or_one_of_no_weightbus_kind_is_raised_at_once_without_a_note(error: Exception) -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise error

    clock = _Clock()
    with pytest.raises(type(error)) as raised:
        await retry_async(call, Backoff(), clock=clock, sleep=clock.asleep)
    assert calls == 1 and clock.slept == []
    assert not getattr(raised.value, "__notes__", [])


async def test_a_predicate_chooses_what_is_retried() -> None:
    failures = [KeyError("k"), KeyError("k")]

    async def call() -> int:
        if failures:
            raise failures.pop(0)
        return 3

    clock = _Clock()
    got = await retry_async(
        call, Backoff(), retry_on=lambda exc: isinstance(exc, KeyError), clock=clock, sleep=clock.asleep
    )
    assert got == 3 and len(clock.slept) == 2


async def test_the_loop_gives_up_at_the_deadline_with_a_note_of_its_attempts() -> None:
    clock = _Clock()
    attempts = 0

    async def call() -> None:
        nonlocal attempts
        attempts += 1
        clock.now += 4.0  # each attempt takes 4 s
        raise _down()

    with pytest.raises(PublishError) as raised:
        await retry_async(call, Backoff(first_s=1.0, cap_s=1.0, deadline_s=10.0), clock=clock, sleep=clock.asleep)
    elapsed = clock.now - 100.0
    assert sum(clock.slept) <= 10.0  # no wait passes the deadline
    assert attempts >= 3 and elapsed > 10.0  # the failure that gave up came after it
    (note,) = raised.value.__notes__
    assert note == f"weightbus gave up after {attempts} attempts over {elapsed:.2f} s (deadline 10 s)"


def test_the_sync_loop_gives_up_after_its_attempts_with_a_note() -> None:
    clock = _Clock()
    calls = 0

    def call() -> None:
        nonlocal calls
        calls += 1
        raise _down()

    with pytest.raises(PublishError) as raised:
        retry_sync(call, Backoff(attempts=4), rng=random.Random(9), clock=clock, sleep=clock.sleep)
    assert calls == 4 and len(clock.slept) == 3
    assert raised.value.__notes__ == [
        f"weightbus gave up after 4 attempts over {sum(clock.slept):.2f} s (at most 4 attempts)"
    ]


def test_the_sync_loop_retries_only_retryable_errors() -> None:
    failures: list[Exception] = [_down(), FencedError("p", "another", 2, 7)]

    def call() -> None:
        raise failures.pop(0)

    clock = _Clock()
    with pytest.raises(FencedError):
        retry_sync(call, Backoff(), clock=clock, sleep=clock.sleep)
    assert len(clock.slept) == 1 and not failures


async def test_a_cancel_during_a_wait_ends_it_at_once_and_is_not_swallowed() -> None:
    """A 30 s wait, cancelled: the task ends cancelled within a fraction of it, and no retry ran after."""
    calls = 0
    waiting = asyncio.Event()

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise _down()

    def before_wait(exc: Exception, attempt: int, wait: float) -> None:
        waiting.set()

    task = asyncio.create_task(retry_async(call, Backoff(first_s=30.0, cap_s=30.0), on_retry=before_wait))
    await wait_until(waiting.is_set, 5.0, "the loop's first wait")  # set in the step that enters the sleep
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 1.0
    assert task.cancelled() and calls == 1


async def test_a_cancel_of_the_call_itself_is_not_retried() -> None:
    calls = 0
    inside = asyncio.Event()

    async def call() -> None:
        nonlocal calls
        calls += 1
        inside.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(retry_async(call, Backoff(), retry_on=lambda exc: True))
    await wait_until(inside.is_set, 5.0, "the first call")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 1
