"""The demo's one config object, and the plan of faults it injects (by default each once, at spread steps)."""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from weightbus.rl.config import MAX_GROUP_SIZE, MAX_IN_FLIGHT

__all__ = ["FAULTS", "DemoConfig"]

#: The faults, in the order of their default steps.
FAULTS: Final = ("failover", "kill-nats", "restart-rollout", "restart-engine")


class DemoConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One demo run (each field declared once: its description is its ``weightbus demo`` flag's help).

    A field the demo hands to its rollout or trainer has that config's constraints (``MAX_IN_FLIGHT``,
    ``MAX_GROUP_SIZE``), so a value the child would refuse is refused here, before anything starts.
    """

    steps: Annotated[int, Meta(ge=2, description="Training steps.")] = 80
    max_staleness: Annotated[int, Meta(ge=0, description="The rollout's bound: the largest staleness kept.")] = 1
    on_stale: Annotated[
        Literal["recycle", "drop"], Meta(description="recycle or drop the groups the rollout does not keep.")
    ] = "recycle"
    seed: Annotated[int, Meta(description="Initial weights, sampler and prompt stream.")] = 0
    group_size: Annotated[int, Meta(ge=2, le=MAX_GROUP_SIZE, description="Samples per prompt group.")] = 8
    batch: Annotated[int, Meta(ge=1, description="Groups per training batch.")] = 8
    in_flight: Annotated[
        int, Meta(ge=1, le=MAX_IN_FLIGHT, description="Prompt groups the rollout generates at once.")
    ] = 4
    lr: Annotated[float, Meta(gt=0, description="The trainer's learning rate.")] = 0.05
    lora_rank: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Train and push a LoRA adapter of this rank instead of the full weights."),
    ] = None
    out_dir: Annotated[
        str | None, Meta(description="Where report.json and report.png go (in the library, None writes nothing).")
    ] = "demo-report"
    faults: Annotated[
        bool,
        Meta(
            description="Inject every fault at its default step; --no-faults runs clean (a fault given a step "
            "below is injected regardless)."
        ),
    ] = True
    failover_at: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="SIGKILL the trainer after this step; a new one resumes from the checkpoint."),
    ] = None
    kill_nats_at: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Kill nats-server after this step and restart it on its store."),
    ] = None
    restart_rollout_at: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="SIGKILL the rollout after this step and start a new one."),
    ] = None
    restart_engine_at: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="SIGKILL engine 0 after this step; it boots as default."),
    ] = None
    policy: Annotated[str, Meta(description="The policy id of the run (on the demo's own NATS).")] = "demo"
    admission: Annotated[
        Literal["off", "cap", "bounded"],
        Meta(
            description="The rollout's admission: bounded by the staleness budget, cap at most --admission-cap "
            "groups running, off the filter alone (generate, then judge)."
        ),
    ] = "bounded"
    cap: Annotated[
        Annotated[int, Meta(ge=1, le=MAX_IN_FLIGHT)] | None,
        Meta(description="The cap mode's limit on running groups (default: half of in_flight, at least 1)."),
    ] = None
    early_abort: Annotated[
        bool,
        Meta(
            description="Abort groups at the engines once they are certain to exceed the bound, and recycle "
            "their prompts."
        ),
    ] = True

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
