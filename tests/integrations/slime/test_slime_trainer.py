"""The trainer half of the slime drop-in (``install``), driven by a stand-in of slime's trainer side
(``slime_trainer_standin``): each training job's ranks are processes on real gloo, the engines reference engines
over real HTTP (external: every job finds them), the bus a real nats-server.

Each test asserts from what was recorded: the ``WeightUpdated`` and alert events stored on the bus, every rank's
updater count, the engines' labels and the requests they received. The restart test runs without weightbus too,
and shows slime's own behaviour there: each new job counts from ``update_weight_start_version`` (0) again.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations.ray_standin import RayTaskError
from tests.integrations.slime.slime_trainer_standin import (
    RayTrainGroup,
    RolloutManager,
    install_slime_modules,
    make_trainer_args,
    train_async,
)
from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.nats import connect
from weightbus.errors import InstallError
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import EngineOutOfSync, FleetQuarantined, WeightUpdated

pytestmark = pytest.mark.nats

INSTALL = "weightbus.integrations.slime.install"
#: The requests that pause, load, relabel or resume an engine (a fenced trainer sends none).
_TOUCH = ("/pause_generation", "/continue_generation", "/update_weight_version", "/flush_cache")


class Engines:
    """Reference engines over real HTTP (slime's external engines: every job finds them).

    ``watch(nats_url, policy)`` records, at every resume of every engine, its label and the newest version on
    the bus then (``resumes``).
    """

    def __init__(self, n: int) -> None:
        self.states = [EngineState() for _ in range(n)]
        self.resumes: list[tuple[str, int | None]] = []
        self._watching: tuple[str, str] | None = None
        self._fail: dict[int, tuple[str, int, str]] = {}  # engine -> (path, nth request from now, message)
        self.servers = [ServedEngine(self._watched(create_app(s), s, i)).start() for i, s in enumerate(self.states)]
        self.urls = [s.url for s in self.servers]

    def _watched(self, app: Any, state: EngineState, index: int) -> Any:
        async def watched(scope: Any, receive: Any, send: Any) -> None:
            failing = self._fail.get(index)
            if scope["type"] == "http" and failing is not None and scope["path"] == failing[0]:
                path, nth, message = failing
                self._fail[index] = (path, nth - 1, message)
                state.fail_weight_updates = message if nth == 1 else None
            if scope["type"] == "http" and scope["path"] == "/continue_generation" and self._watching is not None:
                newest = max(await asyncio.to_thread(announced, *self._watching), default=None)
                self.resumes.append((state.weight_version, newest))
            await app(scope, receive, send)

        return watched

    def fail(self, engine: int, path: str, nth: int, message: str) -> None:
        """The ``nth`` request to ``path`` from now on engine ``engine`` fails with ``message`` (only that one)."""
        self._fail[engine] = (path, nth, message)

    def heal(self) -> None:
        self._fail.clear()
        for state in self.states:
            state.fail_weight_updates = None

    def watch(self, nats_url: str, policy: str) -> None:
        self._watching = (nats_url, policy)

    def assert_announced_before_resumed(self) -> None:
        """No engine resumed carrying a number the bus had not announced yet."""
        assert self.resumes
        for label, newest in self.resumes:
            if label.isdigit():
                assert newest is not None and int(label) <= newest, (label, newest)

    def labels(self) -> list[str]:
        return [s.weight_version for s in self.states]

    def fingerprints(self) -> list[str]:
        return [str(getattr(s.model, "fingerprint", "")) for s in self.states]

    def touched(self) -> int:
        """How many requests paused, loaded, relabelled or resumed an engine so far."""
        return sum(1 for s in self.states for r in s.requests if r.path in _TOUCH or r.path.startswith("/update_"))

    def restart(self, i: int) -> None:
        """Engine ``i`` comes back from a restart: boot weights, ``"default"``."""
        self.states[i].weight_version = "default"

    def close(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture
def engines() -> Iterator[Engines]:
    fleet = Engines(2)
    yield fleet
    fleet.close()


@pytest.fixture
def slime_env(nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The two variables a slime user sets (the rank processes inherit them)."""
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_UPDATE_TIMEOUT", "3")
    return policy


def bus_events(nats_url: str, subject: str) -> list[Any]:
    async def read() -> list[Any]:
        bus = await connect(nats_url, connect_timeout=5)
        try:
            history = await read_subject_history(bus, subject)
        finally:
            await bus.aclose()
        return [e.event for e in history.events]

    return asyncio.run(read())


def announced(nats_url: str, policy: str) -> list[int]:
    return [e.version for e in bus_events(nats_url, subjects.weights(policy)) if isinstance(e, WeightUpdated)]


class Jobs:
    """The training jobs of one test (each a driver with its rank processes), killed at the end."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.groups: list[RayTrainGroup] = []

    def run(self, *, world: int = 2, **args: Any) -> RayTrainGroup:
        """A new job (a new driver: its own rollout manager, new rank processes) running ``train_async``."""
        parsed = make_trainer_args(**args)
        manager = RolloutManager(self.engines.urls)
        group = RayTrainGroup(parsed, world, manager)
        self.groups.append(group)
        train_async(parsed, group, manager)
        return group

    def close(self) -> None:
        for group in self.groups:
            group.kill()


@pytest.fixture
def jobs(engines: Engines) -> Iterator[Jobs]:
    running = Jobs(engines)
    yield running
    running.close()


def counts(group: RayTrainGroup) -> list[int]:
    """Every update's count, checked equal on every rank."""
    for ranks in group.versions:
        assert len(set(ranks)) == 1, ranks
    return [ranks[0] for ranks in group.versions]


def assert_fenced(zombie: RayTrainGroup, engines: Engines) -> None:
    """The zombie's update fails on every rank and touches no engine."""
    before = engines.touched()
    with pytest.raises(RayTaskError, match="FencedError"):
        zombie.update_weights()
    assert engines.touched() == before


# -- restarts, resumes and zombies ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("with_weightbus", [True, False], ids=["installed", "slime-alone"])
def test_restarts_never_reuse_a_number_and_the_job_before_is_fenced_twice_over(
    nats_url: str, slime_env: str, engines: Engines, jobs: Jobs, with_weightbus: bool
) -> None:
    hook = INSTALL if with_weightbus else None
    engines.watch(nats_url, slime_env)
    first = jobs.run(custom_megatron_init_path=hook, start_rollout_id=0, num_rollout=2)
    weights_first = engines.fingerprints()
    # The job restarts from its rollout-2 checkpoint: a new driver, new actors (slime hands them
    # update_weight_start_version = 0: only a full-disk run keeps a count across actors).
    second = jobs.run(custom_megatron_init_path=hook, start_rollout_id=2, num_rollout=4)

    assert counts(first) == [1, 2, 3]
    if not with_weightbus:  # slime's own: the new job counts 1, 2, 3 again, over other weights
        assert counts(second) == [1, 2, 3]
        assert engines.labels() == ["3", "3"] and engines.fingerprints() != weights_first  # "3" named two models
        assert announced(nats_url, slime_env) == []
        return

    assert counts(second)[0] > 3  # above every number the first job used, never from slime's 0
    assert_fenced(first, engines)  # the first job's driver retries (a stale driver, a healed partition)
    second.update_weights()  # and the owner goes on
    # The first failover again: a third job (the first one's configuration, relaunched) takes over.
    third = jobs.run(custom_megatron_init_path=hook, start_rollout_id=4, num_rollout=5)
    assert_fenced(second, engines)
    assert_fenced(first, engines)
    third.update_weights()

    numbers = [*counts(first), *counts(second), *counts(third)]
    # Rising, none used twice; a takeover skips the number its predecessor's last announcement reserved ahead
    # (the predecessor may have pushed under it).
    assert (counts(first), counts(second), counts(third)) == ([1, 2, 3], [5, 6, 7, 8], [10, 11, 12])
    assert announced(nats_url, slime_env) == numbers
    assert engines.labels() == [str(numbers[-1])] * 2
    engines.assert_announced_before_resumed()


@pytest.mark.slow
@pytest.mark.parametrize("with_weightbus", [True, False], ids=["installed", "slime-alone"])
def test_update_weight_start_version_is_a_floor_never_the_source(
    nats_url: str, slime_env: str, engines: Engines, jobs: Jobs, with_weightbus: bool
) -> None:
    hook = INSTALL if with_weightbus else None
    first = jobs.run(world=1, custom_megatron_init_path=hook, update_weight_start_version=10, num_rollout=2)
    # A resume handed an older start version (a stale checkpoint's): the count must not move back.
    second = jobs.run(world=1, custom_megatron_init_path=hook, update_weight_start_version=2, num_rollout=1)
    assert counts(first) == [11, 12, 13]  # above the floor, with or without weightbus
    if not with_weightbus:
        assert counts(second) == [3, 4]  # slime's: back to 3
        return
    assert counts(second) == [15, 16]  # above 13 and the 14 its last announcement reserved
    assert announced(nats_url, slime_env) == [11, 12, 13, 15, 16]


# -- the colocated tensor path, LoRA ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_merged_lora_push_through_the_colocated_updater_is_stamped_and_announced_across_a_restart(
    nats_url: str, slime_env: str, engines: Engines, jobs: Jobs
) -> None:
    # slime has no adapter push (slime#1865 merges the adapters and pushes full weights): each rank loads
    # its own colocated engine, so rank 1's loads carry the number rank 0 shared, across a restart too.
    engines.watch(nats_url, slime_env)
    first = jobs.run(colocate=True, enable_lora=True, num_rollout=2)
    second = jobs.run(colocate=True, enable_lora=True, start_rollout_id=2, num_rollout=3)
    assert counts(first) == [1, 2, 3] and counts(second) == [5, 6]  # every rank: the bus's number
    assert engines.labels() == ["6", "6"]
    events = [e for e in bus_events(nats_url, subjects.weights(slime_env)) if isinstance(e, WeightUpdated)]
    assert [e.version for e in events] == [1, 2, 3, 5, 6]
    for event in events:
        assert event.lora is None and sorted(event.engines) == sorted(engines.urls)  # both engines stamped
    engines.assert_announced_before_resumed()
    # weightbus pauses as slime's own pause_generation() does: SGLang's default, abort
    modes = {r.body.get("mode") for s in engines.states for r in s.recorded("/pause_generation")}
    assert modes == {"abort"}


