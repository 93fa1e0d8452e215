"""``Runtime``: miles' own ``torch.distributed``, gloo group and ``ray.get``, as a patched module has them.

The integration never imports miles, torch or ray: these objects come from the module globals of the
miles modules being patched, so it uses exactly the ones miles uses. ``share`` is the one collective
the integration adds (rank 0's value on every rank of the cell).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from weightbus.schemas import ClaimStanding

__all__ = ["LORA_NAME", "Runtime"]

log = logging.getLogger("weightbus.integrations.miles")

#: miles' adapter name when the mixin module does not say (``miles.utils.lora.LORA_ADAPTER_NAME``).
LORA_NAME: Final = "miles_lora"


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
