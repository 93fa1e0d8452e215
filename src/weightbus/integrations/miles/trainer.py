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
uses exactly the objects miles uses. The parts: ``runtime`` (those objects), ``plan`` (which push an
update is), ``cell`` (rank 0's publisher per updater), ``session`` and ``proxies`` (one update's engine calls).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from weightbus.bus.options import redact_url
from weightbus.errors import BusError
from weightbus.integrations.miles.cell import Cell
from weightbus.integrations.miles.config import MilesSettings
from weightbus.integrations.miles.plan import Kind, Plan, plan_update
from weightbus.integrations.miles.proxies import real_handle
from weightbus.integrations.miles.runtime import LORA_NAME, Runtime
from weightbus.integrations.miles.session import Session, run_original
from weightbus.producers.sync import SyncVersionPublisher

__all__ = ["Kind", "LORA_NAME", "MilesTrainer", "Plan", "Runtime"]

log = logging.getLogger("weightbus.integrations.miles")


class MilesTrainer:
    """The integration in one training actor's process: its settings, and each updater's cell.

    Made by ``install``; one per process. Each weight updater miles builds gets its own ``Cell``
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
        self._spare: Cell | None = None  # rank 0's cell connected at install, for the first updater
        self._cells: list[Cell] = []
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
        return pub.state.version if pub is not None else None

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
                self._spare = Cell(self.settings, self.args)
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

    def cell(self, updater: Any) -> Cell:
        """Rank 0's cell of ``updater`` (made at its first update)."""
        cell = updater.__dict__.get("_weightbus_cell")
        if cell is None:
            with self._lock:
                cell, self._spare = self._spare, None
                if cell is None:
                    cell = Cell(self.settings, self.args)
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
        session: Session | None = None
        if rank0:
            session = Session(self.cell(updater), updater, runtime, plan_update(updater, kind, runtime, self.labelling))
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
        run_original(updater, original, session)
        updater.weight_version = shared

    def _update_delta(self, updater: Any, original: Callable[[Any], None], runtime: Runtime) -> None:
        """The disk delta: miles' count names the files; the bus's number labels the engines, entered at the pause.

        Before miles writes a file, clears the delta dir or calls an engine, rank 0 claims (a cell's
        first baseline) or checks the fence, claiming again if miles picked this cell again
        (``Cell.check_owner``), and every rank learns the outcome (one broadcast): a fenced cell
        raises on every rank with the shared chain untouched.
        """
        rank0 = runtime.rank() == 0
        chain = updater.__dict__.get("_weightbus_chain", updater.weight_version)
        updater.weight_version = chain
        baseline = not getattr(updater, "_baseline_captured", False)
        session: Session | None = None
        if rank0:
            cell = self.cell(updater)
            session = Session(cell, updater, runtime, Plan("full", False, None), lazy=True, baseline=baseline)
            try:
                if baseline and not cell.publisher.state.started:
                    try:  # the first claim, before any engine is touched; the first real update retries it
                        session.version = cell.ready(updater, runtime).state.version
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
                        session.version = cell.publisher.state.version
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
        run_original(updater, original, session)
        updater.__dict__["_weightbus_chain"] = updater.weight_version
        mine = None
        if session is not None:
            mine = session.version
            if mine is None and session.cell.publisher.state.started:
                mine = session.cell.publisher.state.version  # nothing was loaded: the bus's number still holds
            if mine is None:
                mine = updater.weight_version  # nothing was ever announced: miles' baseline 0
        shared = runtime.share(mine)
        updater.weight_version = shared if isinstance(shared, int) else updater.weight_version


def _serves_announced(version: int | None, updater: Any, runtime: Runtime) -> bool:
    """Whether every engine already carries ``version`` (announced on the bus), read on rank 0 once."""
    if not version:
        return False
    handles = [real_handle(h) for h in getattr(updater, "rollout_engines", None) or ()]
    labels = runtime.ray_get([h.get_weight_version.remote() for h in handles]) if handles else []
    answered = [label for label in labels if label is not None]  # a multi-node engine's other nodes: None
    return bool(answered) and all(str(label) == str(version) for label in answered)