# -- a restarted engine -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_engine_restarted_to_default_is_alerted_before_the_full_push_covers_it(
    nats_url: str, slime_env: str, engines: Engines, jobs: Jobs
) -> None:
    group = jobs.run(num_rollout=0)
    assert engines.labels() == ["1", "1"]
    engines.restart(1)  # slime reconnects it at the next update (new handles)
    group._rollout_manager.replace_engine()
    group.update_weights()
    found = bus_events(nats_url, subjects.alerts(slime_env))
    reasons = {(a.engine, a.actual, a.reason) for a in found if isinstance(a, EngineOutOfSync)}
    assert (engines.urls[1].rstrip("/"), "default", "unexpected_label") in {
        (e.rstrip("/"), actual, reason) for e, actual, reason in reasons
    }  # never silently re-stamped
    assert engines.labels() == ["2", "2"]  # the whole model reached it: stamped with the other
    assert announced(nats_url, slime_env) == [1, 2]


# -- a failed push -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_push_that_fails_halfway_leaves_the_engines_quarantined_and_its_number_used_up(
    nats_url: str, slime_env: str, engines: Engines, jobs: Jobs
) -> None:
    first = jobs.run(num_rollout=0)
    assert engines.labels() == ["1", "1"]
    # Engine 1 fails the second bucket: engine 0 already took the first, labelled "2" by slime's payload.
    engines.fail(1, "/update_weights_from_distributed", 2, "CUDA error: an illegal memory access")
    with pytest.raises(RayTaskError, match="illegal memory access"):
        first.update_weights()
    assert engines.labels() == ["quarantine:2", "quarantine:2"]  # not on a number, not even engine 0
    assert all(s.pause_mode is None for s in engines.states)  # resumed: their samples are refused, not lost
    assert announced(nats_url, slime_env) == [1]
    found = bus_events(nats_url, subjects.alerts(slime_env))
    quarantined = [(a.version, a.label, a.reason) for a in found if isinstance(a, FleetQuarantined)]
    assert quarantined == [(2, "quarantine:2", "update_failed")]

    # slime's job is gone (its other rank waits at a barrier forever); the restarted job goes on above 2.
    engines.heal()
    second = jobs.run(num_rollout=0)
    assert counts(second)[0] > 2 and engines.labels() == [str(counts(second)[0])] * 2
    assert announced(nats_url, slime_env) == [1, counts(second)[0]]


