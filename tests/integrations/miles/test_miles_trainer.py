"""The trainer half of the miles drop-in (``install``), driven by a stand-in of miles' trainer side on a real
nats-server, with reference engines served over HTTP behind Ray-like handles (``miles_trainer_standin``).

Each test asserts from what was recorded: the ``WeightUpdated``/``FleetQuarantined`` events stored on the
bus, what the ``RolloutManager`` was given, the engines' labels and the calls they received, and what
the rollout half (``WeightbusDataBuffer``) kept or refused. The failover test runs once without the
install too, and checks that miles' own counter regresses there (the test can fail).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.abc
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests._builders import wait_until
from tests.integrations.miles.miles_standin import (
    DataBufferConstructorInput,
    DataBufferInput,
    FullyAsyncRolloutFn,
    RolloutFnTrainInput,
    Sample,
    ScriptedDataSource,
    make_args,
    make_group,
)
from tests.integrations.miles.miles_trainer_standin import (
    FSDP_MODULE,
    ActorHandle,
    AdapterRun,
    Cell,
    FakeModel,
    RayTrainGroup,
    RolloutManager,
    SGLangEngine,
    chain_files,
    engines_info,
    install_miles_trainer,
    make_trainer_args,
    ray,
    replay_chain,
    write_fsdp_package,
)
from weightbus.bus import NatsBus, subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.nats import connect
from weightbus.consumers import VersionTracker
from weightbus.embedded.server import EmbeddedNats, free_port
from weightbus.errors import BusConnectError, BusError, FencedError, InstallError
from weightbus.integrations.host.engines import engine_name
from weightbus.integrations.miles import MILES_COMMIT, WeightbusDataBuffer, install, install_fsdp, uninstall
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import EngineOutOfSync, FleetQuarantined, PublisherClaimed, WeightUpdated

pytestmark = pytest.mark.nats


class RefEngines:
    """Reference engines over real HTTP, each behind a stand-in ``SGLangEngine`` actor handle."""

    def __init__(self, n: int, delta_dir: Path) -> None:
        self.delta_dir = delta_dir  # the shared filesystem of the disk delta (--update-weight-disk-dir)
        self.states = [EngineState() for _ in range(n)]
        self.servers = [ServedEngine(create_app(s)).start() for s in self.states]
        self.actors = [SGLangEngine(s.url, delta_dir=delta_dir) for s in self.servers]
        self.handles = [ActorHandle(a) for a in self.actors]

    def labels(self) -> list[str]:
        return [s.weight_version for s in self.states]

    def restart(self, i: int) -> None:
        """Engine ``i`` comes back from a restart: boot weights, no adapter, ``"default"``, a new actor."""
        self.states[i].weight_version = "default"
        self.states[i].lora_adapters.clear()
        self.handles[i].kill()
        self.actors[i].close()
        self.actors[i] = SGLangEngine(self.servers[i].url, delta_dir=self.delta_dir)
        self.handles[i] = ActorHandle(self.actors[i])

    def close(self) -> None:
        for h in self.handles:
            h.kill()
        for a in self.actors:
            a.close()
        for s in self.servers:
            s.stop()


@pytest.fixture
def ref_engines(tmp_path: Path) -> Iterator[RefEngines]:
    engines = RefEngines(2, tmp_path / "delta")
    yield engines
    engines.close()


@pytest.fixture
def miles_env(nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The two variables a miles user sets for both halves."""
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_READY_TIMEOUT", "2")
    monkeypatch.setenv("WEIGHTBUS_UPDATE_TIMEOUT", "3")
    return policy


@pytest.fixture
def standin() -> Iterator[dict[str, Any]]:
    with install_miles_trainer() as modules:
        try:
            yield modules
        finally:
            uninstall()


async def weight_events(bus: NatsBus, policy: str) -> list[Any]:
    history = await read_subject_history(bus, subjects.weights(policy))
    return [e.event for e in history.events]


async def announced(bus: NatsBus, policy: str) -> list[int]:
    return [e.version for e in await weight_events(bus, policy) if isinstance(e, WeightUpdated)]


async def alerts(bus: NatsBus, policy: str) -> list[Any]:
    history = await read_subject_history(bus, subjects.alerts(policy))
    return [e.event for e in history.events]


def run(fn: Any, *args: Any) -> Any:
    return asyncio.to_thread(fn, *args)


def watch_resumes(engines: RefEngines, bus: NatsBus, policy: str) -> list[tuple[str, int | None]]:
    """Record, at every resume of every engine, its label and the newest version on the bus then."""
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, int | None]] = []

    def check(state: EngineState) -> None:
        versions = asyncio.run_coroutine_threadsafe(announced(bus, policy), loop).result(10)
        seen.append((state.weight_version, max(versions, default=None)))

    for actor, state in zip(engines.actors, engines.states, strict=True):
        actor.on_continue = lambda state=state: check(state)
    return seen


def assert_announced_before_resumed(seen: list[tuple[str, int | None]]) -> None:
    """No engine resumed carrying a number the bus had not announced yet."""
    assert seen
    for label, newest in seen:
        if label.isdigit():
            assert newest is not None and int(label) <= newest, (label, newest)


