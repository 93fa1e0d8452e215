"""The trainer half of the miles integration at run time: each patched ``update_weights`` runs here.

``install`` (module ``patching``) checks miles and patches its updaters to call ``MilesTrainer.update``.

``install`` wraps the ``update_weights`` method of every updater miles has (written against miles main at
``MILES_COMMIT``): the distributed mixin (``DistBucketedWeightUpdateMixin``: NCCL broadcast and p2p,
full weights, single- and multi-LoRA), the disk delta (``UpdateWeightFromDiskDelta``), the colocated
tensor path (``UpdateWeightFromTensor``, base and LoRA) and FSDP's ``UpdateWeight``. Each update runs
through weightbus' update protocol (``producers.update.VersionUpdate``, driven by one
``SyncVersionPublisher`` per cell, on rank 0); nothing here re-implements it. Invariants:

* **The number is the bus's.** Rank 0 takes it from the policy's fenced, durable counter (reserved on
  the bus before any engine carries it) instead of ``weight_version += 1``, and hands it to every rank
  of the cell (one ``broadcast_object_list`` on miles' gloo group, ``Runtime.share``) before any rank
  pushes; miles' own code then sees it as ``self.weight_version``. After the update the updater holds
  the bus's number, so what the actor passes to ``RolloutManager.set_weight_version`` never goes back,
  whichever cell ran the update. The disk delta keeps miles' own count for its file chain (the
  engines' ``pull_weights`` walks it) and carries the bus's number only as the label.
* **Stamped, read back, announced, then resumed.** Rank 0's engine handles are replaced, for the
  length of miles' ``update_weights``, by proxies: miles' ``pause_generation`` becomes weightbus'
  pause (taken together with the number), miles' own ``update_weight_version`` is dropped (weightbus
  stamps and reads back), and miles' first ``continue_generation`` becomes the protocol's exit:
  stamp, verify, announce ``WeightUpdated`` on the bus, then resume. So no sample labelled ``v``
  is produced before ``v`` is on the bus. LoRA pushes (broadcast, p2p, multi-LoRA and the colocated
  tensor path, which miles never labels) are delta pushes on the same counter, stamped the same way.
* **A failure quarantines.** Any exception out of miles' push, a stamp that does not read back, a
  fenced counter or an announcement that does not land relabels every engine ``quarantine:<v>``
  (``VersionPublisher.update()``'s cleanup) and resumes it; the number stays used up and the error
  is raised. A fenced cell (a zombie after failover) raises at its next update before it pauses,
  pushes or stamps anything (``FencedError``): one read of the weights subject precedes the pause.
  On the disk delta that read precedes miles' writes to the shared delta dir (every rank of the
  cell learns its outcome) and is repeated before the first ``pull_weights``.
* **The disk delta's reload is a full push** (the engines reload their whole host-local checkpoint).
  Its baseline keeps miles' ``"0"`` (version 0, the pre-training baseline) on the boot reload of
  ``--check-weight-update-equal``, and drops that reload where every engine already serves the
  announced version, so miles' ``--ci-test`` read-back holds and ``set_weight_version`` never goes back.
* **Adapters are announced as the engines serve them**: multi-LoRA by miles' slot names
  (``slot_lora_name``), each with miles' name for it (``LoraAdapter.trainer_name``, ``.more``).
* **A bus that does not answer** at init is a ``BusConnectError`` within ``WEIGHTBUS_CONNECT_TIMEOUT``;
  during a run, taking the number is retried (nothing is paused or pushed in between) for at most
  ``WEIGHTBUS_UPDATE_TIMEOUT`` seconds, then the error is raised. Weights are never pushed under a
  number the bus did not reserve, nor left labelled with one it did not announce.
miles, torch and ray are never imported here: ``torch.distributed`` (``dist``), ``get_gloo_group`` and
``ray`` are taken from the module globals of the miles modules being patched, so the integration
uses exactly the objects miles uses.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import msgspec

from weightbus.bus.options import redact_url
from weightbus.errors import (
    BusConfigError,
    BusError,
    CounterExhaustedError,
    FencedError,
    PermissionDeniedError,
    StreamConfigError,
)
from weightbus.integrations.miles.config import MilesSettings
from weightbus.integrations.miles.engines import MilesEngineFleet
from weightbus.producers.coverage import Push
from weightbus.producers.publisher import default_trainer_id
from weightbus.producers.sync import SyncVersionPublisher
from weightbus.producers.update import VersionUpdate
from weightbus.schemas import ClaimStanding, LoraAdapter

__all__ = ["Kind", "LORA_NAME", "MilesTrainer", "Plan", "Runtime"]

log = logging.getLogger("weightbus.integrations.miles")

#: miles' adapter name when the mixin module does not say (``miles.utils.lora.LORA_ADAPTER_NAME``).
LORA_NAME: Final = "miles_lora"
#: Where miles names its multi-LoRA adapters' engine slots (``slot_lora_name``).
_MULTI_LORA: Final = "miles.utils.multi_lora"

Kind = Literal["mixin", "delta", "tensor", "fsdp"]

_T = TypeVar("_T")

_FINAL_BUS_ERRORS: Final = (CounterExhaustedError, PermissionDeniedError, BusConfigError, StreamConfigError)


@dataclass(frozen=True, slots=True)
class Runtime:
    """miles' own ``torch.distributed``, gloo group and ``ray.get``, from the globals of a patched module."""

    dist: Any
    gloo: Callable[[], Any]
    ray_get: Callable[[Any], Any]
    lora_name: str
    parallel_state: Callable[[], Any] | None = None  # miles' get_parallel_state (absent from FSDP's module)
    runtime_context: Callable[[], Any] | None = None  # ray.get_runtime_context

    def standing(self) -> ClaimStanding | None:
        """Where miles' group puts this cell now: its driver's Ray job, its quorum id and its alive rank.

        Read from miles' own state at the time of the update: ``get_parallel_state().indep_dp`` is the
        group miles builds from the cell's ``IndepDPInfo`` at init and rebuilds at every
        ``reconfigure_indep_dp`` (its ``rank`` is the alive rank, its ``debug_info["quorum"]`` the
        quorum id). None when miles does not say (FSDP, a miles without it): the cell then never
        claims again once fenced.
        """
        if self.parallel_state is None or self.runtime_context is None:
            return None
        try:
            group = self.parallel_state().indep_dp
            quorum, rank = group.debug_info.get("quorum"), group.rank
            job = self.runtime_context().get_job_id()
        except Exception as exc:  # miles' state is not what this commit has: no standing, and it is said
            log.warning(
                "miles' indep-DP state could not be read; this cell will not claim again once fenced",
                extra={"error": repr(exc)},
            )
            return None
        if type(quorum) is not int or type(rank) is not int or quorum < 0 or rank < 0 or not job:
            log.warning(
                "miles' indep-DP state has no quorum id or alive rank; this cell will not claim again once fenced",
                extra={"quorum": repr(quorum), "rank": repr(rank), "job": repr(job)},
            )
            return None
        return ClaimStanding(scope=f"ray-job:{job}", term=quorum, rank=rank)

    def rank(self) -> int:
        is_initialized = getattr(self.dist, "is_initialized", None)
        if callable(is_initialized) and not is_initialized():
            return 0
        return int(self.dist.get_rank())

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank of the cell: the one collective the integration adds."""
        box = [value]
        self.dist.broadcast_object_list(box, src=0, group=self.gloo())
        return box[0]


@dataclass(frozen=True, slots=True)
class Plan:
    """How one update maps onto ``VersionUpdate``."""

    push: Push
    labels: bool
    lora: LoraAdapter | None


# -- one cell's updates ------------------------------------------------------------------------------------


class MilesTrainer:
    """The integration in one training actor's process: its settings, and each updater's cell.

    Made by ``install``; one per process. Each weight updater miles builds gets its own ``_Cell``
    on rank 0 (one ``SyncVersionPublisher``: one claim of the counter), made at its first update;
    the connection rank 0 opened at install is handed to the first one.

    Attributes:
        settings: what was configured.
        labelling: the updater classes whose full push carries ``weight_version`` (miles' NCCL broadcast).
    """

    def __init__(self, args: Any, settings: MilesSettings) -> None:
        self.settings = settings
        self.args = args
        self.labelling: set[type] = set()
        self._spare: _Cell | None = None  # rank 0's cell connected at install, for the first updater
        self._cells: list[_Cell] = []
        self._lock = threading.Lock()

    @property
    def policy(self) -> str:
        """The policy id."""
        return self.settings.policy

    @property
    def publisher(self) -> SyncVersionPublisher | None:
        """The publisher of this process' newest cell on rank 0 (or the one connected at install); None elsewhere."""
        with self._lock:
            cell = self._cells[-1] if self._cells else self._spare
            return cell.publisher if cell is not None else None

    @property
    def version(self) -> int | None:
        """The bus's current version as this process' newest publisher knows it (None before a claim)."""
        pub = self.publisher
        return pub.version if pub is not None and pub.started else None

    def close(self) -> None:
        """Close every publisher of this process (bus connections and private loops)."""
        with self._lock:
            pubs = [c.publisher for c in self._cells] + ([self._spare.publisher] if self._spare is not None else [])
            self._cells.clear()
            self._spare = None
        for pub in pubs:
            pub.close()

    def connect_if_rank0(self, runtime: Runtime) -> None:
        """On rank 0, connect to the bus now (an unreachable bus is an error at init, not at the first update)."""
        if runtime.rank() != 0:
            return
        with self._lock:
            if self._spare is None and not self._cells:
                self._spare = _Cell(self)
            spare = self._spare
        if spare is not None:
            try:
                spare.publisher.connect()
            except BusError as exc:
                exc.add_note(
                    f"weightbus' miles install connects rank 0 to {redact_url(self.settings.nats)} at init "
                    "(WEIGHTBUS_NATS, WEIGHTBUS_CONNECT_TIMEOUT); nothing was patched"
                )
                with self._lock:
                    self._spare = None
                raise

    def cell(self, updater: Any) -> _Cell:
        """Rank 0's cell of ``updater`` (made at its first update)."""
        cell: _Cell | None = updater.__dict__.get("_weightbus_cell")
        if cell is None:
            with self._lock:
                cell, self._spare = self._spare, None
                if cell is None:
                    cell = _Cell(self)
                self._cells.append(cell)
            updater.__dict__["_weightbus_cell"] = cell
        return cell

    # -- the update --------------------------------------------------------------------------------------

    def update(self, updater: Any, original: Callable[[Any], None], kind: Kind, runtime: Runtime) -> None:
        """One miles ``update_weights`` call on this rank, under weightbus' protocol (see the module)."""
        if kind == "delta":
            self._update_delta(updater, original, runtime)
            return
        rank0 = runtime.rank() == 0
        session: _Session | None = None
        if rank0:
            session = _Session(self.cell(updater), updater, runtime, self._plan(updater, kind, runtime))
            try:
                session.enter()
            except BaseException as exc:
                runtime.share(f"{type(exc).__name__}: {exc}")  # the other ranks raise instead of waiting
                raise
            shared = runtime.share(session.version)
        else:
            shared = runtime.share(None)
        if not isinstance(shared, int):
            raise RuntimeError(f"rank 0 could not take a weight version from weightbus: {shared}")
        updater.weight_version = shared - 1  # miles' own `weight_version += 1` makes it the bus's number
        _run_original(updater, original, session)
        updater.weight_version = shared

    def _update_delta(self, updater: Any, original: Callable[[Any], None], runtime: Runtime) -> None:
        """The disk delta: miles' count names the files; the bus's number labels the engines, entered at the pause.

        Before miles writes a file, clears the delta dir or calls an engine, rank 0 claims (a cell's
        first baseline) or checks the fence, claiming again if miles picked this cell again
        (``_Cell.check_owner``), and every rank learns the outcome (one broadcast): a fenced cell
        raises on every rank with the shared chain untouched.
        """
        rank0 = runtime.rank() == 0
        chain = updater.__dict__.get("_weightbus_chain", updater.weight_version)
        updater.weight_version = chain
        baseline = not getattr(updater, "_baseline_captured", False)
        session: _Session | None = None
        if rank0:
            cell = self.cell(updater)
            session = _Session(cell, updater, runtime, Plan("full", False, None), lazy=True, baseline=baseline)
            try:
                if baseline and not cell.publisher.started:
                    try:  # the first claim, before any engine is touched; the first real update retries it
                        session.version = cell.ready(updater, runtime).version
                    except BusError as exc:
                        log.warning(
                            "could not claim the counter at miles' disk-delta baseline; the first update retries",
                            extra={"policy": self.policy, "error": str(exc)},
                        )
                else:
                    # Fenced, or claimed again if miles picked this cell again; before miles writes a file
                    # (or, at a baseline retried after its claim, clears the shared delta dir).
                    cell.check_owner(updater, runtime)
                    if baseline:
                        session.version = cell.publisher.version
                if baseline and getattr(getattr(updater, "args", None), "check_weight_update_equal", False):
                    session.keep = _serves_announced(session.version, updater, runtime)
            except BaseException as exc:
                runtime.share(f"{type(exc).__name__}: {exc}")
                raise
            runtime.share(None)
        else:
            refused = runtime.share(None)
            if refused is not None:
                raise RuntimeError(f"rank 0 refused miles' disk-delta update before it wrote anything: {refused}")
        _run_original(updater, original, session)
        updater.__dict__["_weightbus_chain"] = updater.weight_version
        mine = None
        if session is not None:
            mine = session.version
            if mine is None and session.cell.publisher.started:
                mine = session.cell.publisher.version  # nothing was loaded: the bus's number still holds
            if mine is None:
                mine = updater.weight_version  # nothing was ever announced: miles' baseline 0
        shared = runtime.share(mine)
        updater.weight_version = shared if isinstance(shared, int) else updater.weight_version

    def _plan(self, updater: Any, kind: Kind, runtime: Runtime) -> Plan:
        if kind in ("mixin", "tensor") and getattr(updater, "is_lora", False):
            adapters = getattr(updater, "multi_lora_adapters", None) if kind == "mixin" else None
            if adapters is None:
                return Plan("delta", False, LoraAdapter(name=runtime.lora_name))
            # Multi-LoRA: the engines serve each adapter under its controller slot's name.
            served = sorted((_slot_name(adapter), str(name)) for name, adapter in adapters.items())
            if not served:
                return Plan("delta", False, None)  # nothing loaded: the engines serve what they served
            loaded = [LoraAdapter(name=engine, trainer_name=name) for engine, name in served]
            return Plan("delta", False, msgspec.structs.replace(loaded[0], more=tuple(loaded[1:])))
        return Plan("full", kind == "mixin" and isinstance(updater, tuple(self.labelling)), None)


def _slot_name(adapter: Any) -> str:
    """The engine-side name of a multi-LoRA adapter: miles' own ``slot_lora_name(adapter.slot)``."""
    module = importlib.import_module(_MULTI_LORA)
    namer = getattr(module, "slot_lora_name", None)
    if not callable(namer):
        raise RuntimeError(f"{_MULTI_LORA}.slot_lora_name is missing: weightbus cannot name miles' adapters")
    return str(namer(adapter.slot))


def _serves_announced(version: int | None, updater: Any, runtime: Runtime) -> bool:
    """Whether every engine already carries ``version`` (announced on the bus), read on rank 0 once."""
    if not version:
        return False
    handles = [_real(h) for h in getattr(updater, "rollout_engines", None) or ()]
    labels = runtime.ray_get([h.get_weight_version.remote() for h in handles]) if handles else []
    answered = [label for label in labels if label is not None]  # a multi-node engine's other nodes: None
    return bool(answered) and all(str(label) == str(version) for label in answered)


class _FleetSlot:
    """A cell's fleet, built on the publisher's loop from the handles miles connected."""

    def __init__(self) -> None:
        self.fleet: MilesEngineFleet | None = None
        self.handles: list[Any] = []
        self.ray_get: Callable[[Any], Any] | None = None

    async def build(self) -> MilesEngineFleet:
        assert self.ray_get is not None
        self.fleet = await MilesEngineFleet.build(self.handles, self.ray_get)
        return self.fleet


class _Cell:
    """Rank 0's publisher for one weight updater, and its fleet over miles' engines.

    One publisher per claim: a cell that was fenced and that miles picked again (its standing, see
    ``Runtime.standing``, outranks the owner's claim) claims again with a new publisher; one that
    miles did not pick stays fenced.
    """

    def __init__(self, trainer: MilesTrainer) -> None:
        self.trainer = trainer
        self._slot = _FleetSlot()
        self.publisher = self._publisher(self._slot)

    def _publisher(self, slot: _FleetSlot) -> SyncVersionPublisher:
        s = self.trainer.settings
        return SyncVersionPublisher(
            s.policy,
            nats_url=s.nats,
            trainer_id=s.trainer_id or f"miles:{default_trainer_id()}",
            pause=getattr(self.trainer.args, "pause_generation_mode", None) or "retract",
            connect_timeout=s.connect_timeout,
            floor=s.floor,
            options=s.options,
            fleet_factory=slot.build,
        )

    def _point(self, slot: _FleetSlot, updater: Any, runtime: Runtime) -> None:
        handles = getattr(updater, "rollout_engines", None)
        if handles is None:
            raise RuntimeError(
                f"{type(updater).__name__}.rollout_engines is not set: miles connects its engines "
                "(connect_rollout_engines) before update_weights"
            )
        more = getattr(updater, "distributed_rollout_engines", None) or ()
        # Inside miles' update (the disk delta enters at its pause) the updater holds our proxies.
        slot.handles = [_real(h) for h in (*handles, *more)]
        slot.ray_get = runtime.ray_get

    def ready(self, updater: Any, runtime: Runtime) -> SyncVersionPublisher:
        """The publisher, started (claimed) and pointed at the engines miles connected now."""
        slot = self._slot
        self._point(slot, updater, runtime)
        pub = self.publisher
        if not pub.started:
            pub.start(standing=runtime.standing())
        elif slot.fleet is not None:
            fleet, given, ray_get = slot.fleet, slot.handles, runtime.ray_get
            pub.call(lambda _: fleet.retarget(given, ray_get))
        return pub

    def check_owner(self, updater: Any, runtime: Runtime) -> None:
        """Own the counter or raise ``FencedError`` (``owned``: fenced, or claimed again); retried while the bus is out.

        The one check every path makes before it touches anything shared (the disk delta's before miles
        writes a file and before the first pull, ``enter``'s before the pause), so a cell miles picked
        again after another took the counter claims again wherever it first looks, and a zombie stays
        fenced wherever it first looks.

        Raises:
            FencedError: fenced, and miles did not pick this cell after the owner.
        """
        self._retrying(lambda: self.owned(updater, runtime), "reading the bus", "nothing was written or pushed")

    def _retrying(self, attempt: Callable[[], _T], doing: str, untouched: str) -> _T:
        timeout = self.trainer.settings.update_timeout
        deadline = time.monotonic() + timeout
        delay = 0.2
        while True:
            try:
                return attempt()
            except BusError as exc:
                if isinstance(exc, _FINAL_BUS_ERRORS) or time.monotonic() + delay > deadline:
                    exc.add_note(
                        f"weightbus gave up {doing} after {timeout:g}s (WEIGHTBUS_UPDATE_TIMEOUT); {untouched}"
                    )
                    raise
                log.warning(
                    f"the bus did not answer while {doing}; retrying (nothing is written or pushed meanwhile)",
                    extra={"policy": self.trainer.policy, "error": str(exc), "retry_in": delay},
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def owned(self, updater: Any, runtime: Runtime) -> SyncVersionPublisher:
        """``ready``, and the counter's owner: claimed again if miles picked this cell after the owner.

        One read of the weights subject first (before anything pauses the owner's engines). A fenced
        cell claims again only through ``start(outrank=True)``: the bus's history, read by the claim
        it is conditional on, must show an owner whose standing this cell's outranks (the same Ray
        job, a later quorum or a later alive rank of the same one). Otherwise the ``FencedError``
        stands: a zombie never touches the owner's engines.

        Raises:
            FencedError: fenced, and miles did not pick this cell after the owner.
        """
        pub = self.ready(updater, runtime)
        try:
            pub.call(lambda p: p.check_owner())
        except FencedError as fenced:
            return self._claim_again(updater, runtime, fenced)
        return pub

    def _claim_again(self, updater: Any, runtime: Runtime, fenced: FencedError) -> SyncVersionPublisher:
        standing = runtime.standing()
        if standing is None:
            fenced.add_note("miles' standing of this cell (quorum id, alive rank) is unknown: it stays fenced")
            raise fenced
        try:  # reads only: a cell miles did not pick learns it without touching an engine
            self.publisher.call(lambda p: p.check_outranks(standing))
        except FencedError as refused:
            refused.add_note(f"this cell stays fenced since {fenced}")
            raise refused from None
        slot = _FleetSlot()
        self._point(slot, updater, runtime)
        fresh = self._publisher(slot)
        try:
            fresh.start(standing=standing, outrank=True)  # a failed start closes ``fresh``
        except FencedError as refused:
            refused.add_note(f"this cell stays fenced since {fenced}")
            raise refused from None
        old, self.publisher, self._slot = self.publisher, fresh, slot
        old.close()
        log.warning(
            "miles picked this cell again after another took the counter: claimed it again",
            extra={
                "policy": self.trainer.policy,
                "quorum": standing.term,
                "alive_rank": standing.rank,
                "epoch": fresh.epoch,
                "fenced_by": fenced.owner,
            },
        )
        return fresh

    def enter(self, updater: Any, runtime: Runtime, plan: Plan) -> VersionUpdate:
        """Take the number, pause, read the labels, mark them pending: retried while the bus does not answer."""

        def attempt() -> VersionUpdate:
            # A cell that lost the counter raises here, before it pauses the owner's engines, unless
            # miles picked it again after the owner (then it claims again); the take checks again.
            pub = self.owned(updater, runtime)
            update = pub.publisher.update(lora=plan.lora, push=plan.push, labels=plan.labels)
            pub.call(lambda _: update.__aenter__())
            return update

        return self._retrying(attempt, "taking a version", "nothing was pushed")


def _run_original(updater: Any, original: Callable[[Any], None], session: _Session | None) -> None:
    try:
        with _proxied(updater, session):
            original(updater)
    except BaseException as exc:
        if session is not None:
            session.abort(exc)
        raise
    if session is not None:
        session.commit()  # miles never resumed (no continue_generation): close the update now


class _Session:
    """Rank 0's side of one update: the ``VersionUpdate`` and what miles' engine calls turn into."""

    def __init__(
        self,
        cell: _Cell,
        updater: Any,
        runtime: Runtime,
        plan: Plan,
        *,
        lazy: bool = False,
        baseline: bool = False,
    ) -> None:
        self.cell = cell
        self.updater = updater
        self.runtime = runtime
        self.plan = plan
        self.lazy = lazy
        self.baseline = baseline
        self.update: VersionUpdate | None = None
        self.version: int | None = None
        self.closed = False
        self.keep = False  # a disk-delta baseline whose engines already serve the announced version
        self.fence_checked = False

    def enter(self) -> None:
        self.update = self.cell.enter(self.updater, self.runtime, self.plan)
        self.version = self.update.version

    def _exit(self, exc: BaseException | None) -> None:
        update = self.update
        if update is None or self.closed:
            return
        self.closed = True  # before the call: a failing exit quarantined already and must not run twice
        pub = self.cell.publisher
        tb = exc.__traceback__ if exc is not None else None
        pub.call(lambda _: update.__aexit__(type(exc) if exc is not None else None, exc, tb))

    def commit(self) -> None:
        """Stamp, read back, announce, resume (``VersionUpdate``'s exit)."""
        self._exit(None)

    def abort(self, exc: BaseException) -> None:
        """Quarantine and resume after ``exc`` (``VersionUpdate``'s failed exit); never raises over ``exc``."""
        try:
            self._exit(exc)
        except Exception as cleanup:  # the cleanup's own failure is a note on the error that caused it
            exc.add_note(f"weightbus' quarantine after the failed update failed too: {cleanup!r}")

    def intercept(self, name: str, handle: Any, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What miles' call ``handle.<name>.remote(*args, **kwargs)`` does during this update."""
        if self.baseline:
            if name == "update_weights_from_disk" and self.keep:
                # --check-weight-update-equal reloads the boot checkpoint to undo the checker's reset at
                # the run's first sync; engines that serve an announced version were never reset, and
                # a reload would take them back to the boot weights: they keep what they serve.
                return handle.get_weight_version.remote()
            # Otherwise miles' reload of the boot checkpoint keeps miles' "0": version 0 is the
            # pre-training baseline, what the reload loads (judged the oldest there is).
            return method.remote(*args, **kwargs)
        if name == "pull_weights" and self.update is None and not self.fence_checked:
            self.fence_checked = True  # the files are written; the engines are not touched yet: check again
            self.cell.check_owner(self.updater, self.runtime)
        if self.closed and name in _LOADS:
            raise RuntimeError(f"miles called {name} after the update was announced; it was not sent")
        if self.update is None and self.lazy and name in _STARTS:
            self.enter()  # the disk delta's pause, or a load that comes first: take, pause, mark pending
        if name == "pause_generation":
            return handle.get_weight_version.remote()  # weightbus paused the engines with the take
        if name == "update_weight_version":
            return handle.get_weight_version.remote()  # weightbus stamps, and reads back
        if name == "continue_generation":
            if self.update is None:
                raise RuntimeError("miles resumed its engines in an update weightbus never entered")
            self.commit()  # once: stamp, announce, then the resume; the later calls find it done
            return handle.get_weight_version.remote()
        if name == "update_weights_from_disk":
            kwargs.pop("weight_version", None)  # the engines carry pending:<v> until the stamp
            if len(args) > 2:
                args = (*args[:2], None, *args[3:])
        return method.remote(*args, **kwargs)


#: The calls that change what an engine serves; the first one of a lazily entered update enters it.
_LOADS: Final = frozenset(
    {
        "update_weights_from_disk",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "load_lora_adapter_from_distributed",
        "load_lora_adapter_from_tensors",
    }
)
_STARTS: Final = _LOADS | {"pause_generation"}
_INTERCEPTED: Final = _STARTS | {"update_weight_version", "continue_generation", "pull_weights"}


class _EngineProxy:
    """An engine handle whose calls go through the update's ``_Session``; pickles as the real handle."""

    def __init__(self, handle: Any, session: _Session) -> None:
        self._handle = handle
        self._session = session

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._handle, name)
        if name in _INTERCEPTED:
            return _ProxyMethod(self._handle, name, attr, self._session)
        return attr

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return (_identity, (self._handle,))


class _ProxyMethod:
    def __init__(self, handle: Any, name: str, method: Any, session: _Session) -> None:
        self._handle, self._name, self._method, self._session = handle, name, method, session

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._session.intercept(self._name, self._handle, self._method, args, kwargs)

    def options(self, **options: Any) -> _ProxyMethod:
        return _ProxyMethod(self._handle, self._name, self._method.options(**options), self._session)


def _identity(value: Any) -> Any:
    return value


def _real(handle: Any) -> Any:
    return handle._handle if isinstance(handle, _EngineProxy) else handle


@contextmanager
def _proxied(updater: Any, session: _Session | None) -> Iterator[None]:
    """Rank 0's engine handles as proxies for the length of miles' update (other ranks: unchanged)."""
    if session is None:
        yield
        return
    attrs = [a for a in ("rollout_engines", "distributed_rollout_engines") if getattr(updater, a, None) is not None]
    saved = {a: getattr(updater, a) for a in attrs}
    for a in attrs:
        setattr(updater, a, [_EngineProxy(h, session) for h in saved[a]])
    try:
        yield
    finally:
        for a in attrs:
            setattr(updater, a, saved[a])
