"""``weightbus rollout`` and ``weightbus trainer``: the two processes of the RL loop, each launchable alone.

torch is imported by the trainer command only, after option parsing. Exit codes: 2 bad option or task,
3 fenced (another trainer took the counter over), 4 an engine push failed or is out of sync, 5 NATS unreachable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from weightbus.bus.options import ConnectOptions
from weightbus.cli._common import (
    DEFAULT_NATS,
    MetricsPortOption,
    NatsOption,
    PolicyOption,
    VerboseOption,
    fail,
    run_async,
    setup_logging,
    start_metrics,
    with_connection,
)

__all__ = ["register"]

RouterUrl = Annotated[str, typer.Option("--router", help="The SGLang router (http://host:port).")]
TaskOption = Annotated[
    str, typer.Option("--task", help="The task, as package.module:factory (default: reverse 3 digits).")
]


def _task(path: str):  # noqa: ANN202 - the Task protocol, imported lazily
    from weightbus.rl.task import TaskLoadError, load_task

    try:
        return load_task(path)
    except TaskLoadError as exc:
        raise fail(str(exc), 2) from None


def rollout_command(
    router: RouterUrl,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    policy: PolicyOption = "policy",
    task: TaskOption = "weightbus.rl.task:ReverseDigits",
    group_size: Annotated[int, typer.Option("--group-size", min=2, help="Samples per prompt group.")] = 8,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Groups per training batch.")] = 8,
    in_flight: Annotated[int, typer.Option("--in-flight", min=1, help="Prompt groups generated at once.")] = 4,
    max_staleness: Annotated[int, typer.Option("--max-staleness", min=0, help="Largest staleness kept.")] = 1,
    on_stale: Annotated[str, typer.Option("--on-stale", help="recycle or drop what is not kept.")] = "recycle",
    lora: Annotated[
        bool, typer.Option("--lora", help="Generate with the LoRA adapter each announced version names.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seeds the prompt stream.")] = 0,
    metrics_port: MetricsPortOption = None,
    verbose: VerboseOption = 0,
) -> None:
    """Keep prompt groups in flight through the router, judge drains against the live version, serve batches."""
    setup_logging(verbose)
    if on_stale not in ("recycle", "drop"):
        raise fail("--on-stale must be recycle or drop", 2)
    from prometheus_client import CollectorRegistry

    from weightbus.errors import BusConnectError
    from weightbus.rl.rollout import RolloutConfig, run_rollout

    config = RolloutConfig(
        nats_url=nats,
        connection=connection,
        router_url=router,
        policy=policy,
        task=_task(task),
        group_size=group_size,
        batch=batch,
        in_flight=in_flight,
        max_staleness=max_staleness,
        on_stale=on_stale,
        lora=lora,
        seed=seed,
        freeze_heap=True,
    )
    registry = CollectorRegistry()
    start_metrics(metrics_port, registry)
    try:
        run_async(run_rollout(config, registry=registry))
    except BusConnectError as exc:
        raise fail(str(exc), 5) from None


def trainer_command(
    router: RouterUrl,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Checkpoint, steps.jsonl and weight files.")],
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    policy: PolicyOption = "policy",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Train until this many steps are checkpointed.")] = 40,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Groups per step.")] = 8,
    seed: Annotated[int, typer.Option("--seed", help="Initial weights (the engines' --seed).")] = 0,
    lr: Annotated[float, typer.Option("--lr", help="Adam learning rate.")] = 0.05,
    lora_rank: Annotated[
        int | None, typer.Option("--lora", help="Train and push a LoRA adapter of this rank instead.")
    ] = None,
    lora_name: Annotated[
        str, typer.Option("--lora-name", help="Adapter name prefix on the engines (<name>-v<version>).")
    ] = "policy-lora",
    trainer_id: Annotated[str | None, typer.Option("--trainer-id", help="Identity on the bus.")] = None,
    verbose: VerboseOption = 0,
) -> None:
    """Train the policy on drained batches; after each step push, stamp, verify and publish the weights."""
    setup_logging(verbose)
    from weightbus.errors import BusConnectError, EngineError, FencedError

    try:
        from weightbus.rl.trainer import TrainerConfig, run_trainer
    except ImportError as exc:
        raise fail(f"the trainer needs the 'rl' extra (torch, safetensors): {exc}", 2) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    config = TrainerConfig(
        nats_url=nats,
        connection=connection,
        router_url=router,
        policy=policy,
        run_dir=run_dir,
        steps=steps,
        batch=batch,
        seed=seed,
        lr=lr,
        lora_rank=lora_rank,
        lora_name=lora_name,
        trainer_id=trainer_id,
    )
    try:
        version = run_async(run_trainer(config))
    except FencedError as exc:
        raise fail(str(exc), 3) from None
    except EngineError as exc:
        raise fail(str(exc), 4) from None
    except BusConnectError as exc:
        raise fail(str(exc), 5) from None
    typer.echo(f"trained {steps} steps; last version v{version}")


def register(app: typer.Typer) -> None:
    """Add ``rollout`` and ``trainer`` to ``app``."""
    app.command("rollout")(with_connection(rollout_command))
    app.command("trainer")(with_connection(trainer_command))
