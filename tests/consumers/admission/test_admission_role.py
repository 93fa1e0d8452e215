"""The shipped roles (ops/nats/auth.conf): a policy's ``rollout-<policy>`` user may keep that policy's shared
admission budget; a user that may not publish it (the monitor, or the rollout of another policy) is told at
``start`` with ``PermissionDeniedError`` instead of retrying for ever, and stores nothing there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.roles import PASSWORDS, roles_server
from weightbus.bus import ConnectOptions, connect, subjects
from weightbus.consumers.admission import Admission, SharedBudget
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import PermissionDeniedError
from weightbus.schemas import AdmissionLedger

pytestmark = pytest.mark.nats


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with roles_server(tmp_path / "js") as srv:
        yield srv


def _as(user: str) -> ConnectOptions:
    return ConnectOptions(user=user, password=PASSWORDS[user])


async def test_the_rollout_role_keeps_its_policys_budget_and_others_are_refused(server: EmbeddedNats) -> None:
    rollout = await connect(server.url, options=_as("rollout-policy-a"))
    other = await connect(server.url, options=_as("rollout-policy-b"))
    monitor = await connect(server.url, options=_as("monitor"))
    try:
        budget = SharedBudget(rollout, "policy-a", name="r0", lease_s=3.0, skew_s=0.5)
        gate = Admission("bounded", current=4, max_staleness=1, batch=2, budget=budget)
        async with budget:
            assert gate.try_acquire() is not None
            env = await rollout.last(subjects.admission("policy-a"))
            assert env is not None and isinstance(env.event, AdmissionLedger)
            assert env.event.holders[budget.holder].slots == 2
        stored = await rollout.last_seq(subjects.admission("policy-a"))
        for bus, name in ((monitor, "m0"), (other, "b0")):
            refused = SharedBudget(bus, "policy-a", name=name, lease_s=3.0, skew_s=0.5)
            Admission("bounded", current=4, max_staleness=1, batch=2, budget=refused)
            with pytest.raises(PermissionDeniedError) as info:
                await refused.start()
            assert info.value.subject == subjects.admission("policy-a")
        # Nothing the refused users tried is stored: the ledger is still the one the policy's rollout wrote.
        assert await rollout.last_seq(subjects.admission("policy-a")) == stored
        # The other policy's rollout keeps its own policy's budget.
        own = SharedBudget(other, "policy-b", name="b1", lease_s=3.0, skew_s=0.5)
        Admission("bounded", current=4, max_staleness=1, batch=2, budget=own)
        async with own:
            assert await other.last(subjects.admission("policy-b")) is not None
    finally:
        await rollout.aclose()
        await other.aclose()
        await monitor.aclose()
