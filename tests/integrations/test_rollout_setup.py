"""``integrations.host.rollout.RolloutSetup``: what every host's rollout half stands on, and its teardown.

On the memory bus: a given bus is the caller's (never closed); the window's last report is published at close, with
the window detached first; one gate and one budget however often admission is asked for; a setup closed twice, or
started again after its close, follows the policy again. The hosts' own tests (tests/integrations/miles, .../slime)
run it on a real nats-server, and ``test_rollout_connect.py`` its connect settings.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace
from typing import Any

from tests._builders import updated, wait_until
from weightbus.bus import MemoryBus, subjects
from weightbus.integrations.host.drain import staleness_stage
from weightbus.integrations.host.rollout import RolloutSetup
from weightbus.schemas.drains import DrainReport


class SlowReports(MemoryBus):
    """A bus whose drain reports take a while to be stored: a close that does not wait for them loses them."""

    async def publish(self, subject: str, event: Any, **kwargs: Any) -> Any:
        if subject == subjects.drains(getattr(event, "policy", "")):
            await asyncio.sleep(0.2)
        return await super().publish(subject, event, **kwargs)


def _setup(bus: MemoryBus, policy: str, **settings: object) -> RolloutSetup:
    args = Namespace(weightbus_policy=policy, rollout_batch_size=2, **settings)
    return RolloutSetup(args, host="slime", policy=policy, bus=bus)


async def test_a_given_bus_outlives_the_setup_and_the_last_report_is_published_at_close(policy: str) -> None:
    bus = SlowReports()
    setup = _setup(bus, policy)
    window = staleness_stage(Namespace(), max_staleness=1, on_stale="drop").window()
    tracker = await setup.start(window, drain_metrics=None)
    assert setup.tracker is tracker and window.reporter is not None
    assert await setup.start(window, drain_metrics=None) is tracker  # idempotent
    window.finish([])  # one window's report, submitted in the background
    await setup.aclose()
    assert window.reporter is None and setup.tracker is None
    last = await bus.last(subjects.drains(policy))
    assert last is not None and isinstance(last.event, DrainReport)  # published before the close returned
    assert last.event.consumer == setup.consumer
    await setup.aclose()  # idempotent
    event = updated(3, policy=policy)
    await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:3")  # the caller's bus: still open
    again = await setup.start(window, drain_metrics=None)
    assert again is not tracker and window.reporter is not None
    await again.wait_ready(timeout=5)
    await wait_until(lambda: again.current == 3, 5, "the restarted setup to follow")
    await setup.aclose()
    await bus.aclose()


async def test_admission_is_made_once_and_off_is_none(policy: str) -> None:
    bus = MemoryBus()
    setup = _setup(bus, policy, weightbus_admission="bounded")
    window = staleness_stage(Namespace(), max_staleness=1, on_stale="drop").window()
    await setup.start(window, drain_metrics=None)
    checked: list[bool] = []
    gate = await setup.admission(
        version=lambda: 1, default_cap=lambda: 4, max_staleness=1, check=lambda: checked.append(True)
    )
    assert gate is not None and setup.gate is gate and checked == [True]
    assert await setup.admission(version=lambda: 1, default_cap=lambda: 4, max_staleness=1) is gate
    await setup.aclose()
    assert setup.gate is None and setup.budget is None
    off = _setup(bus, policy, weightbus_admission="off")
    await off.start(window, drain_metrics=None)
    refused: list[bool] = []
    gate = await off.admission(
        version=lambda: 1, default_cap=lambda: 4, max_staleness=1, check=lambda: refused.append(True)
    )
    assert gate is None and off.gate is None and refused == []  # off: nothing made, nothing checked
    await off.aclose()
    await bus.aclose()
