"""Chaos: many clients whose publishes time out while the nats-server is down do not retry in lock-step.

Eight connections (one per simulated process) each publish one event just after the server is killed by pid; it
stays down for ``OUTAGE_S`` and comes back on the same port and store. Every publish is retried on its schedule
(``weightbus.backoff``: full jitter) until it lands. Checked: each lands exactly once (the same ``Nats-Msg-Id``
on every attempt), and the clients' attempts are spread out: at each retry, the instants at which the clients
sent it differ by far more than the loop's own jitter. Without jitter they all retry within a few milliseconds of
one another, and a server that comes back meets every client's retry at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests._builders import updated
from tests.chaos.conftest import connect_many, report
from weightbus.bus import NatsBus, subjects
from weightbus.embedded.server import EmbeddedNats

pytestmark = [pytest.mark.slow, pytest.mark.nats]

CLIENTS = 8
OUTAGE_S = 2.0  # how long the server stays dead: a scenario parameter, not a readiness wait
PUBLISH_TIMEOUT_S = 0.5
#: The spread below which a retry counts as lock-step: the event loop's own scheduling is a few milliseconds.
LOCKSTEP_S = 0.03


def _spy(bus: NatsBus, sent: list[float]) -> None:
    """Record the loop time of every JetStream publish ``bus`` sends (each attempt of a retried publish)."""
    real = bus.js.publish
    loop = asyncio.get_running_loop()

    async def publish(*args: Any, **kwargs: Any) -> Any:
        sent.append(loop.time())
        return await real(*args, **kwargs)

    bus.js.publish = publish  # type: ignore[method-assign]


async def test_clients_retrying_through_an_outage_do_not_retry_in_lock_step(
    own_server: EmbeddedNats, open_buses: list[NatsBus]
) -> None:
    policy = "chaos-jitter"
    subject = subjects.weights(policy)
    buses = await connect_many(
        own_server.url, CLIENTS, open_buses, publish_timeout=PUBLISH_TIMEOUT_S, publish_attempts=40
    )
    sent: list[list[float]] = [[] for _ in buses]
    for bus, times in zip(buses, sent, strict=True):
        _spy(bus, times)

    async def outage() -> None:
        own_server.kill()  # SIGKILL by pid; the store stays
        await asyncio.sleep(OUTAGE_S)
        await asyncio.to_thread(own_server.start)

    down = asyncio.create_task(outage())
    await asyncio.sleep(0.05)  # the server is dead before the first attempt
    acks = await asyncio.gather(
        *(bus.publish(subject, updated(i + 1, policy=policy), msg_id=f"{policy}:{i}") for i, bus in enumerate(buses))
    )
    await down

    # Each landed once, under its own id, whatever the retries.
    stored = await buses[0].js.stream_info(buses[0].stream, subjects_filter=subject)
    assert stored.state.subjects == {subject: CLIENTS}
    assert len({a.seq for a in acks}) == CLIENTS

    attempts = [len(times) for times in sent]
    assert min(attempts) >= 3, f"the outage did not make every client retry twice: {attempts}"
    spreads = []
    for k in range(1, min(attempts)):  # the k-th retry of every client
        instants = [times[k] for times in sent]
        spreads.append(max(instants) - min(instants))
    report(
        "retry-jitter",
        clients=CLIENTS,
        attempts=attempts,
        spreads_ms=[round(s * 1000) for s in spreads],
    )
    assert all(s > LOCKSTEP_S for s in spreads[1:]), f"retries in lock-step: spreads {spreads} s"
