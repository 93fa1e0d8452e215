"""The ledger validation rule (``rules.admission.check_ledger``), property-tested without a bus.

Honest transitions (the writer changes only its own holding, drops only lapsed holdings, stays within the
limit) are always accepted; a ledger that alters or drops another's live holding, grants beyond the limit or
names a malformed holder is always refused; no deadline is ever later than ``lease + skew`` after the reader saw
the holding, whatever it claims.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from weightbus.rules.admission import LEDGER_REJECTIONS, check_ledger, counted, holder_id_ok, lapsed
from weightbus.schemas import AdmissionLedger, Holding

LEASE, SKEW, LINGER = 3.0, 0.5, 2.0
NOW = 1_000_000.0
IDS = [f"r{i}:{i:012x}" for i in range(5)]

holdings = st.builds(
    Holding,
    slots=st.integers(0, 4),
    used=st.integers(0, 4),
    expires_at=st.floats(NOW - 10, NOW + LEASE),
    wants=st.integers(0, 6),
)


def _ledger(holders: dict[str, Holding], writer: str, total: int = 12) -> AdmissionLedger:
    return AdmissionLedger(policy="p", total=total, holders=holders, writer=writer, version=None, written_at=NOW)


@st.composite
def bases(draw: st.DrawFn) -> AdmissionLedger:
    holders = draw(st.dictionaries(st.sampled_from(IDS), holdings, max_size=5))
    while sum(h.slots for h in holders.values()) > 12:
        holders.pop(next(iter(holders)))
    return _ledger(holders, draw(st.sampled_from(IDS)))


def _deadlines(ledger: AdmissionLedger) -> dict[str, float]:
    return {h: x.expires_at for h, x in ledger.holders.items()}


@settings(max_examples=300, deadline=None)
@given(base=bases(), writer=st.sampled_from(IDS), mine=holdings, dt=st.floats(0, 20))
def test_an_honest_transition_is_accepted(base: AdmissionLedger, writer: str, mine: Holding, dt: float) -> None:
    now = NOW + dt
    deadlines = _deadlines(base)
    # As SharedBudget writes: the others not lapsed on its clock (read here with the skew the other way), itself.
    others = {
        h: x
        for h, x in base.holders.items()
        if h != writer and not lapsed(deadlines[h], now + SKEW, skew_s=SKEW, linger_s=LINGER)
    }
    free = 12 - sum(counted(x) for x in others.values())
    slots = max(0, min(mine.slots, free))
    new = _ledger({**others, writer: Holding(slots=slots, used=mine.used, expires_at=now + LEASE)}, writer)
    verdict = check_ledger(new, base, deadlines, now=now, lease_s=LEASE, skew_s=SKEW, linger_s=LINGER, ceiling=12)
    assert verdict.accepted, verdict
    assert verdict.clipped == ()
    assert set(verdict.deadlines) == set(new.holders)


@settings(max_examples=300, deadline=None)
@given(base=bases(), writer=st.sampled_from(IDS), victim=st.sampled_from(IDS), change=holdings, drop=st.booleans())
def test_touching_another_live_holding_is_refused(
    base: AdmissionLedger, writer: str, victim: str, change: Holding, drop: bool
) -> None:
    if victim == writer or victim not in base.holders:
        return
    holders = dict(base.holders)
    if drop:
        del holders[victim]
        reason = "dropped_live_holding"
    else:
        if change == holders[victim]:
            return
        holders[victim] = change
        reason = "altered_holding"
    if sum(h.slots for h in holders.values()) > 12:
        return
    now = base.holders[victim].expires_at + LINGER - 0.01  # live by the reader's clock, with its linger
    new = _ledger(holders, writer)
    verdict = check_ledger(
        new, base, _deadlines(base), now=now, lease_s=LEASE, skew_s=SKEW, linger_s=LINGER, ceiling=12
    )
    assert verdict.reason == reason


@settings(max_examples=300, deadline=None)
@given(slots=st.lists(st.integers(0, 8), min_size=1, max_size=5), ceiling=st.integers(1, 12), total=st.integers(0, 40))
def test_a_ledger_granting_beyond_its_total_or_the_ceiling_is_refused(
    slots: list[int], ceiling: int, total: int
) -> None:
    holders = {IDS[i]: Holding(slots=n, used=0, expires_at=NOW) for i, n in enumerate(slots)}
    new = _ledger(holders, IDS[0], total=total)
    verdict = check_ledger(new, None, {}, now=NOW, lease_s=LEASE, skew_s=SKEW, linger_s=LINGER, ceiling=ceiling)
    assert verdict.accepted == (sum(slots) <= min(total, ceiling))
    assert verdict.reason in (None, "over_limit")


@settings(max_examples=300, deadline=None)
@given(expires=st.floats(0, 1e12), seen=st.floats(NOW, NOW + 100))
def test_no_deadline_outlasts_the_lease_after_it_was_seen(expires: float, seen: float) -> None:
    new = _ledger({IDS[1]: Holding(slots=2, used=0, expires_at=expires)}, IDS[1])
    verdict = check_ledger(new, None, {}, now=seen, lease_s=LEASE, skew_s=SKEW, linger_s=LINGER)
    assert verdict.accepted
    assert verdict.deadlines[IDS[1]] <= seen + LEASE + SKEW
    assert (IDS[1] in verdict.clipped) == (expires > seen + LEASE + SKEW)
    # Carried over unchanged, it keeps the deadline it got when first seen: waiting does not renew it.
    later = check_ledger(
        new, new, verdict.deadlines, now=seen + 50, lease_s=LEASE, skew_s=SKEW, linger_s=LINGER, check_drops=True
    )
    assert later.deadlines[IDS[1]] == verdict.deadlines[IDS[1]]


@given(name=st.text(max_size=140), incarnation=st.text(alphabet="0123456789abcdefX", max_size=14))
def test_holder_ids_are_name_colon_twelve_hex_digits(name: str, incarnation: str) -> None:
    holder = f"{name}:{incarnation}"
    expected = (
        0 < len(name) <= 128
        and name.isprintable()
        and not any(c.isspace() for c in name)
        and len(incarnation) == 12
        and "X" not in incarnation
    )
    assert holder_id_ok(holder) == expected
    if not expected:
        new = _ledger({holder: Holding(slots=0, used=0, expires_at=NOW)}, IDS[0])
        verdict = check_ledger(new, None, {}, now=NOW, lease_s=LEASE, skew_s=SKEW, linger_s=LINGER)
        assert verdict.reason == "bad_holder" and verdict.reason in LEDGER_REJECTIONS


def test_a_lapsed_holding_may_be_dropped_and_a_new_one_added() -> None:
    base = _ledger({IDS[1]: Holding(slots=4, used=4, expires_at=NOW)}, IDS[1])
    new = _ledger({IDS[3]: Holding(slots=1, used=0, expires_at=NOW + 5)}, IDS[2])
    assert check_ledger(
        new, base, {IDS[1]: NOW}, now=NOW + LINGER, lease_s=LEASE, skew_s=SKEW, linger_s=LINGER
    ).accepted
    early = check_ledger(new, base, {IDS[1]: NOW}, now=NOW + 1, lease_s=LEASE, skew_s=SKEW, linger_s=LINGER)
    assert early.reason == "dropped_live_holding"
    # Its in-flight groups count while the holding does: max(slots, used).
    assert counted(Holding(slots=1, used=3, expires_at=NOW)) == 3
