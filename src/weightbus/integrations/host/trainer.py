"""The trainer half of a host drop-in at run time: each patched ``update_weights`` runs here.

Every host updater runs through ``VersionUpdate`` (one ``SyncVersionPublisher`` per cell, on rank 0): the number is
the bus's, shared with every rank before any pushes; the host's pause, relabel and resume become the protocol's; a
failure quarantines. The host, torch and ray come from the patched modules' globals. A host says how its updaters
map onto the protocol (``plan``); the rest is here once. docs/integrations/miles.md, docs/integrations/slime.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar

from weightbus.bus.options import redact_url
from weightbus.errors import BusError
from weightbus.integrations.host.cell import Cell
from weightbus.integrations.host.identity import Host
from weightbus.integrations.host.plan import Plan
from weightbus.integrations.host.proxies import real_handle
from weightbus.integrations.host.runtime import Runtime
from weightbus.integrations.host.session import Session, run_original
from weightbus.integrations.host.settings import DropInSettings
from weightbus.producers.sync import SyncVersionPublisher

__all__ = ["DELTA", "HostTrainer"]

#: The kind of a disk-delta updater: the host's count names the files, the bus's number labels the engines.
DELTA = "delta"


class HostTrainer:
    """The integration in one training actor's process: its settings, and each updater's cell.

    Made by the host's ``install``; one per process. Each weight updater the host builds gets its own
    ``Cell`` on rank 0 (one ``SyncVersionPublisher``: one claim of the counter), made at its first update;
    the connection rank 0 opened at install is handed to the first one. A host subclass sets ``host`` and
    says how an update maps onto the protocol (``plan``).

    Attributes:
        settings: what was configured.
        labelling: the updater classes whose full push carries ``weight_version`` (a host's NCCL broadcast).
    """

    host: ClassVar[Host]
    #: The install targets (by class name) whose full push carries ``weight_version``: ``labelling`` holds them.
    labelled: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, args: Any, settings: DropInSettings) -> None:
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
        """Close every cell of this process (publishers' bus connections and private loops, the metrics server)."""
        with self._lock:
            cells = [*self._cells, *([self._spare] if self._spare is not None else [])]
            self._cells.clear()
            self._spare = None
        for cell in cells:
            cell.close()

    def connect_if_rank0(self, runtime: Runtime) -> None:
        """On rank 0, connect to the bus now (an unreachable bus is an error at init, not at the first update)."""
        if runtime.rank() != 0:
            return
        with self._lock:
            if self._spare is None and not self._cells:
                self._spare = Cell(self.host, self.settings, self.args)
            spare = self._spare
        if spare is not None:
            try:
                spare.publisher.connect()
            except BusError as exc:
                exc.add_note(
                    f"weightbus' {self.host.name} install connects rank 0 to {redact_url(self.settings.nats)} at init "
                    "(WEIGHTBUS_NATS, WEIGHTBUS_CONNECT_TIMEOUT); nothing was patched"
                )
                with self._lock:
                    self._spare = None
                spare.close()
                raise

    def cell(self, updater: Any) -> Cell:
        """Rank 0's cell of ``updater`` (made at its first update)."""
        cell: Cell | None = updater.__dict__.get("_weightbus_cell")
        if cell is None:
            with self._lock:
                cell, self._spare = self._spare, None
                if cell is None:
                    cell = Cell(self.host, self.settings, self.args)
                self._cells.append(cell)
            updater.__dict__["_weightbus_cell"] = cell
        return cell

    # -- the update --------------------------------------------------------------------------------------

    def found(self, name: str, cls: type) -> None:
        """The install resolved target ``name`` to ``cls`` (a labelling class joins ``labelling``)."""
        if name in self.labelled:
            self.labelling.add(cls)

    def plan(self, updater: Any, kind: str, runtime: Runtime) -> Plan:
        """How ``updater``'s update of ``kind`` (its install target's) maps onto the protocol: the host's to say."""
        raise NotImplementedError

    def update(self, updater: Any, original: Callable[[Any], None], kind: str, runtime: Runtime) -> None:
        """One host ``update_weights`` call on this rank, under weightbus' protocol (see the module)."""
        if kind == DELTA:
            self._update_delta(updater, original, runtime)
            return
        rank0 = runtime.rank() == 0
        session: Session | None = None
        if rank0:
            try:
                session = Session(self.cell(updater), updater, runtime, self.plan(updater, kind, runtime))
                session.enter()
            except BaseException as exc:
                runtime.share(f"{type(exc).__name__}: {exc}")  # the other ranks raise instead of waiting
                raise
            shared = runtime.share(session.version)
        else:
            shared = runtime.share(None)
        if not isinstance(shared, int):
            raise RuntimeError(f"rank 0 could not take a weight version from weightbus: {shared}")
        updater.weight_version = shared - 1  # the host's own `weight_version += 1` makes it the bus's number
        run_original(updater, original, session)
        updater.weight_version = shared

    def _update_delta(self, updater: Any, original: Callable[[Any], None], runtime: Runtime) -> None:
        """The disk delta: the host's count names the files; the bus's number labels the engines, entered at the pause.

        Before the host writes a file, clears the delta dir or calls an engine, rank 0 claims (a cell's
        first baseline) or checks the fence, claiming again if the host picked this cell again
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
                        self.host.log.warning(
                            "could not claim the counter at the disk-delta baseline; the first update retries",
                            extra={"policy": self.policy, "error": str(exc)},
                        )
                else:
                    # Fenced, or claimed again if the host picked this cell again; before it writes a file
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
                raise RuntimeError(f"rank 0 refused the disk-delta update before it wrote anything: {refused}")
        run_original(updater, original, session)
        updater.__dict__["_weightbus_chain"] = updater.weight_version
        mine = None
        if session is not None:
            mine = session.version
            if mine is None and session.cell.publisher.state.started:
                mine = session.cell.publisher.state.version  # nothing was loaded: the bus's number still holds
            if mine is None:
                mine = updater.weight_version  # nothing was ever announced: the host's baseline 0
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
