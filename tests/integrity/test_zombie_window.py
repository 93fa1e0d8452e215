"""The zombie window, on a real nats-server: a fenced trainer's weights never serve under the owner's number.

A poller samples every engine's label and weights (the reference engine's weights fingerprint) on every
turn of the event loop while a zombie trainer pushes and the owner updates. Every sample that carries a
number must hold the weights the owner announced under that number; the zombie's weights may only ever
be seen under a non-numeric label (``pending:<v>``, ``quarantine:<v>``), judged stale.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from weightbus.bus import NatsBus, subjects
from weightbus.engines.sglang import SGLangClient
from weightbus.errors import EngineOutOfSyncError, FencedError
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.refengine.reference import EngineState
from weightbus.schemas import FleetQuarantined, WeightUpdated, parse_version

from .conftest import Engines, history

pytestmark = pytest.mark.nats

ZOMBIE = "/ckpt/zombie"


class _Poller:
    """Records each engine's ``(label, weights)`` whenever it changes, checking on every loop turn."""

    def __init__(self, states: Mapping[str, EngineState]) -> None:
        self.states = states
        self.seen: list[tuple[str, str, str]] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last: dict[str, tuple[str, str]] = {}
        while True:
            for url, state in self.states.items():
                now = (state.weight_version, state.model.fingerprint)  # type: ignore[attr-defined]
                if last.get(url) != now:
                    last[url] = now
                    self.seen.append((url, *now))
            await asyncio.sleep(0)

    def __enter__(self) -> _Poller:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def violations(self, named: Mapping[int, str]) -> list[tuple[str, str, str]]:
        """Samples whose label is a number the owner did not announce on these weights."""
        return [s for s in self.seen if (v := parse_version(s[1])) is not None and named.get(v) != s[2]]


async def _push(clients: list[SGLangClient], path: str, version: int | None = None) -> None:
    for client in clients:
        await client.update_weights_from_disk(path, weight_version=version)


async def _announced(bus: NatsBus, policy: str) -> list[tuple[int, str]]:
    events = [e.event for e in await history(bus, subjects.weights(policy))]
    return [(e.version, e.trainer_id) for e in events if isinstance(e, WeightUpdated)]


async def test_a_zombie_pushing_after_the_takeover_never_serves_under_the_owners_number(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    clients = [engines.add("e1"), engines.add("e2")]
    zombie = await VersionPublisher(
        nats_bus, policy, trainer_id="cell-0", fleet=EngineFleet(clients), pause="retract"
    ).start()
    async with zombie.update() as version:
        await _push(clients, "/ckpt/1")  # a push that does not carry weight_version
    named = {1: "/ckpt/1"}
    with _Poller(engines.states) as poll:
        z = zombie.update()
        assert await z.__aenter__() == 2  # taken with a read; now the cell is presumed dead and replaced
        owner = await VersionPublisher(
            nats_bus, policy, trainer_id="cell-1", fleet=EngineFleet(clients), pause="retract"
        ).start()
        assert owner.state.version == 1  # 1 is the owner's current number now
        await _push(clients, ZOMBIE)  # the zombie's push lands
        with pytest.raises(FencedError):
            await z.__aexit__(None, None, None)
        async with owner.update() as version:
            assert version == 3
            await _push(clients, "/ckpt/3")
        named[3] = "/ckpt/3"
        await asyncio.sleep(0.01)
    assert poll.violations(named) == []
    zombie_seen = {label for _, label, weights in poll.seen if weights == ZOMBIE}
    # Never a number: its own pending and quarantine labels, then the owner's pending label until its push.
    assert zombie_seen == {"pending:2", "quarantine:2", "pending:3"}
    assert await _announced(nats_bus, policy) == [(1, "cell-0"), (3, "cell-1")]
    alerts = [e.event for e in await history(nats_bus, subjects.alerts(policy))]
    assert any(isinstance(a, FleetQuarantined) and (a.reason, a.version) == ("fenced", 2) for a in alerts)


async def test_a_zombie_that_checks_before_its_push_never_pushes_over_the_owners_update(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    clients = [engines.add("e1"), engines.add("e2")]
    zombie = await VersionPublisher(
        nats_bus, policy, trainer_id="cell-0", fleet=EngineFleet(clients), pause="retract"
    ).start()
    async with zombie.update():
        await _push(clients, "/ckpt/1")
    named = {1: "/ckpt/1"}
    with _Poller(engines.states) as poll:
        z = zombie.update()
        assert await z.__aenter__() == 2
        # While the zombie writes its checkpoint, the owner takes over and finishes a whole update.
        owner = await VersionPublisher(
            nats_bus, policy, trainer_id="cell-1", fleet=EngineFleet(clients), pause="retract"
        ).start()
        async with owner.update() as version:
            assert version == 3
            await _push(clients, "/ckpt/3", version)
        named[3] = "/ckpt/3"
        with pytest.raises(FencedError) as info:
            await z.before_push()  # just before its push: the takeover is seen, nothing is pushed
            await _push(clients, ZOMBIE)
        await z.__aexit__(FencedError, info.value, None)
        await asyncio.sleep(0.01)
    assert poll.violations(named) == []
    assert all(weights != ZOMBIE for _, _, weights in poll.seen)
    for state in engines.states.values():
        assert state.recorded("/update_weights_from_disk")[-1].body["model_path"] == "/ckpt/3"
        assert state.pause_mode is None
    assert await _announced(nats_bus, policy) == [(1, "cell-0"), (3, "cell-1")]
    assert z.quarantined is not None and z.quarantined.reason == "fenced"


async def test_a_zombie_relabel_during_the_owners_push_stops_the_owners_stamp(
    nats_bus: NatsBus, policy: str, engines: Engines
) -> None:
    clients = [engines.add("e1")]
    zombie = await VersionPublisher(
        nats_bus, policy, trainer_id="cell-0", fleet=EngineFleet(clients), pause="retract"
    ).start()
    async with zombie.update():
        await _push(clients, "/ckpt/1")
    z = zombie.update()
    assert await z.__aenter__() == 2
    owner = await VersionPublisher(
        nats_bus, policy, trainer_id="cell-1", fleet=EngineFleet(clients), pause="retract"
    ).start()
    named = {1: "/ckpt/1"}
    with _Poller(engines.states) as poll:
        with pytest.raises(EngineOutOfSyncError, match="pending:3"):
            async with owner.update():
                await _push(clients, "/ckpt/3")
                # The zombie's entry (its take passed just before the claim) relabels late, then it pushes.
                await clients[0].update_weight_version("pending:2", abort_all_requests=False)
                await _push(clients, ZOMBIE)
        with pytest.raises(FencedError):
            await z.__aexit__(None, None, None)
        await asyncio.sleep(0.01)
    assert poll.violations(named) == []
    assert await _announced(nats_bus, policy) == [(1, "cell-0")]
    async with owner.update() as version:
        await _push(clients, "/ckpt/4", version)
    assert engines.states["http://e1"].weight_version == "4"
