"""``Admission``: the gate a rollout passes before it starts generating a group.

The capacity is ``rules.admission.mode_capacity`` over the counts held here and the version read at each check (a
tracker not ready admits nothing in ``bounded``); a slot is granted only while it is positive, counted at once, and
released exactly once. See docs/rollout.md#admission-generate-only-what-can-still-be-trained.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Final, Literal

from weightbus.errors import AdmissionError, TrackerNotReadyError
from weightbus.rules.admission import (
    ADMISSION_MODES,
    UNLIMITED,
    AdmissionMode,
    accepted_in_horizon,
    allowance,
    mode_capacity,
)
from weightbus.rules.source import CurrentSource, version_reader

if TYPE_CHECKING:
    from weightbus.consumers.admission.shared import SharedBudget

__all__ = ["Admission", "Outcome", "Slot"]

Outcome = Literal["finished", "aborted", "recycled"]
_OUTCOMES: Final = ("accepted", "finished", "aborted", "recycled")
_RUNNING: Final = 0
_READY: Final = 1
_DONE: Final = 2
#: Drained batches kept below the horizon (for a tracker that goes back); older ones are forgotten.
_KEPT_BELOW: Final = 64


class Slot:
    """One admitted group's place in the budget; see the module docstring.

    Attributes:
        version: the version the tracker held when the slot was granted (None: never published).
    """

    __slots__ = ("_gate", "_state", "version")

    def __init__(self, gate: Admission, version: int | None) -> None:
        self._gate = gate
        self._state = _RUNNING
        self.version = version

    @property
    def open(self) -> bool:
        """Whether the group is still running (neither accepted nor released)."""
        return self._state == _RUNNING

    def accept(self) -> None:
        """The group finished and enters the buffer: it counts as accepted until a drain takes it.

        Raises:
            AdmissionError: the slot was already accepted or released.
        """
        if self._state != _RUNNING:
            raise AdmissionError("this slot was already accepted or released")
        self._state = _READY
        self._gate._accepted()

    def release(self, outcome: Outcome = "finished") -> None:
        """The group will not enter the buffer: ``finished`` (unused), ``aborted`` or ``recycled`` (regenerated).

        Raises:
            AdmissionError: the slot was already accepted or released, or ``outcome`` is unknown.
        """
        if self._state != _RUNNING:
            raise AdmissionError("this slot was already accepted or released")
        if outcome not in _OUTCOMES[1:]:
            raise AdmissionError(f"outcome must be finished, aborted or recycled, got {outcome!r}")
        self._state = _DONE
        self._gate._released(outcome)

    def drained(self, *, kept: bool, at: int | None = None) -> None:
        """A drain took this accepted group into a batch judged at ``at`` (``kept``), or filtered it (its place
        is free): ``Admission.drained`` for this one group, at most once (``AcceptedGroups`` calls it).

        Raises:
            AdmissionError: the slot was not accepted, or was drained already.
        """
        if self._state != _READY:
            raise AdmissionError("only an accepted slot is drained, and only once")
        self._state = _DONE
        self._gate.drained(int(kept), int(not kept), at=at)


class _SlotContext:
    __slots__ = ("_gate", "_slot")

    def __init__(self, gate: Admission) -> None:
        self._gate = gate
        self._slot: Slot | None = None

    async def __aenter__(self) -> Slot:
        self._slot = await self._gate.acquire()
        return self._slot

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        slot = self._slot
        if slot is not None and slot._state == _RUNNING:
            slot.release("finished" if kind is None else "aborted")


class Admission:
    """Paces generation by the staleness budget (``bounded``), a fixed cap (``cap``), or not at all (``off``).

    Args:
        mode: ``bounded`` (the default: ``rules.admission.capacity``), ``cap`` (at most ``cap`` groups
            running) or ``off``.
        current: the version source, read at each check: a tracker (its ``.current``), an int or None,
            or a zero-argument callable.
        max_staleness: the drain's bound (None: unlimited).
        batch: groups per training step.
        cap: the ``cap`` mode's limit on running groups.
        budget: a ``SharedBudget`` that several processes of the policy share (None: this process alone).
        poll_s: how often a waiting ``acquire`` re-reads the version when nothing else woke it.

    Raises:
        ValueError: an unknown mode, ``cap`` mode without a cap >= 1, ``batch`` < 1, a negative bound.
    """

    __slots__ = (
        "_batch",
        "_budget",
        "_cap",
        "_changed",
        "_counts",
        "_limit",
        "_max_staleness",
        "_mode",
        "_poll_s",
        "_read",
        "_ready",
        "_running",
        "_taken",
        "_taken_in_horizon",
        "_horizon_at",
    )

    def __init__(
        self,
        mode: AdmissionMode = "bounded",
        *,
        current: CurrentSource = None,
        max_staleness: int | None = 1,
        batch: int,
        cap: int | None = None,
        budget: SharedBudget | None = None,
        poll_s: float = 0.05,
    ) -> None:
        if mode not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {mode!r}")
        mode_capacity(mode, current=None, max_staleness=max_staleness, batch=batch, accepted=0, running=0, cap=cap)
        self._mode = mode
        self._max_staleness = max_staleness
        self._batch = batch
        self._cap = cap
        self._read = version_reader(current)
        self._running = 0
        self._ready = 0
        self._taken: dict[int | None, int] = {}
        self._taken_in_horizon = 0
        self._horizon_at: int | None | object = _UNSET
        self._limit = 0
        self._changed = asyncio.Event()
        self._poll_s = poll_s
        self._counts = dict.fromkeys(_OUTCOMES, 0)
        self._budget = budget
        if budget is not None:
            budget.bind(self)
            if mode == "cap":
                budget.set_total(cap)  # type: ignore[arg-type]

    # -- read-only state ---------------------------------------------------------------------------

    @property
    def mode(self) -> AdmissionMode:
        """``off``, ``cap`` or ``bounded``."""
        return self._mode

    @property
    def batch(self) -> int:
        """Groups per training step."""
        return self._batch

    @property
    def version(self) -> int | None:
        """The version read at the last check (None: never published, or not read yet)."""
        at = self._horizon_at
        return at if type(at) is int else None

    @property
    def running(self) -> int:
        """Groups admitted and not finished."""
        return self._running

    @property
    def ready(self) -> int:
        """Groups accepted into the buffer and not drained yet."""
        return self._ready

    @property
    def accepted(self) -> int:
        """Accepted groups in the horizon of the current version (ready, or drained at it or later)."""
        self._horizon()
        return self._ready + self._taken_in_horizon

    @property
    def used(self) -> int:
        """What this process fills of the budget: ``running + accepted`` (``running`` in the ``cap`` mode)."""
        if self._mode != "bounded":
            return self._running
        self._horizon()
        return self._running + self._ready + self._taken_in_horizon

    @property
    def allowance(self) -> int:
        """What the whole policy may fill: ``rules.admission.allowance`` at the current version (the cap in the
        ``cap`` mode, ``UNLIMITED`` when ``off``)."""
        if self._mode == "cap":
            return self._cap  # type: ignore[return-value]
        if self._mode == "off":
            return UNLIMITED
        self._horizon()
        return self._limit

    @property
    def ceiling(self) -> int:
        """The most the allowance can ever be in this mode (the cap, ``(max_staleness + 1) * batch`` when
        ``bounded``, ``UNLIMITED`` when ``off`` or unbounded): a shared ledger granting more is refused."""
        if self._mode == "cap":
            return self._cap  # type: ignore[return-value]
        if self._mode == "off":
            return UNLIMITED
        return allowance(0, self._max_staleness, self._batch)

    @property
    def counts(self) -> dict[str, int]:
        """Slots closed since the start, by outcome (``accepted``, ``finished``, ``aborted``, ``recycled``)."""
        return dict(self._counts)

    def capacity(self) -> int:
        """How many more groups may start now (``UNLIMITED`` when nothing limits it; may be negative)."""
        mode = self._mode
        if mode == "off":
            return UNLIMITED
        if mode == "cap":
            free = self._cap - self._running  # type: ignore[operator]
            if self._budget is not None:
                free = min(free, self._budget.held - self._running)
            return free
        if not self._horizon():
            return 0  # a tracker that cannot say what is current admits nothing (err toward stale)
        used = self._running + self._ready + self._taken_in_horizon
        free = self._limit - used
        budget = self._budget
        if budget is not None:
            local = budget.held - used
            if local < free:
                free = local
        return free

    # -- admitting ---------------------------------------------------------------------------------

    def try_acquire(self) -> Slot | None:
        """A slot if one is free now, else None (never waits)."""
        if self.capacity() > 0:
            self._running += 1
            return Slot(self, self.version if self._mode == "bounded" else self._read_quietly())
        return None

    async def acquire(self) -> Slot:
        """Wait until a slot is free and take it (cancellable: a cancelled wait takes nothing)."""
        while True:
            slot = self.try_acquire()
            if slot is not None:
                return slot
            if self._budget is not None:
                self._budget.wanted()
            self._changed.clear()
            try:
                async with asyncio.timeout(self._poll_s):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._changed.wait()
            except TimeoutError:
                pass  # re-read the version: a tracker moving on frees the horizon without telling us

    def slot(self) -> _SlotContext:
        """``async with admission.slot() as slot:``: wait for a slot; leaving releases it unless accepted."""
        return _SlotContext(self)

    async def slots(self) -> AsyncIterator[Slot]:
        """Slots, one per group, for ever: each must be accepted or released by the host."""
        while True:
            yield await self.acquire()

    def drained(self, kept: int, not_kept: int = 0, *, at: int | None) -> None:
        """A drain judged at ``at`` took ``kept`` accepted groups into a batch and did not keep ``not_kept``.

        Kept groups stay in the horizon of ``at`` (they train there); the others (stale, unknown,
        aborted, filtered, dropped or recycled) free their slots.

        Raises:
            AdmissionError: more groups than were accepted (a group entered the buffer without a slot).
        """
        if kept < 0 or not_kept < 0:
            raise AdmissionError(f"counts must be >= 0, got kept={kept} not_kept={not_kept}")
        if kept + not_kept > self._ready:
            raise AdmissionError(
                f"a drain took {kept + not_kept} groups but only {self._ready} were accepted: "
                "every group put in the buffer must hold an accepted slot"
            )
        self._ready -= kept + not_kept
        if kept:
            self._taken[at] = self._taken.get(at, 0) + kept
            self._horizon_at = _UNSET  # recount the horizon
        self._notify()

    def notify(self) -> None:
        """Wake waiting ``acquire`` calls now (e.g. on a version change) instead of at the next poll."""
        self._notify()

    async def follow(self, changes: Callable[[], AsyncIterator[object]]) -> None:
        """Wake waiting ``acquire`` calls at every item of ``changes()``: a new version moves the horizon, and the
        engines should not idle until the next poll. Returns when the iterator ends.

        Args:
            changes: a tracker's ``latest_changes``, the iterator that never falls behind (a skipped change
                moves the horizon no less: the gate reads the version itself at each check).
        """
        async for _ in changes():
            self._notify()

    # -- internals ---------------------------------------------------------------------------------

    def _read_quietly(self) -> int | None:
        try:
            return self._read()
        except TrackerNotReadyError:
            return None

    def _horizon(self) -> bool:
        """Slide the horizon to the source's version; False when the source cannot say (the counts stay)."""
        try:
            current = self._read()
        except TrackerNotReadyError:
            return False
        if current != self._horizon_at:
            self._slide(current)
        return True

    def _slide(self, current: int | None) -> None:
        taken = self._taken
        if current is not None:
            for v in [v for v in taken if v is None or v < current - _KEPT_BELOW]:
                del taken[v]
        self._taken_in_horizon = accepted_in_horizon(current, 0, taken)
        self._limit = allowance(current, self._max_staleness, self._batch) if self._mode == "bounded" else UNLIMITED
        self._horizon_at = current
        if self._budget is not None:
            self._budget.set_total(self._limit)

    def _accepted(self) -> None:
        self._running -= 1
        self._ready += 1
        self._counts["accepted"] += 1

    def _released(self, outcome: str) -> None:
        self._running -= 1
        self._counts[outcome] += 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()


_UNSET: Final = object()
