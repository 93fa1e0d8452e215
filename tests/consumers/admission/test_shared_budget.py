"""The shared budget on the in-process bus: races never over-grant, a dead holder's slots come back within the
lease, a lost ledger is rebuilt, and every stored ledger (the record) grants at most the allowance."""

from __future__ import annotations

import asyncio
import time

from weightbus.bus import MemoryBus, subjects
from weightbus.consumers.admission import Admission, SharedBudget
from weightbus.schemas import AdmissionLedger

POLICY = "p"


def _ledgers(bus: MemoryBus) -> list[AdmissionLedger]:
    from weightbus.schemas import decode

    subject = subjects.admission(POLICY)
    return [decode(subject, data) for _, data, _ in bus._by_subject.get(subject, [])]  # type: ignore[misc]


async def _fill(gate: Admission, n: int, held: list) -> None:
    for _ in range(n):
        held.append(await gate.acquire())


async def test_three_holders_racing_never_exceed_the_allowance() -> None:
    bus = MemoryBus(history=10_000)
    gates, budgets = [], []
    for i in range(3):
        budget = SharedBudget(bus, POLICY, name=f"r{i}", lease_s=2.0, skew_s=0.2, grant=2)
        gates.append(Admission("bounded", current=5, max_staleness=1, batch=4, budget=budget, poll_s=0.01))
        budgets.append(budget)
    for b in budgets:
        await b.start()
    held: list = []
    fills = [asyncio.create_task(_fill(g, 8, held)) for g in gates]
    await asyncio.sleep(0.5)
    assert len(held) == 8  # the allowance: (1 + 1) * 4, and no more
    assert sum(g.running for g in gates) == 8
    for ledger in _ledgers(bus):
        assert sum(h.slots for h in ledger.holders.values()) <= ledger.total == 8
    assert sum(b.held for b in budgets) <= 8
    for f in fills:
        f.cancel()
    for b in budgets:
        await b.close()
    assert _ledgers(bus)[-1].holders == {}


async def test_a_dead_holder_gives_its_slots_back_within_the_lease() -> None:
    bus = MemoryBus(history=10_000)
    lease, skew = 0.8, 0.1
    dead = SharedBudget(bus, POLICY, name="dead", lease_s=lease, skew_s=skew, grant=4)
    dead_gate = Admission("bounded", current=1, max_staleness=0, batch=4, budget=dead, poll_s=0.01)
    await dead.start()
    for _ in range(4):
        await dead_gate.acquire()
    live = SharedBudget(bus, POLICY, name="live", lease_s=lease, skew_s=skew, grant=4)
    gate = Admission("bounded", current=1, max_staleness=0, batch=4, budget=live, poll_s=0.01)
    await live.start()
    assert gate.try_acquire() is None
    # kill -9: the tasks stop without a last write.
    for task in dead._tasks:
        task.cancel()
    last_renewal = max(ledger.written_at for ledger in _ledgers(bus) if ledger.writer == dead.holder)
    await asyncio.wait_for(gate.acquire(), lease + skew + 2.0)
    got_at = time.time()
    assert got_at - last_renewal <= lease + skew + 0.5
    for ledger in _ledgers(bus):
        live_slots = sum(h.slots for k, h in ledger.holders.items() if h.expires_at + skew >= ledger.written_at)
        assert live_slots <= 4
    await live.close()


async def test_a_lapsed_lease_holds_nothing() -> None:
    bus = MemoryBus()
    budget = SharedBudget(bus, POLICY, name="r", lease_s=0.5, skew_s=0.1, grant=4)
    gate = Admission("bounded", current=1, max_staleness=0, batch=4, budget=budget, poll_s=0.01)
    await budget.start()
    await gate.acquire()
    assert budget.held == 4
    for task in budget._tasks:
        task.cancel()  # no renewal from now on (as when the bus is unreachable)
    await asyncio.sleep(0.45)
    assert budget.held == 0 and gate.try_acquire() is None


async def test_a_lost_ledger_is_rebuilt_from_the_live_holders() -> None:
    bus = MemoryBus()
    a = SharedBudget(bus, POLICY, name="a", lease_s=1.0, skew_s=0.1, grant=2)
    gate = Admission("bounded", current=1, max_staleness=1, batch=2, budget=a, poll_s=0.01)
    await a.start()
    await gate.acquire()
    bus.purge(subjects.admission(POLICY))
    for _ in range(3):
        await asyncio.wait_for(gate.acquire(), 3.0)
    assert gate.running == 4 and gate.try_acquire() is None
    ledger = _ledgers(bus)[-1]
    assert list(ledger.holders) == [a.holder] and ledger.holders[a.holder].slots == 4
    await a.close()