# -- failover, fencing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_weightbus", [True, False], ids=["installed", "miles-alone"])
async def test_a_failover_publishes_above_the_first_cell_and_nothing_is_admitted_on_negative_staleness(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines, with_weightbus: bool
) -> None:
    hook = "weightbus.integrations.miles.install" if with_weightbus else None
    args = make_trainer_args(custom_megatron_init_path=hook)
    manager = RolloutManager(args)
    rm = ActorHandle(manager)
    cells = [Cell(args, rm, world_size=2), Cell(args, rm, world_size=2)]
    group = RayTrainGroup(cells)
    info = engines_info(ref_engines.handles, new=True)
    resumes = watch_resumes(ref_engines, nats_bus, miles_env)
    for _ in range(3):
        await run(group.update_weights, info)
    cells[0].alive = False  # cell 0 dies; cell 1's updater, whose own counter is 0, runs the next update
    await run(group.update_weights, info)

    if not with_weightbus:  # what the change request found: 3 -> 1, and the engines say "1" again
        assert manager.versions == [1, 2, 3, 1] and manager.regressions == [(3, 1)]
        assert ref_engines.labels() == ["1", "1"]
        return
    assert_announced_before_resumed(resumes)
    # Above the first cell's last number, and above the 4 its last announcement reserved ahead (which a
    # takeover skips: cell 0 may have pushed under it).
    assert manager.versions == [1, 2, 3, 5] and manager.regressions == []
    assert [a.weight_updater.weight_version for a in cells[1].actors] == [5, 5]  # every rank of the cell
    assert cells[1].world.broadcasts == 1  # rank 0 handed the number to the cell once
    assert ref_engines.labels() == ["5", "5"]
    assert await announced(nats_bus, miles_env) == [1, 2, 3, 5]
    events = [e for e in await weight_events(nats_bus, miles_env) if isinstance(e, WeightUpdated)]
    assert len({e.incarnation for e in events[:3]}) == 1 and events[3].incarnation != events[0].incarnation

    # The rollout side: a group cell 0 produced at 3 and one cell 1 produced at 4, judged with bound 0.
    unused: list[Any] = []
    buffer = WeightbusDataBuffer(
        DataBufferConstructorInput(args=make_args(max_weight_staleness=0), unused_handler_fn=unused.append),
        bus=nats_bus,
    )
    try:
        old, new = make_group(1, ["3"]), make_group(2, ["5"])
        await buffer.put(DataBufferInput(prompt_group=old, group=old))
        await buffer.put(DataBufferInput(prompt_group=new, group=new))
        taken = await buffer.get(current_version=manager.weight_version)
        metrics = buffer.get_metrics()
    finally:
        await buffer.aclose()
    assert taken.group is new and unused == [old]
    assert metrics["rollout/fully_async/max_staleness"] == 2 and metrics["rollout/fully_async/avg_staleness"] >= 0


