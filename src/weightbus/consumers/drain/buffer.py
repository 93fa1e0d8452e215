"""The fully-async buffer: a bounded FIFO of generated groups, judged for staleness when drained.

``put`` filters aborted groups and blocks when full; ``drain(n)`` returns exactly ``n`` kept groups, waiting at most
``ready_timeout`` for a tracker that is not ready; a cancelled or failed drain puts its kept groups back at the head,
in order; after ``fail(exc)`` every call raises it. The judging, counts and reports are ``DrainWindow``'s.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightbus.consumers.drain.stage import Action, DrainStats, StalenessStage
from weightbus.errors import TrackerNotReadyError
from weightbus.rules.source import CurrentSource, read_version
from weightbus.schemas.rollouts import Group

if TYPE_CHECKING:
    from weightbus.consumers.drain.reports import DrainReporter
    from weightbus.consumers.drain.window import HeldSlots

__all__ = ["CurrentSource", "Drain", "FullyAsyncBuffer", "buffer_capacity", "read_current", "resolve_current"]


#: Kept under its old name: ``rules.source.read_version`` reads a ``CurrentSource`` once.
resolve_current = read_version


async def read_current(source: CurrentSource, ready_timeout: float) -> tuple[int | None, str]:
    """Read a version once, waiting (bounded) for a tracker to be ready.

    Returns:
        ``(current, version_state)``: ``current`` or ``never_published`` for a tracker, ``given``
        for a plain value or callable.

    Raises:
        TrackerNotReadyError: the tracker was not ready within ``ready_timeout`` seconds.
        TypeError, ValueError: as ``rules.source.read_version``.
    """
    wait_ready = getattr(source, "wait_ready", None)
    if wait_ready is None or isinstance(source, int):
        return read_version(source), "given"
    if not getattr(source, "ready", False):
        try:
            await wait_ready(ready_timeout)
        except TimeoutError:
            status = getattr(getattr(source, "status", None), "value", "not ready")
            policy = getattr(source, "policy", "?")
            raise TrackerNotReadyError(policy, status, f"a drain waited {ready_timeout:g}s for it") from None
    value = read_version(source)
    return value, "never_published" if value is None else "current"


def buffer_capacity(rollout_batch_size: int, factor: float = 2.0) -> int:
    """miles' capacity: ``floor(factor * rollout_batch_size)``, at least 1."""
    return max(1, int(factor * rollout_batch_size))


@dataclass(frozen=True, slots=True)
class Drain:
    """One drain: ``groups`` (exactly ``n``, sorted by first sample index) and the window's ``stats``."""

    groups: list[Group]
    stats: DrainStats

    @property
    def metrics(self) -> dict[str, float]:
        """``stats.metrics`` (miles' ``rollout/fully_async/*`` names plus ``weightbus/*``)."""
        return self.stats.metrics


