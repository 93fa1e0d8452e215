"""The admission rule: at no instant do running plus accepted groups exceed what the bound allows.

The sequences of admit / finish / drain / version-advance steps are simulated twice: on plain counts with the
pure rule, and on the ``Admission`` gate, whose counts must match the model at every step.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbus.consumers.admission import Admission
from weightbus.errors import AdmissionError
from weightbus.rules.admission import (
    UNLIMITED,
    accepted_in_horizon,
    allowance,
    capacity,
    fair_shares,
    mode_capacity,
)

STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 6)),
        st.tuples(st.just("accept"), st.integers(1, 6)),
        st.tuples(st.just("release"), st.integers(1, 6)),
        st.tuples(st.just("drain"), st.integers(0, 8), st.integers(0, 3)),
        st.tuples(st.just("advance"), st.integers(1, 3)),
        st.tuples(st.just("publish"), st.integers(0, 5)),
    ),
    max_size=80,
)


def test_allowance_is_one_window_of_batches() -> None:
    assert allowance(7, 0, 8) == 8
    assert allowance(7, 2, 8) == 24
    assert allowance(None, 4, 8) == 8  # never published: one batch
    assert allowance(3, None, 8) == UNLIMITED
    assert capacity(3, 1, 4, accepted=5, running=2) == 1
    assert capacity(3, 1, 4, accepted=6, running=3) == -1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="batch"):
        allowance(1, 1, 0)
    with pytest.raises(ValueError, match="max_staleness"):
        allowance(1, -1, 4)
    with pytest.raises(ValueError, match="counts"):
        capacity(1, 1, 4, accepted=-1, running=0)
    with pytest.raises(ValueError, match="cap"):
        mode_capacity("cap", current=1, max_staleness=1, batch=4, accepted=0, running=0)
    with pytest.raises(ValueError, match="admission must be"):
        mode_capacity("nope", current=1, max_staleness=1, batch=4, accepted=0, running=0)  # type: ignore[arg-type]


def test_only_batches_drained_at_the_current_version_or_later_count() -> None:
    taken = {None: 4, 3: 4, 4: 2, 5: 1}
    assert accepted_in_horizon(4, 3, taken) == 3 + 2 + 1
    assert accepted_in_horizon(None, 3, taken) == 3 + 4
    assert accepted_in_horizon(9, 0, taken) == 0


def test_modes() -> None:
    kw = {"current": 5, "max_staleness": 0, "batch": 4, "accepted": 4, "running": 3}
    assert mode_capacity("off", **kw) == UNLIMITED
    assert mode_capacity("cap", cap=5, **kw) == 2
    assert mode_capacity("bounded", **kw) == -3


@settings(max_examples=300, deadline=None)
@given(steps=STEPS, eta=st.integers(0, 3), batch=st.integers(1, 5))
def test_running_plus_accepted_never_exceed_the_allowance(steps: list[tuple[int, ...]], eta: int, batch: int) -> None:
    current: list[int | None] = [None]
    gate = Admission("bounded", current=lambda: current[0], max_staleness=eta, batch=batch)
    running = ready = 0
    taken: dict[int | None, int] = {}
    slots = []
    accepted = []

    def check() -> None:
        acc = accepted_in_horizon(current[0], ready, taken)
        assert acc + running <= allowance(current[0], eta, batch)
        assert (gate.running, gate.ready, gate.accepted) == (running, ready, acc)
        assert gate.capacity() == capacity(current[0], eta, batch, acc, running)

    for step in steps:
        kind = step[0]
        if kind == "admit":
            for _ in range(step[1]):
                slot = gate.try_acquire()
                acc = accepted_in_horizon(current[0], ready, taken)
                assert (slot is not None) == (capacity(current[0], eta, batch, acc, running) > 0)
                if slot is not None:
                    assert slot.version == current[0]
                    running += 1
                    slots.append(slot)
                check()
        elif kind in ("accept", "release"):
            for _ in range(min(step[1], len(slots))):
                slot = slots.pop(0)
                running -= 1
                if kind == "accept":
                    slot.accept()
                    ready += 1
                    accepted.append(slot)
                else:
                    slot.release("recycled")
                check()
        elif kind == "drain":
            kept, filtered = min(step[1], ready), min(step[2], ready - min(step[1], ready))
            gate.drained(kept, filtered, at=current[0])
            ready -= kept + filtered
            if kept:
                taken[current[0]] = taken.get(current[0], 0) + kept
            check()
        elif kind == "advance":
            if current[0] is not None:
                current[0] += step[1]
            check()
        else:
            if current[0] is None:
                current[0] = step[1]
            check()


def test_a_regression_never_raises_the_capacity() -> None:
    current = [6]
    gate = Admission("bounded", current=lambda: current[0], max_staleness=0, batch=1)
    slot = gate.try_acquire()
    assert slot is not None
    slot.accept()
    gate.drained(1, at=6)
    current[0] = 7
    assert gate.capacity() == 1
    current[0] = 5  # back: the batch drained at 6 is in the window again
    assert gate.capacity() == 0
    assert gate.try_acquire() is None


def test_a_slot_is_closed_once() -> None:
    gate = Admission("cap", cap=1, batch=1)
    slot = gate.try_acquire()
    assert slot is not None and gate.try_acquire() is None
    slot.release("aborted")
    with pytest.raises(AdmissionError):
        slot.release("aborted")
    with pytest.raises(AdmissionError):
        slot.accept()
    assert gate.running == 0 and gate.counts["aborted"] == 1


def test_a_drain_of_groups_without_slots_is_refused() -> None:
    gate = Admission("bounded", current=1, max_staleness=1, batch=2)
    with pytest.raises(AdmissionError, match="accepted slot"):
        gate.drained(1, at=1)


DEMANDS = st.dictionaries(st.sampled_from([f"r{i}" for i in range(6)]), st.integers(0, 30), max_size=6)


@given(st.integers(0, 40), DEMANDS, st.integers(0, 100))
def test_fair_shares_never_over_grant_and_are_max_min_fair(total: int, demands: dict[str, int], turn: int) -> None:
    shares = fair_shares(total, demands, turn)
    assert set(shares) == set(demands)
    assert sum(shares.values()) <= total
    assert all(0 <= shares[h] <= demands[h] for h in demands)
    if sum(demands.values()) > total:
        assert sum(shares.values()) == total  # work-conserving: nothing left idle while someone waits
    for h in demands:
        if shares[h] < demands[h]:  # short of its demand: nobody else has more than one slot above it
            assert all(shares[o] <= shares[h] + 1 for o in demands)


def test_fair_shares_examples() -> None:
    assert fair_shares(12, {"hog": 14, "late": 2}) == {"hog": 10, "late": 2}
    assert fair_shares(12, {"hog": 14, "late": 8}) == {"hog": 6, "late": 6}
    assert fair_shares(12, {"a": 2, "b": 3}) == {"a": 2, "b": 3}
    assert fair_shares(13, {"a": 9, "b": 9}) == {"a": 7, "b": 6}
    assert fair_shares(13, {"a": 9, "b": 9}, turn=1) == {"a": 7, "b": 6}  # everyone has some: no churn
    # Fewer slots than holders: the slot moves with the turn, so no holder waits for ever.
    assert {h for t in range(3) for h, n in fair_shares(1, {"a": 2, "b": 2, "c": 2}, t).items() if n} == {"a", "b", "c"}
    with pytest.raises(ValueError, match="must be >= 0"):
        fair_shares(-1, {"a": 1})
