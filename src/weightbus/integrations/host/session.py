"""``Session``: rank 0's side of one host update: its ``SyncUpdate``, and what the host's engine calls turn into.

For the length of the host's ``update_weights`` rank 0's engine handles are proxies (module ``proxies``)
whose calls go through ``Session.intercept``: the host's ``pause_generation`` becomes weightbus' pause
(taken with the number), its ``update_weight_version`` is dropped (weightbus stamps and reads back),
and its first ``continue_generation`` ends the update (stamp, verify, announce, then resume). An
exception out of the host's update aborts it (quarantine and resume); the update ends once, either way.
miles and slime drive their engines with the same calls (slime's disk delta is miles' too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from weightbus.integrations.host.cell import Cell
from weightbus.integrations.host.plan import Plan
from weightbus.integrations.host.proxies import proxied
from weightbus.integrations.host.runtime import Runtime
from weightbus.producers.sync import SyncUpdate

__all__ = ["Session", "run_original"]


def run_original(updater: Any, original: Callable[[Any], None], session: Session | None) -> None:
    """Run the host's ``update_weights`` with rank 0's engine calls through ``session``, and end the update."""
    try:
        with proxied(updater, session, _INTERCEPTED):
            original(updater)
    except BaseException as exc:
        if session is not None:
            session.abort(exc)
        raise
    if session is not None:
        session.commit()  # the host never resumed (no continue_generation): close the update now


class Session:
    """Rank 0's side of one update: the ``SyncUpdate`` and what the host's engine calls turn into."""

    def __init__(
        self,
        cell: Cell,
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
        self.update: SyncUpdate | None = None
        self.version: int | None = None
        self.closed = False
        self.keep = False  # a disk-delta baseline whose engines already serve the announced version
        self.fence_checked = False

    def enter(self) -> None:
        """Take the number, pause, mark the engines pending (``Cell.enter``)."""
        self.update = self.cell.enter(self.updater, self.runtime, self.plan)
        self.version = self.update.version

    def _exit(self, exc: BaseException | None) -> None:
        update = self.update
        if update is None or self.closed:
            return
        self.closed = True  # before the call: a failing exit quarantined already and must not run twice
        if exc is None:
            update.commit()
        else:
            update.abort(exc)

    def commit(self) -> None:
        """Stamp, read back, announce, resume (``SyncUpdate.commit``)."""
        self._exit(None)

    def abort(self, exc: BaseException) -> None:
        """Quarantine and resume after ``exc`` (``SyncUpdate.abort``); never raises over ``exc``."""
        try:
            self._exit(exc)
        except Exception as cleanup:  # the cleanup's own failure is a note on the error that caused it
            exc.add_note(f"weightbus' quarantine after the failed update failed too: {cleanup!r}")

    def intercept(self, name: str, handle: Any, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What the host's call ``handle.<name>.remote(*args, **kwargs)`` does during this update."""
        if self.baseline:
            if name == "update_weights_from_disk" and self.keep:
                # --check-weight-update-equal reloads the boot checkpoint to undo the checker's reset at
                # the run's first sync; engines that serve an announced version were never reset, and
                # a reload would take them back to the boot weights: they keep what they serve.
                return handle.get_weight_version.remote()
            # Otherwise the host's reload of the boot checkpoint keeps the host's "0": version 0 is the
            # pre-training baseline, what the reload loads (judged the oldest there is).
            return method.remote(*args, **kwargs)
        if name == "pull_weights" and self.update is None and not self.fence_checked:
            self.fence_checked = True  # the files are written; the engines are not touched yet: check again
            self.cell.check_owner(self.updater, self.runtime)
        if self.closed and name in _LOADS:
            raise RuntimeError(f"the host called {name} after the update was announced; it was not sent")
        if self.update is None and self.lazy and name in _STARTS:
            self.enter()  # the disk delta's pause, or a load that comes first: take, pause, mark pending
        if name == "pause_generation":
            return handle.get_weight_version.remote()  # weightbus paused the engines with the take
        if name == "update_weight_version":
            return handle.get_weight_version.remote()  # weightbus stamps, and reads back
        if name == "continue_generation":
            if self.update is None:
                raise RuntimeError("the host resumed its engines in an update weightbus never entered")
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
