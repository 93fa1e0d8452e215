"""One call per step to the loggers RL users already read: Weights & Biases and TensorBoard, both optional.

``StepLogger(wandb=run, tensorboard=writer).log(step, drain=..., update=...)`` flattens a drain's metrics (miles'
``rollout/fully_async/*`` names and ``weightbus/*``, as ``DrainStats.metrics`` gives them) and an update's phases
(``VersionUpdate.phases`` as ``weightbus/update/<phase>_seconds``) into one dict and hands it to each logger given.
Neither package is a dependency: they are imported only by ``StepLogger.open``, which creates the run or the writer,
and a missing one is an ``OptionalDependencyError``. The inputs are typed by shape, so this imports no other layer.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from weightbus.errors import OptionalDependencyError

__all__ = ["HasMetrics", "HasPhases", "ScalarWriter", "StepLogger", "WandbRun", "step_metrics"]

# The prefix of an update's phases among the step's metrics.
_UPDATE_PREFIX = "weightbus/update/"


class WandbRun(Protocol):
    """What ``StepLogger`` uses of a W&B run (``wandb.init()``'s result)."""

    def log(self, data: dict[str, Any], step: int | None = None) -> Any: ...  # noqa: D102


class ScalarWriter(Protocol):
    """What ``StepLogger`` uses of a TensorBoard ``SummaryWriter`` (torch's or tensorboardX's)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...  # noqa: D102


class HasMetrics(Protocol):
    """A drain's outcome: ``DrainStats``, ``Drain``, ``Judgement`` (their flat ``metrics``)."""

    @property
    def metrics(self) -> Mapping[str, float]: ...  # noqa: D102


class HasPhases(Protocol):
    """An update that ran: ``VersionUpdate`` or ``SyncUpdate`` (seconds by phase)."""

    @property
    def phases(self) -> Mapping[str, float]: ...  # noqa: D102


def step_metrics(
    *,
    drain: HasMetrics | Mapping[str, float] | None = None,
    update: HasPhases | Mapping[str, float] | None = None,
    extra: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """The step's metrics as one flat dict of floats (pure).

    Args:
        drain: a drain's outcome, or its ``metrics`` dict (names kept as they are).
        update: an update that ran, or its ``phases`` (``weightbus/update/<phase>_seconds``).
        extra: the trainer's own values (loss, reward), added as they are named; they win a clash.
    """
    out: dict[str, float] = {}
    if drain is not None:
        metrics = drain if isinstance(drain, Mapping) else drain.metrics
        out.update((name, float(value)) for name, value in metrics.items())
    if update is not None:
        phases = update if isinstance(update, Mapping) else update.phases
        out.update((f"{_UPDATE_PREFIX}{phase}_seconds", float(seconds)) for phase, seconds in phases.items())
    if extra is not None:
        out.update((name, float(value)) for name, value in extra.items())
    return out


def _optional(module: str, attr: str, package: str, feature: str) -> Any:
    """``module.attr``, imported now; a missing package is an ``OptionalDependencyError`` naming ``package``."""
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise OptionalDependencyError(package, feature) from exc


class StepLogger:
    """Logs each step's metrics (``step_metrics``) to a W&B run and a TensorBoard writer, either or both.

    Args:
        wandb: a W&B run (``run.log(metrics, step=step)``), or None.
        tensorboard: a ``SummaryWriter`` (one ``add_scalar(name, value, step)`` per metric), or None.

    Borrowed loggers are not closed here; those ``open()`` created are, by ``close()``.
    """

    def __init__(self, *, wandb: WandbRun | None = None, tensorboard: ScalarWriter | None = None) -> None:
        self.wandb = wandb
        self.tensorboard = tensorboard
        self._owned: list[Any] = []  # how to end what open() created: the writer's close, the run's finish

    @classmethod
    def open(
        cls,
        *,
        wandb_project: str | None = None,
        tensorboard_dir: str | Path | None = None,
        wandb_init: Mapping[str, Any] | None = None,
    ) -> StepLogger:
        """Create the W&B run (``wandb.init(project=..., **wandb_init)``) and the TensorBoard writer, and log to them.

        Raises:
            OptionalDependencyError: ``wandb``, or ``tensorboard`` (torch's writer needs it), is not installed.
        """
        logger = cls()
        if tensorboard_dir is not None:
            writer_class = _optional("torch.utils.tensorboard", "SummaryWriter", "tensorboard", "TensorBoard logging")
            writer = writer_class(log_dir=str(tensorboard_dir))
            logger.tensorboard = writer
            logger._owned.append(writer.close)
        if wandb_project is not None:
            init = _optional("wandb", "init", "wandb", "W&B logging")
            try:
                run = init(project=wandb_project, **dict(wandb_init or {}))
            except BaseException:
                logger.close()
                raise
            logger.wandb = run
            logger._owned.append(run.finish)
        return logger

    def log(
        self,
        step: int,
        *,
        drain: HasMetrics | Mapping[str, float] | None = None,
        update: HasPhases | Mapping[str, float] | None = None,
        extra: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Log one step's metrics to every logger given; returns them (see ``step_metrics``)."""
        metrics = step_metrics(drain=drain, update=update, extra=extra)
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)
        if self.tensorboard is not None:
            for name, value in metrics.items():
                self.tensorboard.add_scalar(name, value, step)
        return metrics

    def close(self) -> None:
        """Close the writer and finish the run ``open()`` created (borrowed ones stay open)."""
        owned, self._owned = self._owned, []
        for end in owned:
            end()

    def __enter__(self) -> StepLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