async def test_the_first_cell_coming_back_is_fenced(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    args = make_trainer_args()
    manager = RolloutManager(args)
    rm = ActorHandle(manager)
    cells = [Cell(args, rm), Cell(args, rm)]
    group = RayTrainGroup(cells)
    info = engines_info(ref_engines.handles, new=True)
    await run(group.update_weights, info)
    cells[0].alive = False
    await run(group.update_weights, info)
    assert ref_engines.labels() == ["3", "3"]  # 2 was reserved by cell 0's announcement: skipped
    pushes = [len(a.calls) for a in ref_engines.actors]

    # The zombie: cell 0 runs an update again (a network partition heals, a stale driver retries).
    for _ in range(2):
        with pytest.raises(FencedError):
            await run(cells[0].update_weights, info)
        assert [len(a.calls) for a in ref_engines.actors] == pushes  # it never touched an engine
    assert ref_engines.labels() == ["3", "3"]
    assert await announced(nats_bus, miles_env) == [1, 3]
    assert manager.versions == [1, 3]
    # and the owner goes on
    await run(group.update_weights, info)
    assert manager.versions == [1, 3, 4] and ref_engines.labels() == ["4", "4"]


# -- failover ping-pong: miles picks a cell again ----------------------------------------------------------


async def _tracked(nats_url: str, policy: str) -> tuple[Any, list[Any], NatsBus]:
    """A ``VersionTracker`` of its own connection, recording every change it makes."""
    bus = await connect(nats_url, connect_timeout=5)
    changes: list[Any] = []
    tracker = VersionTracker(bus, policy, registry=CollectorRegistry(), on_change=changes.append)
    await tracker.__aenter__()
    return tracker, changes, bus


def _claims(events: list[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, PublisherClaimed)]


@pytest.mark.parametrize("with_weightbus", [True, False], ids=["installed", "miles-alone"])
@pytest.mark.parametrize("mode", ["broadcast", "p2p"])
async def test_a_failover_ping_pong_through_miles_alive_cell_choice_keeps_the_job_and_the_versions_rising(
    nats_bus: NatsBus,
    nats_url: str,
    miles_env: str,
    standin: dict[str, Any],
    ref_engines: RefEngines,
    mode: str,
    with_weightbus: bool,
) -> None:
    hook = "weightbus.integrations.miles.install" if with_weightbus else None
    args = make_trainer_args(update_weight_transfer_mode=mode, custom_megatron_init_path=hook)
    manager = RolloutManager(args)
    rm = ActorHandle(manager)
    cells = [Cell(args, rm, world_size=2), Cell(args, rm, world_size=2)]
    group = RayTrainGroup(cells)
    info = engines_info(ref_engines.handles, new=True)
    tracker, changes, tracker_bus = await _tracked(nats_url, miles_env)

    def crash_mid_push(i: int) -> None:
        if i == 1:
            raise RuntimeError("NCCL error: unhandled system error (cell 0 lost its node)")

    async def step(rollout: int) -> None:
        await run(group.train, rollout)
        await run(group.update_weights, info)

    try:
        await step(0)  # cell 0 (quorum 0, alive rank 0)
        cells[0].crash("update_weights")  # cell 0 dies in the update: miles' retry picks cell 1 at once
        await step(1)  # cell 1 (quorum 0, alive rank 1)
        group.start_cell(0)  # miles heals cell 0 (new actors) at the next train: quorum 1, alive [0, 1]
        await step(2)  # cell 0 again, a new incarnation
        cells[0].crash("train")  # cell 0 dies in training; cell 1 trained, so miles does not retry
        await run(group.train, 3)
        await step(4)  # the refresh makes quorum 2, alive [1]: cell 1, picked again, at alive rank 0
        group.start_cell(0)
        await run(group.train, 5)  # quorum 3, alive [0, 1]
        cells[0].actors[0].model.on_bucket = crash_mid_push  # this time cell 0 dies halfway through its push
        await run(group.update_weights, info)  # cell 0 fails; the retry picks cell 1 (quorum 3, alive rank 1)
        await step(6)  # cell 1 again
        if with_weightbus:  # miles alone announces nothing
            await wait_until(
                lambda: any(c.version == manager.versions[-1] for c in changes),
                10,
                "the tracker to see the last version",
            )
    finally:
        await tracker.__aexit__(None, None, None)
        await tracker_bus.aclose()

    # miles' own choice, the same with and without weightbus: the job survived the ping-pong.
    picked = [cell for name, cell in group.attempts if name == "update_weights"]
    assert picked == [0, 0, 1, 0, 1, 0, 1, 1]
    assert [c.state for c in cells] == ["stopped", "alive"] and group.quorum_id == 4
    if not with_weightbus:  # miles alone: each incarnation's own counter; a healed cell starts at 1 again
        assert manager.versions == [1, 1, 1, 2, 3, 4]
        return

    versions = list(manager.versions)
    assert versions == sorted(set(versions)) and manager.regressions == []
    assert versions == await announced(nats_bus, miles_env)
    assert ref_engines.labels() == [str(versions[-1])] * 2
    # What a tracker on the real nats-server saw: the version never went back, nothing was held or rejected.
    moved = [c.version for c in changes if c.action.value in ("adopted", "advanced")]
    assert moved == versions  # every announcement, in order, strictly rising
    assert all(c.action.value != "held" and c.reason is None for c in changes), changes
    # Every claim names where miles put its cell; each re-claim outranks the owner it fenced.
    claims = _claims(await weight_events(nats_bus, miles_env))
    standings = [(c.standing.term, c.standing.rank) if c.standing else None for c in claims]
    assert standings == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (3, 1)]
    assert [c.epoch for c in claims] == sorted({c.epoch for c in claims})
    assert len({c.incarnation for c in claims}) == len(claims)  # each claim is a new publisher instance
    floor = 0  # a claim resumes above every number issued before it: none is reused, none goes back
    for event in await weight_events(nats_bus, miles_env):
        if isinstance(event, PublisherClaimed):
            assert (event.reserved or 0) >= floor
            floor = event.reserved or 0
        elif isinstance(event, WeightUpdated):
            assert event.version > floor
            floor = event.version

    # Every stopped incarnation of cell 0 is a zombie miles no longer calls: all stay fenced and touch nothing.
    calls = [len(a.calls) for a in ref_engines.actors]
    for incarnation in range(len(cells[0].stale)):
        with pytest.raises(FencedError):
            await run(functools.partial(cells[0].run_stale, "update_weights", info, incarnation=incarnation))
    assert [len(a.calls) for a in ref_engines.actors] == calls  # not even a pause
    assert await announced(nats_bus, miles_env) == versions and ref_engines.labels() == [str(versions[-1])] * 2
    assert len(_claims(await weight_events(nats_bus, miles_env))) == len(claims)  # no zombie re-claimed
    # and the owner goes on
    await run(group.update_weights, info)
    assert manager.versions[-1] > versions[-1] and manager.regressions == []


