"""The admission rule: whether one more group may start generating, as pure functions.

The drain judges a group after it is generated (``rules.staleness``); this rule paces generation so that
a group starts only while it can still be trained within the bound. It lives next to the staleness rule
and uses its definitions:

* staleness is ``current - oldest``, and a group generated while the tracker holds ``v`` has
  ``oldest >= v`` (the engines carry ``v`` or newer: stamping follows the push);
* the trainer consumes ``batch`` groups per version step: the batch judged at ``c`` is drained once the
  tracker holds ``c``, and the next one once it holds a newer number.

**Derivation.** A group admitted while the tracker holds ``c`` is fresh in every batch judged at ``c``,
``c + 1``, ..., ``c + max_staleness``: ``(max_staleness + 1)`` batches, ``(max_staleness + 1) * batch``
training slots (the *allowance*). Ahead of it for those slots are the groups already **accepted** into
that window (finished and waiting in the buffer, or already drained into the batch judged at ``c`` or
later) and the groups still **running** (admitted, not finished). So it may start only while::

    capacity = (max_staleness + 1) * batch - (accepted + running) > 0

This is AReaL's ``(eta + v + 1) * B - (accepted + running)`` with both terms rebased on the window that
starts at the tracker's version: AReaL counts every group ever accepted against ``v * B``, which holds
only while versions are contiguous from 0 and a local counter matches them. weightbus's numbers skip
(a failed update uses its number up; a claim resumes above the high-water mark), so here ``accepted``
counts only the groups drained at ``c`` or later (``accepted_in_window``): the capacity is tied to the
version the tracker holds, never to a counter, and nothing needs re-basing after a recovery.

Invariants (property-tested):

* admitting only while ``capacity > 0`` keeps ``accepted + running <= allowance`` at every instant: a
  finish moves a group from running to accepted (or frees it), a drain moves accepted groups from the
  buffer to a batch inside the window, and a version advance only drops batches out of the window;
* ``current is None`` (the policy never published) admits one batch's worth (the allowance of a bound of
  0): nothing says which version those groups will carry, so they can be counted on only for the first
  batch, and more would be generated against weights nobody announced (erring toward stale);
* a version that goes backwards (a regression the tracker accepted) keeps every batch drained at the
  newer numbers in the window: the count only errs toward fewer admissions;
* ``max_staleness is None`` (measure, never filter) and the ``off`` mode never refuse; ``cap`` refuses
  once ``running`` reaches the cap, whatever the version.

Several processes sharing one allowance (``consumers.admission.shared``) split it by ``fair_shares``: max-min
fair over what each asks for, so a busy holder that refills its slots as fast as it frees them cannot starve
one that arrived later. The shares sum to at most the allowance, none exceeds its demand, and one that gets
less than it asked for gets at least as much as any other (within one slot; with fewer slots than holders,
the slot rotates with ``turn``, which the holders take from the time, whatever the mode).

**Ledger validation** (``check_ledger``): a reader of the shared ledger accepts a new one only as a transition
from the last it accepted. The writer may change its own holding; another holding may only be carried over
unchanged, added, or dropped once its lease (and the linger of its in-flight groups) has run out on the
reader's clock; the slots sum to at most the ledger's total and the policy's ceiling; holder ids are
``<name>:<12 hex digits>``. Every expiry is clipped to the reader's own clock: a holding lasts at most
``lease_s + skew_s`` after the reader first saw it, whatever it claims. What this cannot stop without
signatures: a writer naming itself as any holder (see docs/operations.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from weightbus.schemas import AdmissionLedger, Holding

__all__ = [
    "ADMISSION_MODES",
    "LEDGER_REJECTIONS",
    "AdmissionMode",
    "LedgerVerdict",
    "UNLIMITED",
    "accepted_in_window",
    "allowance",
    "capacity",
    "check_ledger",
    "counted",
    "fair_shares",
    "holder_id_ok",
    "lapsed",
    "mode_capacity",
]

AdmissionMode = Literal["off", "cap", "bounded"]
ADMISSION_MODES: Final = ("off", "cap", "bounded")

#: What ``mode_capacity`` returns when nothing limits admission.
UNLIMITED: Final = 1 << 62


def allowance(current: int | None, max_staleness: int | None, batch: int) -> int:
    """The groups the bound allows in the window that starts at ``current``: ``(max_staleness + 1) * batch``.

    ``current is None`` allows one batch (see the module docstring); ``max_staleness is None`` is
    unlimited (``UNLIMITED``).

    Raises:
        ValueError: ``batch`` < 1 or ``max_staleness`` < 0.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if max_staleness is None:
        return UNLIMITED
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
    if current is None:
        return batch
    return (max_staleness + 1) * batch


