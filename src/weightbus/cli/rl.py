"""``weightbus rollout`` and ``weightbus trainer``: the two processes of the RL loop, each launchable alone.

One config from ``--config FILE``, then the flags on top, checked before anything starts. Exit codes: docs/cli.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec
import typer

from weightbus.bus import subjects
from weightbus.bus.options import ConnectOptions
from weightbus.cli._common import (
    MetricsHostOption,
    MetricsPortOption,
    VerboseOption,
    check_nats_url,
    fail,
    run_async,
    setup_logging,
    start_metrics,
    with_connection,
)
from weightbus.errors import ConfigError, InvalidPolicyError
from weightbus.rl.config import MIN_SHARED_LEASE_S, RolloutConfig, TrainerConfig, load_config, make_config

__all__ = ["EXIT_DENIED", "EXIT_ENGINE", "EXIT_FENCED", "EXIT_NATS", "register", "rollout_command", "trainer_command"]

#: Another trainer took the counter over.
EXIT_FENCED: Final = 3
#: An engine push failed or an engine is out of sync.
EXIT_ENGINE: Final = 4
#: NATS unreachable.
EXIT_NATS: Final = 5
#: The user may not use a subject the process needs (``PermissionDeniedError``).
EXIT_DENIED: Final = 77


def _default(kind: type[Any], name: str) -> str:
    """The field's default as help text: the flag has none of its own, so the config's shows."""
    (field,) = (f for f in msgspec.structs.fields(kind) if f.name == name)
    return f" (default: {field.default})"


def _r(name: str) -> str:
    return _default(RolloutConfig, name)


def _t(name: str) -> str:
    return _default(TrainerConfig, name)


ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="JSON file of the process's config (flags given override its fields).", exists=True),
]
RouterUrl = Annotated[str | None, typer.Option("--router", help="The SGLang router (http://host:port).")]
NatsUrl = Annotated[
    str | None,
    typer.Option(
        "--nats",
        "--server",
        "-s",
        envvar=["WEIGHTBUS_NATS", "NATS_URL"],
        callback=check_nats_url,
        help="NATS URL (or several, comma-separated) (default: nats://127.0.0.1:4222).",
    ),
]
PolicyRequired = Annotated[
    str | None,
    typer.Option("--policy", envvar="WEIGHTBUS_POLICY", show_envvar=True, help="Policy id (required)."),
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress lines on stderr.")]


#: The flag of each config field whose flag is not ``--<field-with-dashes>``; None: the field has no flag.
_FLAGS: Final[dict[str, str | None]] = {
    "router_url": "--router",
    "nats_url": "--nats",
    "cap": "--admission-cap",
    "admission_lease_s": None,
    "temperature": None,
    "clip": None,
    "consumer": None,
    "freeze_heap": None,
    "early_abort": None,
}
_AT_FIELD = re.compile(r"\s*-\s*at `\$\.(?P<field>[a-z_]+)`")


def _where(field: str) -> str:
    """How an operator names ``field``: its flag (or ``"field" in --config``) and the config key."""
    flag = _FLAGS.get(field, "--" + field.replace("_", "-"))
    return f'{flag} (or "{field}" in --config)' if flag is not None else f'"{field}" in --config'


def _check(config: Any) -> None:
    """The checks a field's own type cannot make; each names the flag. Raises ConfigError."""
    try:
        subjects.validate_policy(config.policy)
    except InvalidPolicyError as exc:
        raise ConfigError(f"{_where('policy')}: {exc}") from None
    if isinstance(config, RolloutConfig) and config.admission_shared and config.admission_lease_s <= MIN_SHARED_LEASE_S:
        raise ConfigError(
            f"{_where('admission_lease_s')} is {config.admission_lease_s:g}: with --admission-shared a lease must "
            f"be longer than {MIN_SHARED_LEASE_S:g} s (three times the budget's 1 s clock-skew allowance)"
        )


def _build(kind: type[Any], config_file: Path | None, **given: Any) -> Any:
    try:
        base = load_config(config_file, kind) if config_file is not None else None
        config = make_config(kind, base, **given)
        _check(config)
        return config
    except ConfigError as exc:
        message = str(exc)
        if "missing required field `policy`" in message:
            message = '--policy is required (or WEIGHTBUS_POLICY, or "policy" in --config)'
        elif "missing required field `router_url`" in message:
            message = '--router is required (or "router_url" in --config)'
        elif "missing required field `run_dir`" in message:
            message = '--run-dir is required (or "run_dir" in --config)'
        elif (at := _AT_FIELD.search(message)) is not None:
            # msgspec names the field by its JSON path; the operator typed a flag.
            message = f"{_where(at.group('field'))}: {message[: at.start()]}{message[at.end() :]}"
        raise fail(message, 2) from None


