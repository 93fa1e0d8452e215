"""``SharedBudget``: one admission budget for every rollout process of a policy, kept on the bus.

The budget lives on ``weightbus.<policy>.admission`` as ``AdmissionLedger`` records (``schemas.admission``):
each is the whole budget, written as a conditional publish on the subject's last sequence, so the bus's
fence (not a lock server, not a read before the write) orders the writers. Invariants:

* **Never over-granted.** A writer builds its ledger on the newest one it knows and publishes it with
  ``expected_last_seq``; if another write landed first the publish is refused (nothing stored), the
  writer reads the newest ledger and recomputes. Every stored ledger grants at most ``total`` slots in
  all, counting every holding whose lease has not expired.
* **Fair.** Each holding records what its holder asked for (``wants``). A holder keeps at most its max-min
  fair share of the allowance (``rules.admission.fair_shares`` over every live holder's ``wants``): at once
  for its own admissions, and in the ledger as soon as the surplus is unused (checked at each ledger
  change and each time its gate waits). A holder short of its share with nothing free writes its ``wants``
  at once rather than at its renewal. So a process that is always busy, refilling its slots as fast as it
  frees them, cannot starve one that arrived later; with nobody waiting, one process may hold the whole
  allowance.
* **Leases.** A holding expires ``lease_s`` after it was written (``expires_at``, the writer's clock). Its
  holder renews it every ``lease_s / 3``; the holder itself counts on it only until ``lease_s - skew_s``
  after it *sent* the write (its own monotonic clock), and other writers take it back only ``skew_s``
  after ``expires_at``: with host clocks within ``skew_s`` of each other, a holder has stopped using its
  slots before anyone else can be granted them. A process killed with ``kill -9`` gets its slots back to
  the others within ``lease_s + skew_s`` of its last renewal, plus the time until another holder next writes
  (at once when it waits for slots, else its next renewal, ``lease_s / 3``). A
  process that cannot reach the bus holds no slots once its lease lapses and admits nothing.
* **One round trip per write, writes per group below one.** The newest ledger is followed by a
  subscription, so a write is one conditional publish. A process asks for ``grant`` slots at a time and
  keeps them while it uses them, returning the surplus at a renewal: in the steady state a group costs
  at most one bus round trip, and usually ``1 / grant`` (``bench/admission.py``).
* **Nothing to re-base.** The state is the newest ledger; a restart of every process reads it, and the
  holdings of the dead incarnations (each holder id is ``<name>:<random incarnation>``) simply expire.
  A ledger lost with the stream (a purge, a new stream) is rebuilt by the next write from the live
  holders' own counts.
* A stray or malformed payload on the subject is skipped and counted by the bus; the ledger stays the
  newest valid one, and the next write fences on the subject's real last sequence.

All holders of one policy must share one bound and batch (they share one allowance); the ledger records
the writer's ``total``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Final, Protocol

from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.protocol import Bus, Deliver, Envelope, Skipped, Subscription
from weightbus.errors import BusError, InvalidEventError, PermissionDeniedError, SequenceConflictError
from weightbus.rules.admission import UNLIMITED, fair_shares
from weightbus.schemas import AdmissionLedger, Holding

__all__ = ["BudgetUser", "SharedBudget"]

log = logging.getLogger("weightbus.consumers")


class BudgetUser(Protocol):
    """What a budget reads of the gate it holds slots for (``Admission`` is one)."""

    @property
    def used(self) -> int: ...

    @property
    def allowance(self) -> int: ...

    @property
    def batch(self) -> int: ...

    @property
    def version(self) -> int | None: ...

    def notify(self) -> None: ...


#: Seconds ``close`` waits for its tasks to end after cancelling them.
_CLOSE_S: Final = 5.0
_RETRY_S: Final = 0.2


class SharedBudget:
    """This process's share of the policy's admission budget; see the module docstring.

    Use it with an ``Admission`` (``Admission(..., budget=budget)``) inside ``async with budget:``.

    Args:
        bus: the bus (borrowed; not closed here).
        policy: the policy id.
        name: the readable part of the holder id.
        lease_s: how long a holding lasts without renewal (the kill -9 bound, with ``skew_s``).
        skew_s: the clock difference between hosts that the leases tolerate.
        grant: slots asked for per write beyond what is in use (None: the admission's batch).
        clock: wall-clock Unix time (injected for tests).
        on_write: called with each ledger this process stored and its sequence (for the record).

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        ValueError: ``lease_s`` <= 3 * ``skew_s`` or ``grant`` < 1.
    """

    def __init__(
        self,
        bus: Bus,
        policy: str,
        *,
        name: str = "rollout",
        lease_s: float = 10.0,
        skew_s: float = 1.0,
        grant: int | None = None,
        clock: Callable[[], float] = time.time,
        on_write: Callable[[AdmissionLedger, int], None] | None = None,
    ) -> None:
        if lease_s <= 3 * skew_s:
            raise ValueError(f"lease_s must exceed 3 * skew_s, got lease_s={lease_s} skew_s={skew_s}")
        if grant is not None and grant < 1:
            raise ValueError(f"grant must be >= 1, got {grant}")
        self._bus = bus
        self._policy = policy
        self._subject = subjects.admission(policy)
        self.holder = f"{name}:{uuid.uuid4().hex[:12]}"
        self._lease_s = lease_s
        self._skew_s = skew_s
        self._grant = grant
        self._clock = clock
        self._on_write = on_write
        self._gate: BudgetUser | None = None
        self._total = 0
        self._ledger: AdmissionLedger | None = None
        self._seq = 0
        self._slots = 0
        self._share = UNLIMITED  # the most this holder may fill while others wait (fair_shares)
        self._valid_until = 0.0  # monotonic
        self._renew_at = 0.0  # monotonic
        self._wanted = False
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._writes = 0
        self._conflicts = 0

    # -- state -------------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """The slots this process may fill now: its holding, within its fair share, while its lease is valid;
        else 0."""
        if time.monotonic() >= self._valid_until:
            return 0
        return self._slots if self._slots <= self._share else self._share

    @property
    def ledger(self) -> AdmissionLedger | None:
        """The newest ledger known here (None: none stored yet)."""
        return self._ledger

    @property
    def writes(self) -> int:
        """Ledgers this process stored."""
        return self._writes

    @property
    def conflicts(self) -> int:
        """Writes refused because another write landed first (each cost a read and a retry)."""
        return self._conflicts

    # -- the admission's side ----------------------------------------------------------------------

    def bind(self, gate: BudgetUser) -> None:
        """Called by ``Admission``: the gate whose ``used`` this budget holds slots for."""
        self._gate = gate

    def set_total(self, total: int) -> None:
        """The allowance the gate computed at its current version (``rules.admission.allowance``)."""
        self._total = total

    def wanted(self) -> None:
        """The gate is out of slots: ask for more at the next chance."""
        # Also while holding more than the fair share: what is used may have fallen, and the surplus can go back.
        if not self._wanted or self._slots > self._share:
            self._wanted = True
            self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def __aenter__(self) -> SharedBudget:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Follow the ledger and take a first share (``grant`` slots, if free).

        Raises:
            PermissionDeniedError: this user may not publish the admission subject.
            BusError: the bus did not answer the first reads.
        """
        sub = self._bus.subscribe(self._subject, deliver=Deliver.NEW, include_invalid=True)
        await sub.__aenter__()
        self._tasks.append(asyncio.create_task(self._follow(sub)))
        await self._refresh()
        if self._gate is not None:
            _ = self._gate.allowance  # the gate reads its version and sets the total
        self._wanted = True
        try:
            # Here, not in the task: a refusal (permissions) ends the caller's start.
            demand = self._demand()
            await self._write(self._target(demand), demand)
        except PermissionDeniedError:
            await self.close()
            raise
        except BusError as exc:
            log.warning("admission ledger write failed; retrying", extra={"error": repr(exc)})
        self._wanted = False
        self._tasks.append(asyncio.create_task(self._run()))

    async def close(self) -> None:
        """Return every slot (one last write, best effort) and stop."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: a cancel that a transport swallows (CPython 3.11) must not hold the caller's shutdown.
            done, pending = await asyncio.wait(self._tasks, timeout=_CLOSE_S)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.debug("admission task ended with an error", extra={"error": repr(task.exception())})
            if pending:
                log.error(
                    "admission tasks did not stop within the close bound; left to the loop",
                    extra={"tasks": len(pending), "bound_s": _CLOSE_S},
                )
        self._tasks.clear()
        if self._slots:
            try:
                async with asyncio.timeout(2.0):
                    await self._write(0, 0, leaving=True)
            except (BusError, TimeoutError) as exc:
                log.warning(
                    "could not return the admission slots; they expire with the lease", extra={"error": repr(exc)}
                )
        self._slots = 0

    # -- internals ---------------------------------------------------------------------------------

    async def _follow(self, sub: Subscription) -> None:
        # The ledger's changes wake a waiting writer; a lost subscription is made again (the writes stay
        # safe without it: a stale view only costs a refused publish and a read).
        while True:
            try:
                async with sub:
                    async for item in sub:
                        self._seen(item)
                return
            except BusError as exc:
                log.warning("admission ledger subscription lost; resubscribing", extra={"error": repr(exc)})
            await asyncio.sleep(_RETRY_S)
            sub = self._bus.subscribe(self._subject, deliver=Deliver.LAST_PER_SUBJECT, include_invalid=True)

    def _seen(self, item: Envelope | Skipped) -> None:
        seq = item.seq or 0
        if seq <= self._seq or not isinstance(item, Envelope) or not isinstance(item.event, AdmissionLedger):
            # A stray payload does not move the fence: the ledger below it may not be the one we hold, so the
            # next write is refused and ``_refresh`` reads the newest valid one from the history.
            return
        self._seq = seq
        self._ledger = item.event
        self._reshare()
        self._wake.set()

    async def _refresh(self) -> None:
        # The sequence first, then the ledger: a write landing in between makes the ledger newer than the
        # fence, and the next publish is refused (safe); the other order could build on a stale ledger.
        seq = await self._bus.last_seq(self._subject)
        try:
            env = await self._bus.last(self._subject)
        except InvalidEventError:
            env = None
        if env is None or not isinstance(env.event, AdmissionLedger):
            if seq:  # garbage on top: the newest valid ledger is in the history
                env = (await read_subject_history(self._bus, self._subject)).last_valid
        if env is not None and isinstance(env.event, AdmissionLedger):
            self._ledger = env.event
        if seq == 0:
            self._ledger = None  # the history is gone: the next write rebuilds it from the live holders
        self._seq = seq
        self._reshare()

    def _used(self) -> int:
        return self._gate.used if self._gate is not None else 0

    def _demand(self) -> int:
        used = self._used()
        grant = self._grant if self._grant is not None else self._gate.batch if self._gate is not None else 1
        if self._wanted:
            return used + grant
        return min(max(self._slots, used), used + grant)

    def _others(self) -> dict[str, Holding]:
        """The other holders whose leases still stand."""
        ledger = self._ledger
        if ledger is None:
            return {}
        now = self._clock()
        return {h: x for h, x in ledger.holders.items() if h != self.holder and x.expires_at + self._skew_s >= now}

    def _reshare(self, demand: int | None = None) -> None:
        others = self._others()
        if not others:
            self._share = UNLIMITED
            return
        # A writer that predates ``wants`` wrote 0 there: it asks for what it holds.
        demands = {h: max(x.wants, x.slots) for h, x in others.items()}
        demands[self.holder] = self._demand() if demand is None else demand
        version = self._gate.version if self._gate is not None else None
        self._share = fair_shares(self._total, demands, version or 0)[self.holder]

    def _asked(self) -> int:
        """The ``wants`` of this holder in the newest ledger known here (0: none there)."""
        mine = self._ledger.holders.get(self.holder) if self._ledger is not None else None
        return mine.wants if mine is not None else 0

    def _others_wait(self) -> bool:
        return any(x.wants > x.slots for x in self._others().values())

    def _target(self, demand: int) -> int:
        """What to hold: the demand, within the fair share, and never below what is in use."""
        self._reshare(demand)
        return min(demand, max(self._share, self._used()))

    def _free_for_us(self) -> int:
        return self._total - sum(x.slots for x in self._others().values())

    def _next_expiry(self) -> float | None:
        now = self._clock()
        later = [x.expires_at + self._skew_s - now for x in self._others().values() if x.slots]
        return min(later) if later else None

    async def _run(self) -> None:
        while True:
            now = time.monotonic()
            due = now >= self._renew_at
            demand = self._demand()
            target = self._target(demand)
            gain = min(target, self._free_for_us()) > self._slots
            # A surplus goes back at a renewal only (returning it at once and asking again would cost writes),
            # unless it is more than the fair share and another holder waits for it.
            unfair = self._slots > target and self._others_wait()
            # Short of its fair share with nothing free: say so, or the others only learn of it at a renewal.
            ask = self._wanted and not gain and demand > self._asked() and self._slots < self._share < UNLIMITED
            if due or (self._wanted and gain) or unfair or ask:
                try:
                    await self._write(target, demand)
                except BusError as exc:
                    log.warning("admission ledger write failed; retrying", extra={"error": repr(exc)})
                    await asyncio.sleep(_RETRY_S)
                    continue
                self._wanted = False
            timeout = max(0.0, self._renew_at - time.monotonic())
            if self._wanted:
                expiry = self._next_expiry()
                if expiry is not None:
                    timeout = min(timeout, expiry + 0.01)
            self._wake.clear()
            try:
                async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _write(self, target: int, demand: int, *, leaving: bool = False) -> None:
        while True:
            ledger = self._ledger
            now = self._clock()
            holders = self._others()
            free = self._total - sum(x.slots for x in holders.values())
            slots = max(0, min(target, free))
            if not leaving:
                holders[self.holder] = Holding(
                    slots=slots, used=self._used(), expires_at=now + self._lease_s, wants=max(demand, slots)
                )
            # A writer whose gate has no version yet (total 0) grants itself nothing and keeps the ledger's total.
            total = self._total or (ledger.total if ledger is not None else 0)
            record = AdmissionLedger(
                policy=self._policy,
                total=total,
                holders=holders,
                writer=self.holder,
                version=self._gate.version if self._gate is not None else None,
                written_at=now,
            )
            if slots < self._slots:
                self._slots = slots  # a shrink counts before the write can land: nobody gets a slot we still use
            sent = time.monotonic()
            try:
                ack = await self._bus.publish(
                    self._subject,
                    record,
                    msg_id=f"{self.holder}:{self._writes}:{self._conflicts}",
                    expected_last_seq=self._seq,
                )
            except SequenceConflictError:
                self._conflicts += 1
                await self._refresh()
                continue
            except BusError:
                await self._refresh_quietly()
                raise
            self._writes += 1
            if ack.seq >= self._seq:  # a newer ledger seen meanwhile was built on this one: keep it
                self._ledger = record
                self._seq = ack.seq
            self._slots = slots
            self._valid_until = sent + self._lease_s - self._skew_s
            self._renew_at = sent + self._lease_s / 3
            if self._on_write is not None:
                self._on_write(record, ack.seq)
            if self._gate is not None:
                self._gate.notify()
            return

    async def _refresh_quietly(self) -> None:
        try:
            await self._refresh()
        except BusError as exc:
            log.debug("could not re-read the admission ledger", extra={"error": repr(exc)})