def capacity(current: int | None, max_staleness: int | None, batch: int, accepted: int, running: int) -> int:
    """How many more groups may start now: ``allowance - (accepted + running)`` (may be negative).

    Args:
        current: the version the tracker holds, or None before the first publish.
        max_staleness: the drain's bound, or None (unlimited).
        batch: groups per training step.
        accepted: groups finished and kept that will train at ``current`` or later
            (``accepted_in_window``).
        running: groups admitted and not finished.

    Raises:
        ValueError: as ``allowance``, or a negative count.
    """
    if accepted < 0 or running < 0:
        raise ValueError(f"counts must be >= 0, got accepted={accepted} running={running}")
    return allowance(current, max_staleness, batch) - accepted - running


def accepted_in_window(current: int | None, ready: int, taken: Mapping[int | None, int]) -> int:
    """The accepted groups that count against the window starting at ``current``.

    Args:
        current: the version the tracker holds (None: never published).
        ready: groups finished and waiting to be drained (they will train at ``current`` or later).
        taken: groups drained, by the version the drain judged against (None: before any publish).

    Returns:
        ``ready`` plus the groups drained at ``current`` or later; with ``current`` None, only those
        drained before any publish count (a numbered batch cannot be in a window that has no number).
    """
    if current is None:
        return ready + taken.get(None, 0)
    return ready + sum(n for v, n in taken.items() if v is not None and v >= current)


def mode_capacity(
    mode: AdmissionMode,
    *,
    current: int | None,
    max_staleness: int | None,
    batch: int,
    accepted: int,
    running: int,
    cap: int | None = None,
) -> int:
    """The capacity under ``mode``: ``off`` is unlimited, ``cap`` is ``cap - running``, ``bounded`` is ``capacity``.

    Raises:
        ValueError: an unknown mode, ``cap`` mode without a cap >= 1, or as ``capacity``.
    """
    if mode == "bounded":
        return capacity(current, max_staleness, batch, accepted, running)
    if mode == "cap":
        if cap is None or cap < 1:
            raise ValueError(f"the cap mode needs a cap >= 1, got {cap}")
        return cap - running
    if mode == "off":
        return UNLIMITED
    raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {mode!r}")


def fair_shares(total: int, demands: Mapping[str, int], turn: int = 0) -> dict[str, int]:
    """Split ``total`` slots max-min fairly among holders asking for ``demands`` (holder id -> slots wanted).

    A holder that asks for no more than an even split of what is left gets what it asks; the others share
    the rest evenly, and the remainder of that split goes one each to holders in id order. When there are
    fewer slots than such holders (some would get none), the remainder starts at ``turn`` (``SharedBudget`` takes
    it from the clock, so that it moves in every mode),
    so it moves from holder to holder instead of always serving the same ones; otherwise the shares stay
    put whatever ``turn`` is, and the holders do not rewrite the ledger at each version.

    Returns:
        holder id -> share, with ``sum <= total``, each ``share <= demand``, and ``sum == total`` whenever
        the demands add up to more than ``total``.

    Raises:
        ValueError: a negative ``total`` or demand.
    """
    if total < 0 or any(d < 0 for d in demands.values()):
        raise ValueError(f"total and demands must be >= 0, got total={total} demands={dict(demands)}")
    shares: dict[str, int] = {}
    left = total
    pending = sorted(demands, key=lambda h: (demands[h], h))
    for i, holder in enumerate(pending):
        even = left // (len(pending) - i)
        if demands[holder] <= even:
            shares[holder] = demands[holder]
            left -= demands[holder]
            continue
        # Every holder from here on asks for more than an even split: split evenly, the remainder in turn.
        rest = sorted(pending[i:])
        extra = left - even * len(rest)
        start = turn % len(rest) if even == 0 else 0
        for k, other in enumerate(rest):
            shares[other] = even + (1 if (k - start) % len(rest) < extra else 0)
        break
    return shares


#: Why ``check_ledger`` refused a ledger (the ``reason`` label of ``weightbus_admission_ledgers_rejected_total``).
LEDGER_REJECTIONS: Final = ("bad_holder", "bad_holding", "over_limit", "altered_holding", "dropped_live_holding")
_INCARNATION_LEN: Final = 12
_HEX: Final = frozenset("0123456789abcdef")
_NAME_MAX: Final = 128


def holder_id_ok(holder: str) -> bool:
    """Whether ``holder`` is ``<name>:<incarnation>``: a printable name without spaces (at most 128 characters)
    and 12 lowercase hex digits, as ``SharedBudget`` makes them."""
    name, sep, incarnation = holder.rpartition(":")
    return (
        bool(sep)
        and 0 < len(name) <= _NAME_MAX
        and name.isprintable()
        and not any(c.isspace() for c in name)
        and len(incarnation) == _INCARNATION_LEN
        and set(incarnation) <= _HEX
    )


