"""``weightbus rollout``'s loop (``run_rollout``) with a shared budget, against a reference engine and a real NATS.

Another holder of the policy takes part of the budget; the rollout must still serve its batches, hold no more than
the rest, and the ledgers on the bus never grant more than the allowance. Each batch's groups carry the version
they were generated with, within the bound of the version they were judged at.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from weightbus.bus import connect, subjects  # noqa: E402
from weightbus.bus.history import read_subject_history  # noqa: E402
from weightbus.consumers.admission import Admission, SharedBudget  # noqa: E402
from weightbus.errors import NoRolloutError
from weightbus.producers import VersionPublisher  # noqa: E402
from weightbus.refengine.policy_model import WindowLM  # noqa: E402
from weightbus.refengine.reference import EngineState, create_app  # noqa: E402
from weightbus.refengine.serve import ServedEngine  # noqa: E402
from weightbus.rl.batches import BatchReply, BatchRequest, request_batch  # noqa: E402
from weightbus.rl.config import RolloutConfig  # noqa: E402
from weightbus.rl.rollout import run_rollout  # noqa: E402
from weightbus.schemas import AdmissionLedger  # noqa: E402

pytestmark = [pytest.mark.nats, pytest.mark.torch]

POLICY = "adm-rollout"
BATCH = 4


async def _request(bus: object, rollout: asyncio.Task[None], request: BatchRequest) -> BatchReply:
    for _ in range(100):  # the rollout subscribes to its batch subject a moment after it starts
        if rollout.done():
            rollout.result()
        try:
            return await request_batch(bus, POLICY, request, timeout=60)
        except NoRolloutError:
            await asyncio.sleep(0.1)
    raise AssertionError("the rollout never served its batch subject")


async def test_the_rollout_shares_its_budget_and_serves_its_batches(nats_url: str) -> None:
    # Bounded: a hang (seen once in a full CI run, not reproduced alone) fails here with its traceback.
    async with asyncio.timeout(120):
        await _shares_its_budget(nats_url)


async def _shares_its_budget(nats_url: str) -> None:
    state = EngineState(model=WindowLM(seed=0), weight_version="1")
    with ServedEngine(create_app(state)) as engine:
        bus = await connect(nats_url, name="adm-test")
        pub = await VersionPublisher(bus, POLICY, trainer_id="t").start()
        async with pub.update() as version:
            pass
        other = SharedBudget(bus, POLICY, name="other", lease_s=6.0, skew_s=0.5, grant=3)
        gate = Admission("bounded", current=version, max_staleness=1, batch=BATCH, budget=other)
        config = RolloutConfig(
            router_url=engine.url,
            policy=POLICY,
            nats_url=nats_url,
            group_size=2,
            batch=BATCH,
            in_flight=4,
            max_staleness=1,
            admission_shared=True,
            admission_lease_s=6.0,
            freeze_heap=False,
        )
        rollout = asyncio.create_task(run_rollout(config))
        try:
            async with other:
                held = [gate.try_acquire() for _ in range(3)]
                assert all(held)
                for _ in range(3):
                    reply = await _request(bus, rollout, BatchRequest(size=BATCH, min_version=version))
                    assert reply.error is None and len(reply.groups) == BATCH
                    for group in reply.groups:
                        oldest = min(s.oldest_version for s in group.samples)
                        assert 0 <= reply.judged_at - oldest <= 1
                    async with pub.update() as version:
                        state.weight_version = str(version)
                    gate.notify()
                history = await read_subject_history(bus, subjects.admission(POLICY))
                ledgers = [e.event for e in history.events if isinstance(e.event, AdmissionLedger)]
                assert any(len(ledger.holders) == 2 for ledger in ledgers)
                for ledger in ledgers:
                    assert sum(h.slots for h in ledger.holders.values()) <= ledger.total == 2 * BATCH
                    rollout_slots = [h.slots for k, h in ledger.holders.items() if k != other.holder]
                    assert sum(rollout_slots) <= 2 * BATCH - 3 or other.holder not in ledger.holders
        finally:
            rollout.cancel()
            await asyncio.gather(rollout, return_exceptions=True)
            await bus.aclose()