# -- the disk delta -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_disk_delta_names_its_files_by_slime_count_and_labels_by_the_bus(
    nats_url: str, slime_env: str, engines: Engines, jobs: Jobs, tmp_path: Any
) -> None:
    disk = tmp_path / "delta"
    first = jobs.run(
        update_weight_mode="delta", update_weight_transport="disk", update_weight_disk_dir=str(disk), num_rollout=2
    )
    assert announced(nats_url, slime_env) == [1, 2] and engines.labels() == ["2", "2"]
    assert sorted(p.name for p in disk.iterdir()) == ["weight_v000001", "weight_v000002"]
    # A restart: slime's new job starts its chain again (its baseline clears the dir); the bus goes on.
    second = jobs.run(
        update_weight_mode="delta", update_weight_transport="disk", update_weight_disk_dir=str(disk), num_rollout=1
    )
    assert announced(nats_url, slime_env)[2:] and min(announced(nats_url, slime_env)[2:]) > 2
    assert engines.labels() == [str(announced(nats_url, slime_env)[-1])] * 2
    chain = {p.name: sorted(q.name for q in p.iterdir()) for p in disk.iterdir()}
    assert_fenced(first, engines)  # before it writes a file
    assert {p.name: sorted(q.name for q in p.iterdir()) for p in disk.iterdir()} == chain
    assert counts(second)[-1] == announced(nats_url, slime_env)[-1]