async def test_a_cell_of_another_miles_job_stays_fenced_whatever_its_quorum(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    args = make_trainer_args()
    rm = ActorHandle(RolloutManager(args))
    info = engines_info(ref_engines.handles, new=True)
    old = RayTrainGroup([Cell(args, rm, job_id="01000000"), Cell(args, rm, job_id="01000000")])
    await run(old.update_weights, info)
    old.cells[0].crash("update_weights")
    await run(old.update_weights, info)  # the old job's cell 1 claimed (quorum 0, alive rank 1)
    new = RayTrainGroup([Cell(args, rm, job_id="02000000")])  # a new driver: a new Ray job, quorum 0 again
    await run(new.update_weights, info)
    owner = await announced(nats_bus, miles_env)
    # The old driver goes on (nobody stopped it): its group moves to a higher quorum than the new job's.
    await run(old.train, 1)
    assert old.quorum_id == 1
    calls = [len(a.calls) for a in ref_engines.actors]
    with pytest.raises(AssertionError, match="No alive cells"):
        await run(old.update_weights, info)  # the old job's cell 1: fenced for good; miles gives up on it
    assert [len(a.calls) for a in ref_engines.actors] == calls  # it touched no engine
    assert await announced(nats_bus, miles_env) == owner
    await run(new.update_weights, info)
    assert await announced(nats_bus, miles_env) == [*owner, owner[-1] + 1]


# -- a failed push ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["broadcast", "p2p", "tensor"])
async def test_a_push_that_fails_halfway_leaves_the_engines_quarantined(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines, mode: str
) -> None:
    args = make_trainer_args(update_weight_transfer_mode=mode)
    manager = RolloutManager(args)
    cell = Cell(args, ActorHandle(manager), world_size=2)
    info = engines_info(ref_engines.handles, new=True)
    await run(cell.update_weights, info)
    assert ref_engines.labels() == ["1", "1"]

    def fail_second_bucket(i: int) -> None:
        ref_engines.states[1].fail_weight_updates = "CUDA error: an illegal memory access" if i == 1 else None

    cell.actors[0].model.on_bucket = fail_second_bucket
    with pytest.raises(Exception, match="illegal memory access"):
        await run(cell.update_weights, info)
    assert ref_engines.labels() == ["quarantine:2", "quarantine:2"]  # not on a number, not even engine 0
    assert all(s.pause_mode is None for s in ref_engines.states)  # resumed: their samples are refused, not lost
    assert await announced(nats_bus, miles_env) == [1]
    quarantined = [a for a in await alerts(nats_bus, miles_env) if isinstance(a, FleetQuarantined)]
    assert [(q.version, q.label, q.reason) for q in quarantined] == [(2, "quarantine:2", "update_failed")]
    assert manager.versions == [1]

    ref_engines.states[1].fail_weight_updates = None
    cell.actors[0].model.on_bucket = None
    await run(cell.update_weights, info)
    assert manager.versions == [1, 3] and ref_engines.labels() == ["3", "3"]  # 2 stays used up
    assert await announced(nats_bus, miles_env) == [1, 3]


# -- LoRA on every path ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["broadcast", "tensor", "multi-lora"])  # miles refuses LoRA on p2p (p2p.py:65)
async def test_lora_pushes_on_each_path_are_stamped(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines, mode: str
) -> None:
    transfer = "broadcast" if mode == "multi-lora" else mode
    args = make_trainer_args(update_weight_transfer_mode=transfer, lora_rank=8, multi_lora=mode == "multi-lora")
    manager = RolloutManager(args)
    cell = Cell(args, ActorHandle(manager))
    if mode == "multi-lora":  # miles' actor sets them before each update; the controller gave them slots
        cell.updater.multi_lora_adapters = {"math": AdapterRun("math", slot=0), "code": AdapterRun("code", slot=1)}
    info = engines_info(ref_engines.handles, new=True)
    resumes = watch_resumes(ref_engines, nats_bus, miles_env)
    for _ in range(2):
        await run(cell.update_weights, info)
    assert_announced_before_resumed(resumes)
    assert ref_engines.labels() == ["2", "2"]  # miles' tensor path would leave "default"
    assert manager.versions == [1, 2]
    events = [e for e in await weight_events(nats_bus, miles_env) if isinstance(e, WeightUpdated)]
    assert [e.version for e in events] == [1, 2]
    # Announced: what the engines serve (a client sends it as lora_path), with miles' own name for each.
    expected = {"__miles_slot_0": "math", "__miles_slot_1": "code"} if mode == "multi-lora" else {"miles_lora": None}
    for event in events:
        assert event.lora is not None
        assert {a.name: a.trainer_name for a in event.lora.adapters()} == expected
    for state in ref_engines.states:
        assert set(state.lora_adapters) == set(expected)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
async def test_an_engine_restarted_to_default_is_alerted_and_stamped_only_when_the_push_covers_it(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines, lora: bool
) -> None:
    args = make_trainer_args(lora_rank=8 if lora else 0)
    manager = RolloutManager(args)
    cell = Cell(args, ActorHandle(manager))
    await run(cell.update_weights, engines_info(ref_engines.handles, new=True))
    ref_engines.restart(1)  # miles reconnects it (has_new_engines) at the next update
    info = engines_info(ref_engines.handles, new=True)
    restarted = engine_name(ref_engines.handles[1], 1, "miles")
    if lora:  # miles unloads the adapter it loaded before, and the restarted engine has none: the push fails
        with pytest.raises(Exception, match="is not loaded"):
            await run(cell.update_weights, info)
        assert ref_engines.labels() == ["quarantine:2", "quarantine:2"]  # never "2" on an unknown base
        assert manager.versions == [1] and await announced(nats_bus, miles_env) == [1]
    else:  # the whole model reached it: stamped with the others
        await run(cell.update_weights, info)
        assert ref_engines.labels() == ["2", "2"] and manager.versions == [1, 2]
    found = await alerts(nats_bus, miles_env)
    reasons = {(a.engine, a.actual, a.reason) for a in found if isinstance(a, EngineOutOfSync)}
    assert (restarted, "default", "unexpected_label") in reasons  # never silently re-stamped


# -- disk delta ---------------------------------------------------------------------------------------------


async def test_disk_delta_keeps_its_file_chain_and_labels_the_bus_number_across_a_failover(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    args = make_trainer_args(
        update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(ref_engines.delta_dir)
    )
    manager = RolloutManager(args)
    rm = ActorHandle(manager)
    cells = [Cell(args, rm), Cell(args, rm)]
    group = RayTrainGroup(cells)
    info = engines_info(ref_engines.handles, new=True)
    for _ in range(3):  # the baseline, then two deltas
        await run(group.update_weights, info)
    cells[0].alive = False
    for _ in range(2):  # cell 1's baseline, then its first delta
        await run(group.update_weights, info)
    assert manager.versions == [0, 1, 2, 2, 4] and manager.regressions == []  # 3: reserved ahead by cell 0
    assert ref_engines.labels() == ["4", "4"]
    assert await announced(nats_bus, miles_env) == [1, 2, 4]
    # miles' own count still numbers the chain the engines pull (a bus number there would break it)
    assert ref_engines.actors[0].pulls == [0, 1, 2, 0, 1]
    loads = [kw for name, kw in ref_engines.actors[0].calls if name == "update_weights_from_disk"]
    assert all(kw["weight_version"] is None for kw in loads)  # weightbus stamps the bus's number


async def test_a_disk_delta_zombie_writes_nothing_to_the_chain_and_pulls_nothing_on_the_owners_engines(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    args = make_trainer_args(
        update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(ref_engines.delta_dir)
    )
    manager = RolloutManager(args)
    rm = ActorHandle(manager)
    cells = [Cell(args, rm, world_size=2), Cell(args, rm, world_size=2)]
    group = RayTrainGroup(cells)
    info = engines_info(ref_engines.handles, new=True)
    for _ in range(2):  # cell 0: the baseline, then its weight_v000001
        await run(group.update_weights, info)
    cells[0].alive = False
    for _ in range(3):  # cell 1: its baseline (a clean dir), then its own weight_v000001 and weight_v000002
        await run(group.update_weights, info)
    files = chain_files(ref_engines.delta_dir)
    assert "weight_v000002/model.safetensors.index.json" in files and "weight_v000003" not in str(list(files))
    assert replay_chain(ref_engines.delta_dir, 2).digest() == ref_engines.actors[0].local.digest()
    calls = [list(a.calls) for a in ref_engines.actors]
    labels, versions = ref_engines.labels(), await announced(nats_bus, miles_env)

    # The zombie: cell 0 (its own chain at 1) runs an update again. miles alone would write its
    # weight_v000002 over the owner's, from both ranks, and have the owner's engines pull it.
    for _ in range(2):
        with pytest.raises(FencedError):
            await run(cells[0].update_weights, info)
    assert chain_files(ref_engines.delta_dir) == files  # byte for byte: no shard, no index, no tmp file
    replay_chain(ref_engines.delta_dir, 2)  # a host replaying the owner's chain still verifies every tensor
    assert [a.calls for a in ref_engines.actors] == calls  # no pull_weights, no pause: nothing reached them
    assert ref_engines.labels() == labels and await announced(nats_bus, miles_env) == versions

    await run(group.update_weights, info)  # the owner goes on; a host joining now replays its whole chain
    replayed = replay_chain(ref_engines.delta_dir, 3).digest()
    assert [a.local.digest() for a in ref_engines.actors] == [replayed, replayed]
    assert ref_engines.labels() == [str(manager.versions[-1])] * 2 and manager.regressions == []


@pytest.mark.parametrize("with_weightbus", [True, False], ids=["installed", "miles-alone"])
async def test_a_disk_delta_cell_miles_picks_again_claims_again_before_miles_writes_its_files(
    nats_bus: NatsBus,
    nats_url: str,
    miles_env: str,
    standin: dict[str, Any],
    ref_engines: RefEngines,
    with_weightbus: bool,
) -> None:
    """The ping-pong on the disk delta: the fence check before miles writes a file takes the same decision.

    A fenced cell that miles picks again must get past the disk delta's first check (before miles
    writes a file), not only the take at the pause: there it claims again, fencing the cell that
    took the counter, and its chain goes on. A healed cell 0 claims at its baseline, then dies
    before miles touched the delta dir (its node is gone), so cell 1's own chain is still the one the
    engines pull: miles alone survives this, and so must the install.
    """
    hook = "weightbus.integrations.miles.install" if with_weightbus else None
    args = make_trainer_args(
        update_weight_transfer_mode="disk-delta",
        update_weight_disk_dir=str(ref_engines.delta_dir),
        custom_megatron_init_path=hook,
    )
    manager = RolloutManager(args)
    rm = ActorHandle(manager)
    cells = [Cell(args, rm, world_size=2), Cell(args, rm, world_size=2)]
    group = RayTrainGroup(cells)
    info = engines_info(ref_engines.handles, new=True)
    tracker, changes, tracker_bus = await _tracked(nats_url, miles_env)

    def node_lost() -> None:
        raise RuntimeError("cell 0 lost its node during the disk-delta baseline")

    try:
        for _ in range(2):  # cell 0 (quorum 0, alive rank 0): the baseline, then its weight_v000001
            await run(group.update_weights, info)
        cells[0].crash("update_weights")  # miles' retry picks cell 1 (quorum 0, alive rank 1): its baseline
        await run(group.update_weights, info)
        await run(group.update_weights, info)  # cell 1's weight_v000001
        group.start_cell(0)
        await run(group.train, 1)  # quorum 1, alive [0, 1]: cell 0 healed (new actors)
        # The healed cell's rank 0 claims at its baseline, then dies before miles' rmtree (rank 1 then
        # fails at miles' barrier): miles' retry moves to cell 1 with the delta dir untouched.
        cells[0].actors[0].weight_updater._capture_baseline = node_lost
        calls = [len(a.calls) for a in ref_engines.actors]
        files = chain_files(ref_engines.delta_dir)
        await run(group.update_weights, info)  # cell 0 fails; the retry picks cell 1 (quorum 1, alive rank 1)
        # cell 1 claimed again at the check before miles wrote its files, then wrote and pulled them
        assert all(len(a.calls) > n for a, n in zip(ref_engines.actors, calls, strict=True))
        assert chain_files(ref_engines.delta_dir) != files
        await run(group.update_weights, info)  # cell 1 again
        if with_weightbus:  # miles alone announces nothing
            await wait_until(
                lambda: any(c.version == manager.versions[-1] for c in changes),
                10,
                "the tracker to see the last version",
            )
    finally:
        await tracker.__aexit__(None, None, None)
        await tracker_bus.aclose()

    picked = [cell for name, cell in group.attempts if name == "update_weights"]
    assert picked == [0, 0, 0, 1, 1, 0, 1, 1]  # the job survived: miles' own choice, with and without
    assert [c.state for c in cells] == ["stopped", "alive"]
    head = cells[1].updater.pushed_versions[-1]  # miles' own count names the files
    assert cells[1].updater.pushed_versions == [1, 2, 3]  # cell 1's chain: weight_v000001..3, all its own
    replayed = replay_chain(ref_engines.delta_dir, head).digest()
    assert [a.local.digest() for a in ref_engines.actors] == [replayed, replayed]
    if not with_weightbus:
        return
    versions = list(manager.versions)
    assert manager.regressions == [] and versions == sorted(versions)
    bus_versions = await announced(nats_bus, miles_env)
    assert bus_versions == sorted(set(bus_versions)) and versions[-1] == bus_versions[-1]
    assert ref_engines.labels() == [str(versions[-1])] * 2
    moved = [c.version for c in changes if c.action.value in ("adopted", "advanced")]
    assert moved == bus_versions
    assert all(c.action.value != "held" and c.reason is None for c in changes), changes
    claims = _claims(await weight_events(nats_bus, miles_env))
    standings = [(c.standing.term, c.standing.rank) if c.standing else None for c in claims]
    assert standings == [(0, 0), (0, 1), (1, 0), (1, 1)]  # the last one: cell 1 claimed again over cell 0's
    assert len({c.incarnation for c in claims}) == len(claims)

    # Both stopped incarnations of cell 0 are zombies miles no longer calls; the second one claimed but
    # never captured its baseline, so running it again would clear the shared delta dir: fenced first.
    del cells[0].stale[-1][0].weight_updater._capture_baseline  # its node is back (cut off from Ray only)
    files, calls = chain_files(ref_engines.delta_dir), [list(a.calls) for a in ref_engines.actors]
    for incarnation in range(len(cells[0].stale)):
        with pytest.raises(FencedError):
            await run(functools.partial(cells[0].run_stale, "update_weights", info, incarnation=incarnation))
    assert chain_files(ref_engines.delta_dir) == files  # byte for byte
    assert [a.calls for a in ref_engines.actors] == calls  # no pull, no pause
    assert len(_claims(await weight_events(nats_bus, miles_env))) == len(claims)


async def test_a_disk_delta_stamps_an_engine_restarted_to_default_at_the_next_update(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    args = make_trainer_args(
        update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(ref_engines.delta_dir)
    )
    manager = RolloutManager(args)
    cell = Cell(args, ActorHandle(manager))
    for _ in range(2):  # the baseline, then weight_v000001
        await run(cell.update_weights, engines_info(ref_engines.handles, new=True))
    local = ref_engines.actors[1].local
    ref_engines.restart(1)  # the same host: its local checkpoint survives the engine
    ref_engines.actors[1].local = local
    await run(cell.update_weights, engines_info(ref_engines.handles, new=True))
    # the reload is of the whole local checkpoint the pull brought to weight_v000002: stamped with the other
    assert ref_engines.labels() == ["2", "2"] and manager.versions == [0, 1, 2]
    replayed = replay_chain(ref_engines.delta_dir, 2).digest()
    assert [a.local.digest() for a in ref_engines.actors] == [replayed, replayed]


# -- miles' own checks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["broadcast", "p2p", "disk-delta", "tensor"])
async def test_miles_ci_test_read_back_passes_with_the_install_on_every_path_across_a_failover(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines, mode: str
) -> None:
    # --ci-test turns on --check-weight-update-equal (arguments.py:3254-3260); the actor then compares
    # the engines' label with its updater's counter after every update, on every rank.
    args = make_trainer_args(
        update_weight_transfer_mode=mode,
        ci_test=True,
        check_weight_update_equal=True,
        update_weight_disk_dir=str(ref_engines.delta_dir),
    )
    manager = RolloutManager(args)
    rm = ActorHandle(manager)
    cells = [Cell(args, rm, world_size=2), Cell(args, rm, world_size=2)]
    group = RayTrainGroup(cells)
    info = engines_info(ref_engines.handles, new=True)
    for _ in range(3):
        await run(group.update_weights, info)
    cells[0].alive = False
    for _ in range(3):
        await run(group.update_weights, info)
    assert manager.regressions == [] and manager.versions == sorted(manager.versions)
    assert ref_engines.labels() == [str(manager.versions[-1])] * 2
    assert set(manager.versions) - {0} <= set(await announced(nats_bus, miles_env))
    if mode == "disk-delta":
        # the run's first baseline reloads the boot checkpoint under miles' "0" (the pre-training
        # baseline); the takeover's baseline leaves the engines on the announced weights
        assert manager.versions[:4] == [0, 1, 2, 2]


# -- the rollout side restarted ---------------------------------------------------------------------------------


async def test_a_restarted_rollout_manager_buffer_judges_against_the_bus_version_at_once(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    args = make_trainer_args()
    cell = Cell(args, ActorHandle(RolloutManager(args)))
    info = engines_info(ref_engines.handles, new=True)
    for _ in range(3):
        await run(cell.update_weights, info)
    # A new RolloutManager: miles' version starts at None; its buffer is new, its first group labelled 1.
    restarted = RolloutManager(args)
    unused: list[Any] = []
    buffer = WeightbusDataBuffer(
        DataBufferConstructorInput(args=make_args(max_weight_staleness=1), unused_handler_fn=unused.append)
    )
    try:
        stale, fresh = make_group(1, ["1"]), make_group(2, ["3"])
        await buffer.put(DataBufferInput(prompt_group=stale, group=stale))
        await buffer.put(DataBufferInput(prompt_group=fresh, group=fresh))
        taken = await buffer.get(current_version=restarted.weight_version)
        metrics = buffer.get_metrics()
    finally:
        await buffer.aclose()
    assert taken.group is fresh and unused == [stale]
    assert metrics["weightbus/current_version"] == 3


# -- installing -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        ({"mixin": "DistBucketedWeightUpdateMixin._finalize_and_resume_engines"}, "_finalize_and_resume_engines(self)"),
        ({"delta": "UpdateWeightFromDiskDelta"}, "class miles.backends.megatron_utils.update_weight."),
        ({"tensor": "dist"}, "the global dist (torch.distributed) has no get_rank()"),
    ],
    ids=["method", "class", "global"],
)
def test_install_against_a_miles_that_lacks_what_it_patches_fails_clearly_and_patches_nothing(
    miles_env: str, drop: dict[str, str], expected: str
) -> None:
    with install_miles_trainer(drop=drop) as modules:
        mixin = modules["mixin"].DistBucketedWeightUpdateMixin
        before = vars(mixin)["update_weights"]
        with pytest.raises(InstallError) as caught:
            install(make_trainer_args())
        assert expected in str(caught.value)
        assert MILES_COMMIT[:9] in str(caught.value) and "nothing was patched" in str(caught.value)
        assert vars(mixin)["update_weights"] is before  # not half-installed
        uninstall()


class _DeltaNeedsZstandard(importlib.abc.MetaPathFinder):
    """miles' disk-delta module in an image without its dependency (``zstandard``)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.endswith("update_weight_from_distributed.delta"):
            raise ModuleNotFoundError("No module named 'zstandard'", name="zstandard")
        return None


def test_an_updater_miles_cannot_import_either_is_skipped_but_a_missing_module_is_an_error(
    miles_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with install_miles_trainer() as modules:
        delta = modules["delta"].__name__
        monkeypatch.delitem(sys.modules, delta)
        finder = _DeltaNeedsZstandard()
        sys.meta_path.insert(0, finder)
        try:
            install(make_trainer_args())  # miles imports the delta only for --update-weight-transfer-mode disk-delta
            mixin = modules["mixin"].DistBucketedWeightUpdateMixin
            assert hasattr(vars(mixin)["update_weights"], "__weightbus_original__")
            uninstall()
        finally:
            sys.meta_path.remove(finder)
        monkeypatch.setitem(sys.modules, modules["tensor"].__name__, None)  # the module itself is gone
        with pytest.raises(
            InstallError, match="update_weight_from_tensor .for UpdateWeightFromTensor. cannot be imported"
        ):
            install(make_trainer_args())
        uninstall()


def test_install_against_another_signature_fails_clearly(miles_env: str) -> None:
    def update_weights(self: Any, *, force: bool = False) -> None: ...

    with install_miles_trainer(replace={"tensor:UpdateWeightFromTensor.update_weights": update_weights}):
        expected = r"UpdateWeightFromTensor.update_weights has the signature \(self, force\)"
        with pytest.raises(InstallError, match=expected):
            install(make_trainer_args())
        uninstall()


def test_a_bus_that_is_down_at_init_is_a_clear_error_within_the_connect_timeout(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTBUS_NATS", f"nats://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_CONNECT_TIMEOUT", "1")
    with install_miles_trainer() as modules:
        before = vars(modules["mixin"].DistBucketedWeightUpdateMixin)["update_weights"]
        started = time.monotonic()
        with pytest.raises(BusConnectError):
            install(make_trainer_args())
        assert time.monotonic() - started < 5
        assert vars(modules["mixin"].DistBucketedWeightUpdateMixin)["update_weights"] is before
        uninstall()


@pytest.mark.usefixtures("quick_outage_timeouts")
async def test_a_bus_that_goes_down_mid_run_fails_the_update_within_the_bound_and_pushes_nothing(
    policy: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    server = EmbeddedNats(store_dir=str(tmp_path / "js")).start()
    try:
        monkeypatch.setenv("WEIGHTBUS_NATS", server.url)
        monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
        monkeypatch.setenv("WEIGHTBUS_UPDATE_TIMEOUT", "2")
        args = make_trainer_args()
        manager = RolloutManager(args)
        cell = Cell(args, ActorHandle(manager))
        info = engines_info(ref_engines.handles, new=True)
        await run(cell.update_weights, info)
        server.stop()
        pushes = [sum(n == "update_weights_from_distributed" for n in a.names()) for a in ref_engines.actors]
        started = time.monotonic()
        with pytest.raises(BusError):
            await run(cell.update_weights, info)
        assert time.monotonic() - started < 2 + 30  # the bound, plus one publish's own timeouts
        assert [sum(n == "update_weights_from_distributed" for n in a.names()) for a in ref_engines.actors] == pushes
        assert ref_engines.labels() == ["1", "1"] and manager.versions == [1]
        assert all(s.pause_mode is None for s in ref_engines.states)
    finally:
        server.stop()


def test_install_fsdp_patches_miles_fsdp_updater_when_it_is_imported(
    miles_env: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, ref_engines: RefEngines
) -> None:
    write_fsdp_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "miles" or n.startswith("miles.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        install_fsdp()  # what a sitecustomize does: miles' FSDP module is not imported yet
        module = importlib.import_module(FSDP_MODULE)
        assert hasattr(vars(module.UpdateWeight)["update_weights"], "__weightbus_original__")
        manager = RolloutManager(make_trainer_args())
        rm = ActorHandle(manager)
        updater = module.UpdateWeightFromTensor(make_trainer_args(), FakeModel())
        updater.connect_rollout_engines(ref_engines.handles, None)
        for _ in range(2):
            updater.update_weights()
            ray.get(rm.set_weight_version.remote(updater.weight_version))
        assert manager.versions == [1, 2] and ref_engines.labels() == ["2", "2"]
    finally:
        uninstall()


@pytest.mark.usefixtures("quick_outage_timeouts")
async def test_a_bus_that_goes_down_during_the_push_quarantines_the_engines_instead_of_announcing(
    policy: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    server = EmbeddedNats(store_dir=str(tmp_path / "js")).start()
    try:
        monkeypatch.setenv("WEIGHTBUS_NATS", server.url)
        monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
        args = make_trainer_args()
        manager = RolloutManager(args)
        cell = Cell(args, ActorHandle(manager))
        info = engines_info(ref_engines.handles, new=True)
        await run(cell.update_weights, info)
        cell.actors[0].model.on_bucket = lambda i: server.stop() if i == 1 else None
        with pytest.raises(BusError):
            await run(cell.update_weights, info)
        # The push labelled the engines "2"; the announcement could not land: they must not serve "2".
        assert ref_engines.labels() == ["quarantine:2", "quarantine:2"]
        assert all(s.pause_mode is None for s in ref_engines.states)
        assert manager.versions == [1]
    finally:
        server.stop()


# -- both halves ----------------------------------------------------------------------------------------------


async def test_both_halves_versions_only_move_forward_and_every_trained_group_is_within_the_bound(
    nats_bus: NatsBus, miles_env: str, standin: dict[str, Any], ref_engines: RefEngines
) -> None:
    bound = 1
    args = make_trainer_args(pause_generation_mode="in_place")  # miles' fully-async e2e mode (no flush)
    manager = RolloutManager(args)
    rm = ActorHandle(manager)
    cells = [Cell(args, rm, world_size=2), Cell(args, rm, world_size=2)]
    group = RayTrainGroup(cells)
    info = engines_info(ref_engines.handles, new=True)
    await run(group.update_weights, info)  # the first push before the first rollout, as train_async does
    urls = [s.url for s in ref_engines.servers]
    http = httpx.AsyncClient(timeout=30)
    turn = iter(range(10**9))

    async def generate(_: Any, prompt_group: list[Sample]) -> list[Sample]:
        for sample in prompt_group:  # one generate call per sample, on engines in turn
            url = urls[next(turn) % len(urls)]
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}
            meta = (await http.post(f"{url}/generate", json=body)).json()["meta_info"]
            sample.update_from_meta_info(meta)
            sample.status = Sample.Status.COMPLETED
        return prompt_group

    fn = FullyAsyncRolloutFn(
        make_args(max_weight_staleness=bound, async_unused_samples_handler="retry"),
        ScriptedDataSource([], fresh=lambda i: make_group(i, [])),
        generate,
    )
    trained: list[tuple[int, list[str]]] = []
    try:
        for step in range(6):
            if step == 3:
                cells[0].alive = False  # failover mid-run
            out = await fn(RolloutFnTrainInput(rollout_id=step, weight_version=manager.weight_version))
            current = out.metrics["weightbus/current_version"]
            trained.extend((int(current), s.weight_versions) for g in out.samples for s in g)
            await run(group.update_weights, info)  # the trainer pushes after the step
    finally:
        await fn.aclose()
        await http.aclose()
    assert manager.versions == sorted(set(manager.versions)) and manager.regressions == []
    assert manager.versions == await announced(nats_bus, miles_env)
    for current, labels in trained:
        assert labels and all(label.isdigit() for label in labels), labels
        assert current - min(int(label) for label in labels) <= bound, (current, labels)
