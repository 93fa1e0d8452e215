"""``SharedBudget``: one admission budget for every rollout process of a policy, kept on the bus.

The budget is the newest valid ``AdmissionLedger``, each written as a conditional publish (the bus's fence orders
the writers) and validated on read (``check_ledger``); holdings are leases, each at most its max-min fair share.
All holders share one bound, batch, lease and linger. Guarantees and limits: docs/operations.md#admission-guarantees.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Final, Protocol

from weightbus.backoff import Backoff
from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.protocol import Bus, Deliver, Envelope, Skipped, Subscription
from weightbus.consumers.admission.metrics import AdmissionMetrics, PolicyAdmissionMetrics
from weightbus.errors import BusError, PermissionDeniedError, SequenceConflictError
from weightbus.rules.admission import UNLIMITED, check_ledger, counted, fair_shares, lapsed
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
    def ceiling(self) -> int: ...

    @property
    def batch(self) -> int: ...

    @property
    def version(self) -> int | None: ...

    def notify(self) -> None: ...


#: Seconds ``close`` waits for its tasks to end after cancelling them.
_CLOSE_S: Final = 5.0
#: The waits after a failed ledger write or a lost subscription: 0.2 s growing to 1 s, jittered.
_RETRY: Final = Backoff(first_s=0.2, cap_s=1.0)
#: Seconds a writer whose publish was refused waits for its subscription to deliver what landed first.
_CATCH_UP_S: Final = 2.0
#: Own records kept to recognise them on the subscription (a publish that timed out may still have landed).
_OWN_KEPT: Final = 8


class SharedBudget:
    """This process's share of the policy's admission budget; see the module docstring.

    Use it with an ``Admission`` (``Admission(..., budget=budget)``) inside ``async with budget:``.

    Args:
        bus: the bus (borrowed; not closed here).
        policy: the policy id.
        name: the readable part of the holder id.
        lease_s: how long a holding lasts without renewal; no holding read here counts as lasting longer.
        skew_s: the clock difference between hosts that the leases tolerate.
        linger_s: how long after a holding's lease (and ``skew_s``) the others still count it, for the groups its
            holder may still be running (None: ``lease_s``). The kill -9 bound grows by it.
        grant: slots asked for per write beyond what is in use (None: the admission's batch).
        on_write: called with each ledger this process stored and its sequence (for the record).
        metrics: where rejected ledgers, clipped leases, tampering, over-admission and starvation are counted.

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        ValueError: ``lease_s`` <= 3 * ``skew_s``, ``linger_s`` < 0 or ``grant`` < 1.
    """

    def __init__(
        self,
        bus: Bus,
        policy: str,
        *,
        name: str = "rollout",
        lease_s: float = 10.0,
        skew_s: float = 1.0,
        linger_s: float | None = None,
        grant: int | None = None,
        on_write: Callable[[AdmissionLedger, int], None] | None = None,
        metrics: AdmissionMetrics | None = None,
    ) -> None:
        if lease_s <= 3 * skew_s:
            raise ValueError(f"lease_s must exceed 3 * skew_s, got lease_s={lease_s} skew_s={skew_s}")
        if linger_s is not None and linger_s < 0:
            raise ValueError(f"linger_s must be >= 0, got {linger_s}")
        if grant is not None and grant < 1:
            raise ValueError(f"grant must be >= 1, got {grant}")
        self._bus = bus
        self._policy = policy
        self._subject = subjects.admission(policy)
        self.holder = f"{name}:{uuid.uuid4().hex[:12]}"
        self._lease_s = lease_s
        self._skew_s = skew_s
        self._linger_s = lease_s if linger_s is None else linger_s
        self._rotate_s = lease_s / 3
        self._grant = grant
        self._on_write = on_write
        self._metrics: PolicyAdmissionMetrics | None = metrics.for_policy(policy) if metrics is not None else None
        self._gate: BudgetUser | None = None
        self._total = 0
        self._ledger: AdmissionLedger | None = None  # the newest ledger accepted here
        self._deadlines: dict[str, float] = {}  # holder -> its lease's end on this clock (clipped)
        self._seq = 0  # the fence: the subject's last sequence known here, valid or not
        self._seen_seq = 0  # the last sequence judged here
        self._own: deque[AdmissionLedger] = deque(maxlen=_OWN_KEPT)
        self._slots = 0
        self._share = UNLIMITED  # the most this holder may fill while others wait (fair_shares)
        self._valid_until = 0.0  # monotonic
        self._renew_at = 0.0  # monotonic
        self._wanted = False
        self._starved_since: float | None = None  # monotonic
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._writes = 0
        self._conflicts = 0
        self.rejected: dict[str, int] = {}
        """Ledgers refused by ``rules.admission.check_ledger``, by reason."""
        self.clipped = 0
        """Holdings whose claimed expiry went beyond ``lease_s + skew_s`` after they were seen (clipped)."""
        self.tampered = 0
        """Ledgers another writer wrote that erased or altered this holder's own holding."""
        self.over_admitted = 0
        """Accepted ledgers whose holdings had more in use than the total (a holder outlived its lease)."""
        if self._metrics is not None:
            self._metrics.starved.set_function(self._starved_s)

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
        """The newest ledger accepted here (None: none stored yet)."""
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
        if self._starved_since is None and self.held == 0:
            self._starved_since = time.monotonic()
        # Also while holding more than the fair share: what is used may have fallen, and the surplus can go back.
        if not self._wanted or self._slots > self._share:
            self._wanted = True
            self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def __aenter__(self) -> SharedBudget:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Follow the ledger, replay the retained history through the validation, and take a first share
        (``grant`` slots, if free).

        Raises:
            PermissionDeniedError: this user may not publish the admission subject.
            BusError: the bus did not answer the first reads.
        """
        sub = self._bus.subscribe(self._subject, deliver=Deliver.NEW, include_invalid=True)
        await sub.__aenter__()
        try:
            await self._replay()
        except BaseException:
            await sub.__aexit__(None, None, None)
            raise
        # Only now: what the subscription buffered meanwhile is judged after the history, in order.
        self._tasks.append(asyncio.create_task(self._follow(sub)))
        if self._gate is not None:
            _ = self._gate.allowance  # the gate reads its version and sets the total
        self._wanted = True
        try:
            # Here, not in the task: a refusal (permissions) ends the caller's start.
            demand = self._demand()
            await self._write(self._target(demand), demand)
        except PermissionDeniedError:
            await self.aclose()
            raise
        except BusError as exc:
            log.warning("admission ledger write failed; retrying", extra={"error": repr(exc)})
        self._wanted = False
        self._tasks.append(asyncio.create_task(self._run()))

    async def aclose(self) -> None:
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

    # -- reading and judging the ledger --------------------------------------------------------------

    async def _follow(self, sub: Subscription) -> None:
        # The ledger's changes are judged in order here; a lost subscription is made again from the retained
        # history (what is judged already is skipped by sequence), so no ledger goes unjudged.
        failures = 0
        while True:
            try:
                async with sub:
                    async for item in sub:
                        failures = 0  # the subscription delivers again: the next loss waits from the start
                        self._seen(item)
                return
            except BusError as exc:
                failures += 1
                wait = _RETRY.delay(failures)
                log.warning(
                    "admission ledger subscription lost; resubscribing", extra={"error": repr(exc), "retry_in": wait}
                )
            await asyncio.sleep(wait)
            sub = self._bus.subscribe(self._subject, deliver=Deliver.ALL, include_invalid=True)

    def _seen(self, item: Envelope | Skipped, *, check_drops: bool = True) -> None:
        seq = item.seq or 0
        if seq <= self._seen_seq:
            return
        self._seen_seq = seq
        if seq > self._seq:
            self._seq = seq  # the fence moves with anything stored, valid or not
        if isinstance(item, Envelope) and isinstance(item.event, AdmissionLedger):
            self._judge(item.event, check_drops=check_drops)
        self._wake.set()

    def _judge(self, ledger: AdmissionLedger, *, check_drops: bool = True) -> None:
        if ledger in self._own:
            self._accept_own(ledger)
            return
        now = time.time()
        verdict = check_ledger(
            ledger,
            self._ledger,
            self._deadlines,
            now=now,
            lease_s=self._lease_s,
            skew_s=self._skew_s,
            linger_s=self._linger_s,
            ceiling=self._ceiling(),
            check_drops=check_drops,
        )
        prev_mine = self._ledger.holders.get(self.holder) if self._ledger is not None else None
        if not verdict.accepted:
            reason = verdict.reason or "unknown"
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            if self._metrics is not None:
                self._metrics.rejected.labels(self._policy, reason).inc()
            if prev_mine is not None and ledger.holders.get(self.holder) != prev_mine and ledger.writer != self.holder:
                self._tamper(ledger, "another writer erased or altered this holder's holding")
            log.error(
                "admission ledger rejected; keeping the last valid one",
                extra={"policy": self._policy, "reason": reason, "detail": verdict.detail, "writer": ledger.writer},
            )
            return
        if ledger.writer == self.holder:
            # Not written here, yet in this holder's name: no signature tells it from ours, so the others take
            # it; admit on the smaller of the two holdings and rewrite ours at once.
            mine = ledger.holders.get(self.holder)
            self._slots = min(self._slots, mine.slots if mine is not None else 0)
            self._tamper(ledger, "a ledger was written in this holder's name by someone else")
            self._wanted = True
        for holder in verdict.clipped:
            self.clipped += 1
            if self._metrics is not None:
                self._metrics.clipped.labels(self._policy).inc()
            log.warning(
                "admission holding claims a lease beyond the configured one; clipped",
                extra={"policy": self._policy, "holder": holder, "lease_s": self._lease_s},
            )
        self._ledger = ledger
        self._deadlines = verdict.deadlines
        if check_drops:  # a ledger of the history replayed at the start is not news
            self._observe_overcommit(now)
        free = self._free_for_us()
        if self._slots > free:
            # Another holder has more in use than it holds (back from a lost lease): those groups run, so what
            # they fill is not this holder's to admit on, whatever the ledger still says of it.
            self._slots = max(0, free)
            self._wanted = True
        self._reshare()

    def _accept_own(self, ledger: AdmissionLedger) -> None:
        mine = ledger.holders.get(self.holder)
        deadlines = {h: self._deadlines.get(h, x.expires_at) for h, x in ledger.holders.items()}
        if mine is not None:
            deadlines[self.holder] = mine.expires_at
        self._ledger = ledger
        self._deadlines = deadlines
        self._reshare()

    def _tamper(self, ledger: AdmissionLedger, what: str) -> None:
        self.tampered += 1
        if self._metrics is not None:
            self._metrics.tampered.labels(self._policy).inc()
        log.error(
            "admission holding tampered with: %s",
            what,
            extra={"policy": self._policy, "holder": self.holder, "writer": ledger.writer},
        )

    def _observe_overcommit(self, now: float) -> None:
        ledger = self._ledger
        # The larger of the two totals: a holder whose tracker has no version yet shares a smaller one.
        total = max(self._total, ledger.total) if ledger is not None else 0
        ceiling = self._ceiling()
        if ceiling is not None:
            total = min(total, ceiling)
        if ledger is None or not total:
            return
        live = [x for h, x in ledger.holders.items() if not self._lapsed(h, now)]
        over = sum(counted(x) for x in live) - total
        if over > 0:
            self.over_admitted += 1
            if self._metrics is not None:
                self._metrics.over_admission.labels(self._policy).inc()
            log.warning(
                "admission ledger shows more in use than the total: a holder outlived its lease",
                extra={"policy": self._policy, "over": over, "total": total},
            )

    async def _replay(self) -> None:
        # At the start: judge every retained ledger oldest first, so a forged one in the history is not taken as
        # the base because it is the newest. When an older one was written is not known (its drops are taken as
        # they are); the newest is judged on this clock: an honest write after a forgery carries the live holdings.
        history = await read_subject_history(self._bus, self._subject)
        for k, env in enumerate(history.events):
            self._seen(env, check_drops=k == len(history.events) - 1)
        if history.last_seq > self._seen_seq:
            self._seen_seq = history.last_seq
        self._seq = max(self._seq, history.last_seq)
        self._reshare()

    async def _catch_up(self) -> None:
        # After a refused publish: judge what landed first (the subscription delivers it in order), then fence on
        # the subject's last sequence. If the subscription does not deliver it in time, the history does.
        seq = await self._bus.last_seq(self._subject)
        if seq == 0:
            self._seq = self._seen_seq = 0  # the history is gone: rebuild from the last valid ledger known here
            return
        if seq < self._seen_seq:
            self._seen_seq = 0  # a new stream: its sequences start again
        following = any(not t.done() for t in self._tasks)
        try:
            if not following:
                raise TimeoutError  # nobody delivers: read the history
            async with asyncio.timeout(_CATCH_UP_S):
                while self._seen_seq < seq:
                    self._wake.clear()
                    await self._wake.wait()
        except TimeoutError:
            history = await read_subject_history(self._bus, self._subject)
            for env in history.events:
                self._seen(env)  # what is newer than this holder's view was written since: judged on this clock
            self._seen_seq = max(self._seen_seq, history.last_seq)
        self._seq = max(self._seen_seq, seq)

    def _ceiling(self) -> int | None:
        if self._gate is None:
            return None
        ceiling = self._gate.ceiling
        return None if ceiling >= UNLIMITED else ceiling

    def _starved_s(self) -> float:
        since = self._starved_since
        return 0.0 if since is None or self.held > 0 else time.monotonic() - since

    # -- computing this holder's share ---------------------------------------------------------------

    def _used(self) -> int:
        return self._gate.used if self._gate is not None else 0

    def _demand(self) -> int:
        used = self._used()
        grant = self._grant if self._grant is not None else self._gate.batch if self._gate is not None else 1
        if self._wanted:
            return used + grant
        return min(max(self._slots, used), used + grant)

    def _lapsed(self, holder: str, now: float) -> bool:
        ledger = self._ledger
        deadline = self._deadlines.get(holder)
        if deadline is None:
            deadline = ledger.holders[holder].expires_at if ledger is not None else 0.0
        return lapsed(deadline, now, skew_s=self._skew_s, linger_s=self._linger_s)

    def _others(self) -> dict[str, Holding]:
        """The other holders still counted: their leases stand, or their groups may still be running."""
        ledger = self._ledger
        if ledger is None:
            return {}
        now = time.time()
        return {h: x for h, x in ledger.holders.items() if h != self.holder and not self._lapsed(h, now)}

    def _live(self, holder: str, now: float) -> bool:
        """Whether ``holder``'s lease stands (not only its linger): only a live holder waits for slots."""
        deadline = self._deadlines.get(holder, 0.0)
        return now <= deadline + self._skew_s

    def _reshare(self, demand: int | None = None) -> None:
        others = self._others()
        if not others:
            self._share = UNLIMITED
            return
        now = time.time()
        # A writer that predates ``wants`` wrote 0 there: it asks for what it holds. One past its lease asks for
        # nothing more: it only keeps what it holds.
        demands = {h: max(x.wants, counted(x)) if self._live(h, now) else counted(x) for h, x in others.items()}
        demands[self.holder] = self._demand() if demand is None else demand
        # The turn comes from the clock, not the version: the cap mode has none, and it must rotate too.
        turn = int(now // self._rotate_s)
        self._share = fair_shares(self._total, demands, turn)[self.holder]

    def _asked(self) -> int:
        """The ``wants`` of this holder in the newest ledger known here (0: none there)."""
        mine = self._ledger.holders.get(self.holder) if self._ledger is not None else None
        return mine.wants if mine is not None else 0

    def _others_wait(self) -> bool:
        now = time.time()
        return any(x.wants > x.slots and self._live(h, now) for h, x in self._others().items())

    def _target(self, demand: int) -> int:
        """What to hold: the demand, within the fair share, and never below what is in use."""
        self._reshare(demand)
        return min(demand, max(self._share, self._used()))

    def _free_for_us(self) -> int:
        return self._total - sum(counted(x) for x in self._others().values())

    def _next_change(self) -> float | None:
        """Seconds until another holding lapses or the turn moves (None: no other holder)."""
        others = self._others()
        if not others:
            return None
        now = time.time()
        later = [
            self._deadlines.get(h, x.expires_at) + self._skew_s + self._linger_s - now
            for h, x in others.items()
            if counted(x)
        ]
        later.append(self._rotate_s - now % self._rotate_s)
        return min(later)

    # -- writing -------------------------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0  # ledger writes failed in a row
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
                    failures += 1
                    wait = _RETRY.delay(failures)
                    log.warning("admission ledger write failed; retrying", extra={"error": repr(exc), "retry_in": wait})
                    await asyncio.sleep(wait)
                    continue
                failures = 0
                self._wanted = False
            timeout = max(0.0, self._renew_at - time.monotonic())
            change = self._next_change()
            if change is not None:
                timeout = min(timeout, max(0.0, change) + 0.01)
            self._wake.clear()
            try:
                async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _write(self, target: int, demand: int, *, leaving: bool = False) -> None:
        while True:
            ledger = self._ledger
            now = time.time()
            holders = self._others()
            free = self._total - sum(counted(x) for x in holders.values())
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
            self._own.append(record)
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
                await self._catch_up()
                continue
            except BusError:
                await self._catch_up_quietly()
                raise
            self._writes += 1
            if ack.seq > self._seen_seq:  # the subscription has not delivered it yet
                self._seen_seq = ack.seq
                self._accept_own(record)
            self._seq = max(self._seq, ack.seq)
            self._slots = slots
            self._valid_until = sent + self._lease_s - self._skew_s
            self._renew_at = sent + self._lease_s / 3
            if slots > 0 or demand <= self._used():
                self._starved_since = None
            if self._on_write is not None:
                self._on_write(record, ack.seq)
            if self._gate is not None:
                self._gate.notify()
            return

    async def _catch_up_quietly(self) -> None:
        try:
            await self._catch_up()
        except BusError as exc:
            log.debug("could not re-read the admission ledger", extra={"error": repr(exc)})