# -- the install: all or nothing ----------------------------------------------------------------------------


@pytest.fixture
def slime_modules() -> Iterator[dict[str, types.ModuleType]]:
    import torch.distributed as dist

    saved = {name: mod for name, mod in sys.modules.items() if name == "slime" or name.startswith("slime.")}
    install_slime_modules(dist, None)
    try:
        yield {name: mod for name, mod in sys.modules.items() if name.startswith("slime.")}
    finally:
        from weightbus.integrations.slime import uninstall

        uninstall()
        for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_a_full_update_over_disk_is_refused_and_nothing_is_patched(
    slime_env: str, slime_modules: dict[str, types.ModuleType]
) -> None:
    from weightbus.integrations.slime import SLIME_COMMIT, install, installed

    cls = slime_modules[
        "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"
    ].UpdateWeightFromDistributed
    with pytest.raises(InstallError, match="RayTrainGroup._reload_rollout_weights_from_disk") as caught:
        install(make_trainer_args(update_weight_transport="disk", update_weight_mode="full"))
    assert SLIME_COMMIT[:9] in str(caught.value)
    assert installed() is None and not hasattr(vars(cls)["update_weights"], "__weightbus_original__")


def test_a_slime_without_an_updater_it_patches_is_refused_and_nothing_is_patched(
    slime_env: str, slime_modules: dict[str, types.ModuleType]
) -> None:
    from weightbus.integrations.slime import SLIME_COMMIT, install, installed

    tensor = slime_modules["slime.backends.megatron_utils.update_weight.update_weight_from_tensor"]
    del tensor.UpdateWeightFromTensor
    cls = slime_modules[
        "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"
    ].UpdateWeightFromDistributed
    with pytest.raises(InstallError, match="UpdateWeightFromTensor is missing") as caught:
        install(make_trainer_args())
    assert f"slime main@{SLIME_COMMIT[:9]}" in str(caught.value)
    assert installed() is None and not hasattr(vars(cls)["update_weights"], "__weightbus_original__")


def test_the_install_patches_every_updater_and_slime_commit_is_the_mirrors_head(
    slime_env: str, slime_modules: dict[str, types.ModuleType]
) -> None:
    from weightbus.integrations.slime import SLIME_COMMIT, install

    state = install(make_trainer_args())
    try:
        for path, name in [
            ("update_weight_from_distributed", "UpdateWeightFromDistributed"),
            ("update_weight_from_tensor", "UpdateWeightFromTensor"),
            ("update_weight_from_disk_delta", "UpdateWeightFromDiskDelta"),
        ]:
            cls = getattr(slime_modules[f"slime.backends.megatron_utils.update_weight.{path}"], name)
            assert hasattr(vars(cls)["update_weights"], "__weightbus_original__"), name
        assert install(make_trainer_args()) is state  # a second call on the same rank: the first install
    finally:
        from weightbus.integrations.slime import uninstall

        uninstall()
    assert len(SLIME_COMMIT) == 40 and SLIME_COMMIT.startswith("624b824a")
