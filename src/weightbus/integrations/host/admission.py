"""The admission gate a host's rollout half asks for: one reading of the admission settings for every host.

``WEIGHTBUS_ADMISSION`` (``bounded``, ``cap``, ``off``), ``WEIGHTBUS_ADMISSION_CAP`` and ``WEIGHTBUS_ADMISSION_SHARED``
mean the same in every host; only the default cap (what the host's own worker keeps in flight) is the host's.
The gate is ``consumers.admission.Admission``; nothing here decides a slot. Flags: docs/integrations/miles.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightbus.consumers.admission import Admission, AdmissionMetrics, SharedBudget
from weightbus.integrations.host.settings import setting

if TYPE_CHECKING:
    from weightbus.bus.protocol import Bus

__all__ = ["admission_from_settings"]


def admission_from_settings(
    args: Any,
    *,
    version: Callable[[], int | None],
    bus: Bus,
    policy: str,
    name: str,
    default_cap: Callable[[], int],
    max_staleness: int | None,
    metrics: AdmissionMetrics | None = None,
) -> tuple[Admission, SharedBudget | None]:
    """The gate ``args`` and the environment ask for, and the shared budget behind it (None: this process alone).

    Args:
        args: the host's namespace (``weightbus_admission``, ``weightbus_admission_cap``,
            ``weightbus_admission_shared``, ``rollout_batch_size``), else the ``WEIGHTBUS_*`` variables.
        version: the version source the gate reads at each check (it raises when it cannot say: nothing admitted).
        bus: the connection a shared budget uses.
        policy: the policy the budget is shared within.
        name: this process' name in the shared budget.
        default_cap: the ``cap`` mode's limit when ``WEIGHTBUS_ADMISSION_CAP`` is unset (the host's own in-flight
            limit, in groups).
        max_staleness: the drain's bound (None: unlimited).
        metrics: counts the shared budget's rejections and starvation.

    Raises:
        ValueError: an unknown mode, a cap that is not a positive int, no ``rollout_batch_size``.
    """
    mode = setting(args, "weightbus_admission", "WEIGHTBUS_ADMISSION", "bounded")
    raw_cap = setting(args, "weightbus_admission_cap", "WEIGHTBUS_ADMISSION_CAP")
    cap = None
    if mode == "cap":
        try:
            cap = int(raw_cap) if raw_cap is not None else default_cap()
        except ValueError:
            raise ValueError(f"WEIGHTBUS_ADMISSION_CAP must be a number of groups, not {raw_cap!r}") from None
    shared = setting(args, "weightbus_admission_shared", "WEIGHTBUS_ADMISSION_SHARED", "0")
    budget = None
    if mode != "off" and (shared or "").lower() in ("1", "true", "yes"):
        budget = SharedBudget(bus, policy, name=name, metrics=metrics)
    gate = Admission(
        mode,  # type: ignore[arg-type]  # Admission checks it
        current=version,
        max_staleness=max_staleness,
        batch=args.rollout_batch_size,
        cap=cap,
        budget=budget,
    )
    return gate, budget
