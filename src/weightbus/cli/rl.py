"""``weightbus rollout`` and ``weightbus trainer``: the two processes of the RL loop, each launchable alone.

One config from ``--config FILE``, then the flags on top (one per field, derived from it: ``cli.config_flags``),
checked before anything starts. Exit codes: docs/cli.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Final

import typer

from weightbus.bus import subjects
from weightbus.bus.options import ConnectOptions
from weightbus.cli._common import VerboseOption, fail, run_async, setup_logging, start_metrics, with_connection
from weightbus.cli.config_flags import ConfigFlags, Flag
from weightbus.errors import ConfigError, InvalidPolicyError
from weightbus.rl.config import MIN_SHARED_LEASE_S, ROUTER_WAIT_S, RolloutConfig, TrainerConfig

__all__ = [
    "EXIT_DENIED",
    "EXIT_ENGINE",
    "EXIT_FENCED",
    "EXIT_NATS",
    "ROLLOUT_FLAGS",
    "TRAINER_FLAGS",
    "register",
    "rollout_command",
    "trainer_command",
]

#: Another trainer took the counter over.
EXIT_FENCED: Final = 3
#: An engine push failed or an engine is out of sync.
EXIT_ENGINE: Final = 4
#: NATS unreachable.
EXIT_NATS: Final = 5
#: The user may not use a subject the process needs (``PermissionDeniedError``).
EXIT_DENIED: Final = 77


QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress lines on stderr.")]


def _check(config: RolloutConfig | TrainerConfig, where: Callable[[str], str]) -> None:
    """The checks a field's own type cannot make; each names the flag. Raises ConfigError."""
    try:
        subjects.validate_policy(config.policy)
    except InvalidPolicyError as exc:
        raise ConfigError(f"{where('policy')}: {exc}") from None
    if isinstance(config, RolloutConfig) and config.admission_shared and config.admission_lease_s <= MIN_SHARED_LEASE_S:
        raise ConfigError(
            f"{where('admission_lease_s')} is {config.admission_lease_s:g}: with --admission-shared a lease must "
            f"be longer than {MIN_SHARED_LEASE_S:g} s (three times the budget's 1 s clock-skew allowance)"
        )


#: One flag per field of each config; only ``cap`` is not called after its field (``--admission-cap``).
ROLLOUT_FLAGS: Final = ConfigFlags(RolloutConfig, {"cap": Flag(("--admission-cap",))}, check=_check)
TRAINER_FLAGS: Final = ConfigFlags(TrainerConfig, {"run_dir": Flag(path=True)}, check=_check)


@ROLLOUT_FLAGS
def rollout_command(
    config: RolloutConfig,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    router_wait: Annotated[
        float,
        typer.Option("--router-wait", min=0, help="Seconds to wait at start for the router to answer, then exit 1."),
    ] = ROUTER_WAIT_S,
    quiet: QuietOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Keep prompt groups in flight through the router, judge drains against the live version, serve batches.

    Exit codes: 1 the router did not answer within --router-wait, 2 bad arguments or the metrics port cannot be
    bound, 5 NATS unreachable, 77 permission denied, 130/143 interrupted.
    """
    setup_logging(verbose)
    from prometheus_client import CollectorRegistry

    from weightbus.errors import BusConnectError, EngineError, PermissionDeniedError, TaskLoadError
    from weightbus.process.progress import ProgressPrinter
    from weightbus.rl.rollout import RolloutProgress, run_rollout
    from weightbus.rl.task import load_task

    try:
        loaded = load_task(config.task)
    except TaskLoadError as exc:
        raise fail(str(exc), 2) from None
    registry = CollectorRegistry()
    start_metrics(config.metrics_port, registry, config.metrics_host)
    with ProgressPrinter("rollout", quiet=quiet) as printer:

        def progress(p: RolloutProgress) -> None:
            printer.report(
                {
                    "batch": p.batches,
                    "judged_at": p.judged_at,
                    "kept": p.kept,
                    "recycled": p.recycled,
                    "dropped": p.dropped,
                    "staleness_max": p.staleness_max,
                    "tokens": p.tokens_generated,
                }
            )

        try:
            run_async(
                run_rollout(
                    config,
                    task=loaded,
                    connection=connection,
                    registry=registry,
                    progress=progress,
                    router_wait_s=router_wait,
                )
            )
        except EngineError as exc:
            raise fail(str(exc)) from None
        except PermissionDeniedError as exc:
            raise fail(str(exc), EXIT_DENIED) from None
        except BusConnectError as exc:
            raise fail(str(exc), EXIT_NATS) from None


@TRAINER_FLAGS
def trainer_command(
    config: TrainerConfig,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    quiet: QuietOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Train the policy on drained batches; after each step push, stamp, verify and publish the weights."""
    setup_logging(verbose)
    from prometheus_client import CollectorRegistry

    from weightbus.bus.metrics import BusMetrics
    from weightbus.errors import BusConnectError, EngineError, FencedError, PermissionDeniedError
    from weightbus.process.progress import ProgressPrinter

    try:
        from weightbus.rl.trainer import TrainerProgress, run_trainer
    except ImportError as exc:
        raise fail(f"the trainer needs the 'rl' extra (torch, safetensors): {exc}", 2) from None
    registry = CollectorRegistry()
    start_metrics(config.metrics_port, registry, config.metrics_host)
    with ProgressPrinter("trainer", total=config.steps, quiet=quiet) as printer:

        def progress(p: TrainerProgress) -> None:
            fields = {"step": f"{p.step}/{p.steps}", "version": p.version, "reward": p.reward}
            fields |= {"staleness_max": p.staleness_max, "judged_staleness_max": p.judged_staleness_max}
            fields |= {"step_ms": round(p.step_s * 1000)}
            printer.report(fields, completed=p.step)

        try:
            version = run_async(
                run_trainer(
                    config, connection=connection, metrics=BusMetrics(registry), registry=registry, progress=progress
                )
            )
        except FencedError as exc:
            raise fail(str(exc), EXIT_FENCED) from None
        except EngineError as exc:
            raise fail(str(exc), EXIT_ENGINE) from None
        except PermissionDeniedError as exc:
            raise fail(str(exc), EXIT_DENIED) from None
        except BusConnectError as exc:
            raise fail(str(exc), EXIT_NATS) from None
    typer.echo(f"trained {config.steps} steps; last version v{version}")


def register(app: typer.Typer) -> None:
    """Add ``rollout`` and ``trainer`` to ``app``."""
    app.command("rollout")(with_connection(rollout_command))
    app.command("trainer")(with_connection(trainer_command))
