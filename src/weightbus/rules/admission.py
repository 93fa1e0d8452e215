"""The admission rule: whether one more group may start generating, as pure functions.

A group may start while ``(max_staleness + 1) * batch - (accepted + running) > 0``, ``accepted`` counting only groups
drained at the tracker's version or later: the horizon follows the version held, never a counter. ``fair_shares``
splits a shared allowance max-min fairly; ``check_ledger`` accepts a shared ledger only as a valid transition.
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
    "accepted_in_horizon",
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
    """The groups the bound allows in the horizon that starts at ``current``: ``(max_staleness + 1) * batch``.

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
            (``accepted_in_horizon``).
        running: groups admitted and not finished.

    Raises:
        ValueError: as ``allowance``, or a negative count.
    """
    if accepted < 0 or running < 0:
        raise ValueError(f"counts must be >= 0, got accepted={accepted} running={running}")
    return allowance(current, max_staleness, batch) - accepted - running


def accepted_in_horizon(current: int | None, ready: int, taken: Mapping[int | None, int]) -> int:
    """The accepted groups that count against the horizon starting at ``current``.

    Args:
        current: the version the tracker holds (None: never published).
        ready: groups finished and waiting to be drained (they will train at ``current`` or later).
        taken: groups drained, by the version the drain judged against (None: before any publish).

    Returns:
        ``ready`` plus the groups drained at ``current`` or later; with ``current`` None, only those
        drained before any publish count (a numbered batch cannot be in a horizon that has no number).
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