class FullyAsyncBuffer:
    """A bounded asyncio FIFO of groups with put-time abort filtering and take-time staleness judging.

    Args:
        capacity: the most groups held; ``put`` blocks beyond it (see ``buffer_capacity``).
        stage: the staleness stage (bound, ``on_stale``, unknown-label policy, metrics); the default
            measures without filtering and drops what it does not keep.
        reporter: publishes a ``DrainReport`` after each drain; its failures never fail a drain.
        on_recycle: called with each recycled (already reset) prompt group instead of queueing it for
            ``take_recycled()``; must not block.
        dynamic_filter: called on each put; a returned ``str`` rejects the group (always dropped,
            counted as ``rollout/dynamic_filter/drop_<reason>`` when the reason is non-empty).
        samples_per_group: when set, a drain raises ``ValueError`` on a kept group of another size.
        ready_timeout: seconds a drain waits for a tracker that is not ready before raising.
        slots: the admission slots of the groups put (``consumers.admission.AcceptedGroups``), settled by
            the drain engine as it routes or keeps each group.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(
        self,
        capacity: int,
        *,
        stage: StalenessStage | None = None,
        reporter: DrainReporter | None = None,
        on_recycle: Callable[[Group], None] | None = None,
        dynamic_filter: Callable[[Group], str | None] | None = None,
        samples_per_group: int | None = None,
        ready_timeout: float = 10.0,
        slots: HeldSlots | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.stage = stage if stage is not None else StalenessStage()
        self._on_recycle = on_recycle
        self._dynamic_filter = dynamic_filter
        self._samples_per_group = samples_per_group
        self.ready_timeout = ready_timeout
        self.window = self.stage.window(on_unused=self._unused, reporter=reporter, slots=slots)
        """The drain engine: evidence, the window since the last drain, metrics and reports."""
        self._items: deque[Group] = deque()
        self._changed = asyncio.Condition()
        # Unbounded on purpose: recycling must never block a drain, whose caller may be the one
        # that feeds the producer this queue would wait on.
        self._recycled: asyncio.Queue[Group] = asyncio.Queue()
        self._error: BaseException | None = None
        self._wakers: set[asyncio.Task[None]] = set()
        if self.stage.metrics is not None:
            items = weakref.ref(self._items)  # the registry outlives buffers; it must not keep one alive
            self.stage.metrics.track_buffer(lambda: len(q) if (q := items()) is not None else 0)

    @property
    def reporter(self) -> DrainReporter | None:
        """Publishes a ``DrainReport`` after each drain (the engine's reporter)."""
        return self.window.reporter

    @reporter.setter
    def reporter(self, reporter: DrainReporter | None) -> None:
        self.window.reporter = reporter

    def __len__(self) -> int:
        return len(self._items)

    @property
    def qsize(self) -> int:
        """Groups waiting in the buffer."""
        return len(self._items)

    def fail(self, error: BaseException) -> None:
        """Make every pending and later ``drain``/``put`` raise ``error`` (a dead producer)."""
        self._error = error
        self._notify()

    async def put(self, group: Group) -> bool:
        """Add a generated group, waiting while the buffer is full.

        Aborted groups and dynamic-filter rejects never enter; they go to ``on_stale`` (aborted) or
        are dropped (rejects), and count in the next drain's window.

        Returns:
            True if the group was buffered.

        Raises:
            BaseException: the error given to ``fail``.
        """
        self._raise_if_failed()
        if not self.window.admit(group):
            return False
        if self._dynamic_filter is not None:
            reject = self._dynamic_filter(group)
            if reject is not None:
                self.window.filtered(reject, group)
                return False
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._items) < self.capacity or self._error is not None)
            self._raise_if_failed()
            self._items.append(group)
            self._changed.notify_all()
        return True

    async def drain(self, n: int, current: CurrentSource) -> Drain:
        """Take exactly ``n`` kept groups, judging each against one snapshot of ``current``.

        Args:
            n: how many kept groups to return (blocks until there are that many).
            current: the version source, read once: ``int | None``, a tracker, or a callable. None
                (never published) keeps every group, unmeasured.

        Raises:
            ValueError: ``n`` < 1, or a kept group has not ``samples_per_group`` samples (every
                kept group is put back first).
            TrackerNotReadyError: ``current`` is a tracker that was not ready in time.
            BaseException: the error given to ``fail``.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._raise_if_failed()
        value, version_state = await read_current(current, self.ready_timeout)
        w = self.window
        t = w.begin(value, version_state)
        take = w.take
        items = self._items
        popped = False
        try:
            while len(t.kept) < n:
                if items and self._error is None:
                    # No await between pops: blocked producers are woken once, below or before waiting.
                    group = items.popleft()
                    popped = True
                else:
                    if popped:
                        self._notify()
                        popped = False
                    group = await self._take()
                take(t, group)
        except BaseException:
            self._put_back(w.abandon(t))
            raise
        if popped:
            self._notify()
        if self._samples_per_group is not None:
            for group in t.kept:
                size = sum(1 for _ in group.iter_samples()) if group.trajectories else len(group.samples)
                if size != self._samples_per_group:
                    self._put_back(w.abandon(t))
                    raise ValueError(
                        f"group {group.prompt_index} has {size} samples, expected {self._samples_per_group}; "
                        "every kept group was put back"
                    )
        kept = sorted(w.close(t), key=_sort_key)
        return Drain(groups=kept, stats=w.finish(items))

    def take_recycled(self) -> list[Group]:
        """Every recycled prompt group queued so far, without waiting."""
        out: list[Group] = []
        while not self._recycled.empty():
            out.append(self._recycled.get_nowait())
        return out

    async def _take(self) -> Group:
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._items) or self._error is not None)
            self._raise_if_failed()
            group = self._items.popleft()
            self._changed.notify_all()
            return group

    def _unused(self, group: Group) -> None:
        """The engine's route for a group not kept: recycle it (reset) or let it go."""
        if self.stage.unused_action is Action.RECYCLED:
            group.reset_for_retry()
            if self._on_recycle is not None:
                self._on_recycle(group)
            else:
                self._recycled.put_nowait(group)

    def _put_back(self, groups: list[Group]) -> None:
        """An interrupted drain's kept groups go back to the head, in order."""
        self._items.extendleft(reversed(groups))
        self._notify()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: nobody can be waiting
        # Kept referenced until done: a bare create_task can be garbage-collected mid-flight.
        task = loop.create_task(wake())
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)


def _sort_key(group: Group) -> int:
    return group.sort_key
