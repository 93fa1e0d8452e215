"""``Runtime``: a host's own ``torch.distributed``, gloo group and ``ray.get``, as a patched module has them.

The integration never imports a host, torch or ray: these objects come from the module globals of the
host modules being patched, so it uses exactly the ones the host uses. ``share`` is the one collective
the integration adds (rank 0's value on every rank of the cell).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightbus.schemas import ClaimStanding

__all__ = ["Runtime"]


@dataclass(frozen=True, slots=True)
class Runtime:
    """A host's own ``torch.distributed``, gloo group and ``ray.get``, from the globals of a patched module.

    Attributes:
        dist: ``torch.distributed`` as the host imports it.
        gloo: the host's ``get_gloo_group``.
        ray_get: ``ray.get`` as the host imports it.
        lora_name: the engines' name for the host's single LoRA adapter.
        standing_of: where the host's group puts this cell now (``standing``), or None when the host does
            not say (then a fenced cell never claims again).
    """

    dist: Any
    gloo: Callable[[], Any]
    ray_get: Callable[[Any], Any]
    lora_name: str
    standing_of: Callable[[], ClaimStanding | None] | None = None

    def standing(self) -> ClaimStanding | None:
        """Where the host's group puts this cell now (its driver's job, quorum id, alive rank), or None.

        Only a cell whose standing outranks the owner's claims again once fenced (``Cell.check_owner``).
        """
        return self.standing_of() if self.standing_of is not None else None

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
