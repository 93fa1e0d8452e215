"""Where a training step's time goes: weightbus's own work, the engines' HTTP time, and everything else.

Own + engine HTTP == weightbus spans − excluded spans, each instant counted once; it only observes.
See docs/benchmarks.md#measuring-your-own-trainer.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["BusyTimer", "HttpCall", "OverheadMeter", "OverheadReport", "covered"]

Interval = tuple[float, float]


@dataclass(frozen=True, slots=True)
class HttpCall:
    """One engine HTTP request: method, URL path, status, and its interval on ``time.perf_counter``."""

    method: str
    path: str
    status: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class OverheadReport:
    """Totals in seconds over the recorded steps.

    Attributes:
        steps: how many steps were recorded.
        step_s: their total wall time.
        weightbus_s: time inside weightbus spans, excluded spans taken out.
        engine_http_s: the part of ``weightbus_s`` covered by engine HTTP calls.
        own_s: ``weightbus_s - engine_http_s``: weightbus's own work (bus round trips included).
        share: ``own_s / step_s`` (0.0 before any step).
    """

    steps: int
    step_s: float
    weightbus_s: float
    engine_http_s: float
    own_s: float
    share: float

    def as_dict(self) -> dict[str, float | int]:
        """The fields as a JSON-ready dict."""
        return {f: getattr(self, f) for f in self.__slots__}


def _union(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two sorted, disjoint interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a`` minus ``b``, both sorted and disjoint."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def covered(intervals: list[Interval], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` covered by at least one of ``intervals`` (overlaps counted once)."""
    return _length(_intersect(_union(intervals), [(start, end)] if end > start else []))


class OverheadMeter:
    """Records steps, weightbus spans, excluded spans and engine HTTP calls; see the module docstring.

    Spans are plain (sync) context managers, usable around ``await`` in async code. Steps and spans of one
    meter must not overlap each other (one training loop); HTTP calls may overlap anything.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.steps: list[Interval] = []
        self.spans: list[Interval] = []
        self.excluded_spans: list[Interval] = []
        self.http_calls: list[HttpCall] = []
        self._started: weakref.WeakKeyDictionary[httpx.Request, float] = weakref.WeakKeyDictionary()

    def reset(self) -> None:
        """Forget every step, span and finished HTTP call (a long-running host calls it after reading a step)."""
        self.steps.clear()
        self.spans.clear()
        self.excluded_spans.clear()
        self.http_calls.clear()

    def now(self) -> float:
        """The meter's clock."""
        return self._clock()

    @contextmanager
    def _span(self, into: list[Interval]) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            into.append((start, self._clock()))

    def step(self) -> Any:
        """Context manager around one whole training step."""
        return self._span(self.steps)

    def weightbus(self) -> Any:
        """Context manager around a call into weightbus (``pub.update()``, a drain, a tracker wait)."""
        return self._span(self.spans)

    def excluded(self) -> Any:
        """Context manager around the host's own work inside a weightbus span (the trainer's weight push)."""
        return self._span(self.excluded_spans)

    def http_hooks(self) -> dict[str, list[Callable[[Any], Awaitable[None]]]]:
        """``event_hooks`` for an ``httpx.AsyncClient``: each request's interval lands in ``http_calls``."""

        async def on_request(request: httpx.Request) -> None:
            self._started[request] = self._clock()

        async def on_response(response: httpx.Response) -> None:
            await response.aread()  # the engine's time includes sending its body
            request = response.request
            start = self._started.pop(request, None)
            if start is not None:
                self.http_calls.append(
                    HttpCall(request.method, request.url.path, response.status_code, start, self._clock())
                )

        return {"request": [on_request], "response": [on_response]}

    def http_time(self, start: float, end: float, *, paths: set[str] | None = None) -> float:
        """Seconds of ``[start, end]`` during which an engine HTTP call (of ``paths``, or any) was in flight."""
        calls = [(c.start, c.end) for c in self.http_calls if paths is None or c.path in paths]
        return covered(calls, start, end)

    def report(self, window: Interval | None = None) -> OverheadReport:
        """Totals over everything recorded so far, or only over what falls inside ``window`` (``(start, end)``
        on the meter's clock; ``meter.steps[-1]`` is the last step). Steps are counted if they overlap it."""
        charged = _subtract(_union(self.spans), _union(self.excluded_spans))
        steps = self.steps
        if window is not None:
            charged = _intersect(charged, [window] if window[1] > window[0] else [])
            steps = [(max(a, window[0]), min(b, window[1])) for a, b in steps if a < window[1] and b > window[0]]
        http = _intersect(charged, _union([(c.start, c.end) for c in self.http_calls]))
        weightbus_s, engine_s = _length(charged), _length(http)
        step_s = sum(end - start for start, end in steps)
        own = weightbus_s - engine_s
        return OverheadReport(
            steps=len(steps),
            step_s=step_s,
            weightbus_s=weightbus_s,
            engine_http_s=engine_s,
            own_s=own,
            share=own / step_s if step_s > 0 else 0.0,
        )


class BusyTimer:
    """Awaits a coroutine and measures the seconds its own code ran (``seconds``), its suspensions excluded.

    ``timer = BusyTimer(buffer.drain(8, tracker)); drain = await timer; timer.seconds``: the drain's judging
    and bookkeeping, without the time it waited for groups or for the bus. Code the coroutine starts in other
    tasks is not counted. Cancellation and errors pass through unchanged; ``seconds`` holds what ran until then.
    """

    def __init__(self, coro: Coroutine[Any, Any, Any], clock: Callable[[], float] = time.perf_counter) -> None:
        self._coro = coro
        self._clock = clock
        self.seconds = 0.0

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, clock = self._coro, self._clock
        send: Any = None
        thrown: BaseException | None = None
        while True:
            start = clock()
            try:
                yielded = coro.send(send) if thrown is None else coro.throw(thrown)
            except StopIteration as done:
                return done.value
            finally:
                self.seconds += clock() - start
            try:
                send, thrown = (yield yielded), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the coroutine, which decides
                send, thrown = None, exc
