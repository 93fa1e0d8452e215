"""``weightbus demo``: supervise the fully-async RL loop as separate processes (what ``make demo`` runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from weightbus.cli._common import VerboseOption, fail, setup_logging

__all__ = ["register"]

_FaultOption = Annotated[int | None, typer.Option(min=1)]


def demo_command(
    steps: Annotated[int, typer.Option("--steps", min=2, help="Training steps.")] = 40,
    max_staleness: Annotated[int, typer.Option("--max-staleness", min=0, help="Largest staleness kept.")] = 1,
    on_stale: Annotated[str, typer.Option("--on-stale", help="recycle or drop groups that are not kept.")] = "recycle",
    seed: Annotated[int, typer.Option("--seed", help="Weights, sampling and prompts.")] = 0,
    out: Annotated[Path, typer.Option("--out", help="Where report.json and report.png go.")] = Path("demo-report"),
    failover_at: Annotated[
        int | None, typer.Option("--failover-at", min=1, help="SIGKILL the trainer after STEP; a new one resumes.")
    ] = None,
    kill_nats_at: Annotated[
        int | None, typer.Option("--kill-nats-at", min=1, help="Kill nats-server after STEP; restart it on its store.")
    ] = None,
    restart_rollout_at: Annotated[
        int | None, typer.Option("--restart-rollout-at", min=1, help="SIGKILL the rollout after STEP; restart it.")
    ] = None,
    restart_engine_at: Annotated[
        int | None, typer.Option("--restart-engine-at", min=1, help="SIGKILL engine 0 after STEP; it boots 'default'.")
    ] = None,
    lora: Annotated[
        int | None, typer.Option("--lora", min=1, help="Train and push a LoRA adapter of this rank.")
    ] = None,
    verbose: VerboseOption = 0,
) -> None:
    """Run a fully-async RL loop that learns: NATS, 2 engines, the SGLang router, rollout, trainer, recorder.

    Prints one line per step, writes OUT/report.json and OUT/report.png, and exits 1 if an invariant broke
    (versions went backwards, a trained group exceeded the bound, an announced version was not on every engine,
    a fault was not survived).
    """
    setup_logging(verbose)
    if on_stale not in ("recycle", "drop"):
        raise fail("--on-stale must be recycle or drop", 2)
    from weightbus.demo import DemoConfig, DemoError, run_demo

    config = DemoConfig(
        steps=steps,
        max_staleness=max_staleness,
        on_stale=on_stale,
        seed=seed,
        out_dir=out,
        failover_at=failover_at,
        kill_nats_at=kill_nats_at,
        restart_rollout_at=restart_rollout_at,
        restart_engine_at=restart_engine_at,
        lora_rank=lora,
    )
    try:
        result = run_demo(config, emit=typer.echo)
    except DemoError as exc:
        raise fail(str(exc), 1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    s = result.summary
    typer.echo("")
    typer.echo(
        f"reward {s['reward_first']:.3f} (first quarter) -> {s['reward_last']:.3f} (last quarter); "
        f"final v{s['final_version']}; staleness avg {s['staleness_avg'] or 0:.2f} max {s['staleness_max']}; "
        f"publish-to-record lag p50 {s['propagation_lag_ms_p50'] or 0:.2f} ms; "
        f"{(s['tokens_wasted_share'] or 0) * 100:.0f}% of tokens not trained on; {s['wall_s']:.0f} s"
    )
    typer.echo(f"report: {out / 'report.json'}, {out / 'report.png'}")
    broken = {name: p for name, p in result.problems.items() if p}
    for name, problems in broken.items():
        for problem in problems[:5]:
            typer.echo(f"BROKEN {name}: {problem}", err=True)
    if broken:
        raise typer.Exit(1)
    typer.echo("every invariant held: " + ", ".join(result.problems))


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command("demo")(demo_command)