def counted(holding: Holding) -> int:
    """What a holding takes of the budget: its slots, or what it had in use when that was more (groups a holder
    started before its lease lapsed and that still run count until it says they ended)."""
    return holding.slots if holding.slots >= holding.used else holding.used


def lapsed(deadline: float, now: float, *, skew_s: float, linger_s: float) -> bool:
    """Whether a writer may drop a holding whose (clipped) lease ends at ``deadline``: ``skew_s`` for the clocks,
    then ``linger_s`` for the groups its holder may still be running, have passed."""
    return now > deadline + skew_s + linger_s


@dataclass(frozen=True, slots=True)
class LedgerVerdict:
    """What ``check_ledger`` decided.

    Attributes:
        reason: None when the ledger is accepted, else one of ``LEDGER_REJECTIONS``.
        detail: a readable account of the refusal (empty when accepted).
        deadlines: holder -> the end of its lease on the reader's clock (clipped), for an accepted ledger.
        clipped: the holders whose claimed expiry went beyond what the reader allows (clipped, to be counted).
    """

    reason: str | None
    detail: str = ""
    deadlines: dict[str, float] = field(default_factory=dict)
    clipped: tuple[str, ...] = ()

    @property
    def accepted(self) -> bool:
        """Whether the ledger was accepted."""
        return self.reason is None


def check_ledger(
    new: AdmissionLedger,
    prev: AdmissionLedger | None,
    prev_deadlines: Mapping[str, float],
    *,
    now: float,
    lease_s: float,
    skew_s: float,
    linger_s: float,
    ceiling: int | None = None,
    check_drops: bool = True,
) -> LedgerVerdict:
    """Judge ``new`` as the successor of ``prev``, the last ledger this reader accepted (None: none yet).

    Args:
        new: the ledger read from the bus.
        prev: the last accepted ledger, or None (then only ``new`` itself is checked).
        prev_deadlines: the clipped lease ends of ``prev``'s holdings on the reader's clock.
        now: the reader's Unix time when it read ``new``.
        lease_s: the configured lease; no holding lasts longer than ``lease_s + skew_s`` after it is first seen.
        skew_s: the clock difference the leases tolerate.
        linger_s: how long after its lease a holding's groups may still run (a writer drops it only after).
        ceiling: the most the policy's allowance can be (None: not known here).
        check_drops: whether a dropped holding must have lapsed by ``now`` (False for a ledger of the retained
            history older than the newest: when it was written is not known, so its drops are taken as they are).

    Returns:
        the verdict; an accepted one carries each holding's deadline (carried over from ``prev`` when the holding
        is unchanged, else ``min(expires_at, now + lease_s + skew_s)``) and which holdings were clipped.
    """
    for holder in (new.writer, *new.holders):
        if not holder_id_ok(holder):
            return LedgerVerdict("bad_holder", f"holder id {holder[:80]!r} is not <name>:<12 hex digits>")
    limit = new.total if ceiling is None or ceiling > new.total else ceiling
    for holder, holding in new.holders.items():
        if not math.isfinite(holding.expires_at) or (ceiling is not None and holding.used > ceiling):
            return LedgerVerdict("bad_holding", f"holding of {holder!r} is impossible: {holding}")
    granted = sum(h.slots for h in new.holders.values())
    if granted > limit:
        return LedgerVerdict("over_limit", f"{granted} slots granted, the limit is {limit}")
    if prev is not None:
        for holder, before in prev.holders.items():
            if holder == new.writer:
                continue
            after = new.holders.get(holder)
            if after is None:
                deadline = prev_deadlines.get(holder, before.expires_at)
                # The writer dropped it after skew + linger on its clock; this one allows the skew either way.
                if check_drops and now < deadline + linger_s:
                    return LedgerVerdict(
                        "dropped_live_holding",
                        f"{new.writer!r} dropped the holding of {holder!r}, live until {deadline + linger_s:.3f}",
                    )
            elif after != before:
                return LedgerVerdict("altered_holding", f"{new.writer!r} changed the holding of {holder!r}")
    deadlines: dict[str, float] = {}
    clipped: list[str] = []
    bound = now + lease_s + skew_s
    for holder, holding in new.holders.items():
        if prev is not None and prev.holders.get(holder) == holding and holder in prev_deadlines:
            deadlines[holder] = prev_deadlines[holder]
            continue
        if holding.expires_at > bound:
            clipped.append(holder)
            deadlines[holder] = bound
        else:
            deadlines[holder] = holding.expires_at
    return LedgerVerdict(None, deadlines=deadlines, clipped=tuple(clipped))
