"""The shipped roles (ops/nats/auth.conf): the ``rollout`` user may keep the shared admission budget, and a user
that may not publish it is told at ``start`` with ``PermissionDeniedError`` instead of retrying for ever."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bus.test_roles import AUTH_CONF, ENV, PASSWORDS
from weightbus.bus import ConnectOptions, connect, subjects
from weightbus.bus.stream import StreamRequirements, create_or_upgrade
from weightbus.consumers.admission import Admission, SharedBudget
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import PermissionDeniedError
from weightbus.schemas import AdmissionLedger

pytestmark = pytest.mark.nats


async def _create_stream(url: str) -> None:
    admin = await connect(url, options=ConnectOptions(user="admin", password=PASSWORDS["admin"]), ensure_stream=False)
    try:
        await create_or_upgrade(admin.js, "WEIGHTBUS", StreamRequirements(), replicas=1)
    finally:
        await admin.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(config=AUTH_CONF, env=ENV, store_dir=tmp_path / "js") as srv:
        asyncio.run(_create_stream(srv.url))
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