def rollout_command(
    config_file: ConfigOption = None,
    router_url: RouterUrl = None,
    nats_url: NatsUrl = None,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    policy: PolicyRequired = None,
    task: Annotated[
        str | None, typer.Option("--task", help="The task, as package.module:factory." + _r("task"))
    ] = None,
    group_size: Annotated[
        int | None, typer.Option("--group-size", help="Samples per prompt group." + _r("group_size"))
    ] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="Groups per training batch." + _r("batch"))] = None,
    in_flight: Annotated[
        int | None, typer.Option("--in-flight", help="Prompt groups generated at once." + _r("in_flight"))
    ] = None,
    max_staleness: Annotated[
        int | None, typer.Option("--max-staleness", help="Largest staleness kept." + _r("max_staleness"))
    ] = None,
    on_stale: Annotated[
        str | None, typer.Option("--on-stale", help="recycle or drop what is not kept." + _r("on_stale"))
    ] = None,
    admission: Annotated[
        str | None,
        typer.Option(
            "--admission",
            help="Pace generation: bounded (by the staleness budget), cap (--admission-cap running groups) or off."
            + _r("admission"),
        ),
    ] = None,
    cap: Annotated[
        int | None, typer.Option("--admission-cap", help="The cap mode's limit on running groups." + _r("cap"))
    ] = None,
    admission_shared: Annotated[
        bool | None,
        typer.Option(
            "--admission-shared/--no-admission-shared",
            help="Share one admission budget with the policy's other rollout processes over NATS."
            + _r("admission_shared"),
            show_default=False,
        ),
    ] = None,
    follow_lora: Annotated[
        bool | None,
        typer.Option(
            "--follow-lora/--no-follow-lora",
            help="Generate with the LoRA adapter each announced version names." + _r("follow_lora"),
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seeds the prompt stream." + _r("seed"))] = None,
    router_wait: Annotated[
        float,
        typer.Option("--router-wait", min=0, help="Seconds to wait at start for the router to answer, then exit 1."),
    ] = 30.0,
    metrics_port: MetricsPortOption = None,
    metrics_host: MetricsHostOption = None,  # type: ignore[assignment]
    quiet: QuietOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Keep prompt groups in flight through the router, judge drains against the live version, serve batches.

    Exit codes: 1 the router did not answer within --router-wait, 2 bad arguments or the metrics port cannot be
    bound, 5 NATS unreachable, 77 permission denied, 130/143 interrupted.
    """
    setup_logging(verbose)
    config: RolloutConfig = _build(
        RolloutConfig,
        config_file,
        router_url=router_url,
        nats_url=nats_url,
        policy=policy,
        task=task,
        group_size=group_size,
        batch=batch,
        in_flight=in_flight,
        max_staleness=max_staleness,
        on_stale=on_stale,
        admission=admission,
        cap=cap,
        admission_shared=admission_shared,
        follow_lora=follow_lora,
        seed=seed,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
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


def trainer_command(
    config_file: ConfigOption = None,
    router_url: RouterUrl = None,
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="Checkpoint, steps.jsonl and weight files (required).")
    ] = None,
    nats_url: NatsUrl = None,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    policy: PolicyRequired = None,
    steps: Annotated[
        int | None, typer.Option("--steps", help="Train until this many steps are checkpointed." + _t("steps"))
    ] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="Groups per step." + _t("batch"))] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Initial weights (the engines' --seed)." + _t("seed"))
    ] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Adam learning rate." + _t("lr"))] = None,
    lora_rank: Annotated[
        int | None, typer.Option("--lora-rank", help="Train and push a LoRA adapter of this rank instead.")
    ] = None,
    lora_prefix: Annotated[
        str | None,
        typer.Option(
            "--lora-prefix", help="Adapter name prefix on the engines (<prefix>-v<version>)." + _t("lora_prefix")
        ),
    ] = None,
    trainer_id: Annotated[
        str | None, typer.Option("--trainer-id", help="Identity on the bus (default: host:pid).")
    ] = None,
    metrics_port: MetricsPortOption = None,
    metrics_host: MetricsHostOption = None,  # type: ignore[assignment]
    quiet: QuietOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Train the policy on drained batches; after each step push, stamp, verify and publish the weights."""
    setup_logging(verbose)
    config: TrainerConfig = _build(
        TrainerConfig,
        config_file,
        router_url=router_url,
        run_dir=str(run_dir) if run_dir is not None else None,
        nats_url=nats_url,
        policy=policy,
        steps=steps,
        batch=batch,
        seed=seed,
        lr=lr,
        lora_rank=lora_rank,
        lora_prefix=lora_prefix,
        trainer_id=trainer_id,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
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
