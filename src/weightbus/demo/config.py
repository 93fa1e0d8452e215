"""The demo's one config object, and the plan of faults it injects (by default each once, at spread steps)."""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

__all__ = ["FAULTS", "DemoConfig"]

#: The faults, in the order of their default steps.
FAULTS: Final = ("failover", "kill-nats", "restart-rollout", "restart-engine")


class DemoConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One demo run."""

    steps: Annotated[int, Meta(ge=2)] = 80
    """Training steps."""
    max_staleness: Annotated[int, Meta(ge=0)] = 1
    """The rollout's bound."""
    on_stale: Literal["recycle", "drop"] = "recycle"
    """What the rollout does with groups it does not keep."""
    seed: int = 0
    """Initial weights, sampler and prompt stream."""
    group_size: Annotated[int, Meta(ge=2)] = 8
    batch: Annotated[int, Meta(ge=1)] = 8
    in_flight: Annotated[int, Meta(ge=1)] = 4
    lr: Annotated[float, Meta(gt=0)] = 0.05
    """The trainer's learning rate."""
    lora_rank: Annotated[int, Meta(ge=1)] | None = None
    """Train and push a LoRA adapter of this rank instead of the full weights."""
    out_dir: str | None = "demo-report"
    """Where ``report.json`` and ``report.png`` go (None: write nothing)."""
    faults: bool = True
    """Inject every fault at its default step (those with an explicit step are injected regardless)."""
    failover_at: Annotated[int, Meta(ge=1)] | None = None
    """SIGKILL the trainer after this step; a new one resumes from the checkpoint."""
    kill_nats_at: Annotated[int, Meta(ge=1)] | None = None
    """Kill nats-server after this step and restart it on its store."""
    restart_rollout_at: Annotated[int, Meta(ge=1)] | None = None
    """SIGKILL the rollout after this step and start a new one."""
    restart_engine_at: Annotated[int, Meta(ge=1)] | None = None
    """SIGKILL engine 0 after this step; it boots as ``default``."""
    policy: str = "demo"
    """The policy id of the run."""
    admission: Literal["off", "cap", "bounded"] = "bounded"
    """The rollout's admission: ``bounded`` by the staleness budget, ``cap`` at most ``cap`` groups running,
    ``off`` the filter alone (generate, then judge)."""
    cap: Annotated[int, Meta(ge=1)] | None = None
    """The ``cap`` mode's limit on running groups (default: half of ``in_flight``, at least 1)."""
    early_abort: bool = True
    """Abort groups at the engines once they are certain to exceed the bound, and recycle their prompts."""

    @property
    def rollout_cap(self) -> int | None:
        """The cap the rollout gets: ``cap``, or its default in ``cap`` mode; None in the other modes."""
        if self.admission != "cap":
            return self.cap
        return self.cap if self.cap is not None else max(1, self.in_flight // 2)

    def fault_plan(self) -> dict[str, int]:
        """Each fault to inject and the step after which it happens."""
        explicit = {
            "failover": self.failover_at,
            "kill-nats": self.kill_nats_at,
            "restart-rollout": self.restart_rollout_at,
            "restart-engine": self.restart_engine_at,
        }
        plan = {}
        for k, name in enumerate(FAULTS, start=1):
            at = explicit[name]
            if at is None and self.faults:
                at = _spread_step(self.steps, k, len(FAULTS) + 1)
            if at is not None:
                plan[name] = at
        return plan


def _spread_step(steps: int, k: int, parts: int) -> int:
    """The ``k``-th of ``parts - 1`` steps spread over ``1..steps-1`` (the last step is left fault-free)."""
    return max(1, min(steps - 1, round(steps * k / parts)))
