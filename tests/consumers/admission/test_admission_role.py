"""The shipped roles (ops/nats/auth.conf): the ``rollout`` user may keep the shared admission budget, and a user
that may not publish it is told at ``start`` with ``PermissionDeniedError`` instead of retrying for ever."""

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


async def test_the_rollout_role_keeps_the_budget_and_the_monitor_role_is_refused(server: EmbeddedNats) -> None:
    rollout = await connect(server.url, options=ConnectOptions(user="rollout", password=PASSWORDS["rollout"]))
    monitor = await connect(server.url, options=ConnectOptions(user="monitor", password=PASSWORDS["monitor"]))
    try:
        budget = SharedBudget(rollout, "roles", name="r0", lease_s=3.0, skew_s=0.5)
        gate = Admission("bounded", current=4, max_staleness=1, batch=2, budget=budget)
        async with budget:
            assert gate.try_acquire() is not None
            env = await rollout.last(subjects.admission("roles"))
            assert env is not None and isinstance(env.event, AdmissionLedger)
            assert env.event.holders[budget.holder].slots == 2
        refused = SharedBudget(monitor, "roles", name="m0", lease_s=3.0, skew_s=0.5)
        Admission("bounded", current=4, max_staleness=1, batch=2, budget=refused)
        with pytest.raises(PermissionDeniedError):
            await refused.start()
    finally:
        await rollout.close()
        await monitor.close()
