"""``weightbus demo``: the main job on an embedded NATS (what ``make demo`` runs).

The command checks for the ``engine`` extra before starting anything, and runs the demo with Python's
temporary directory pointed at a private one that is removed afterwards, so a run (finished, failed
or interrupted) leaves nothing under the system's temporary directory. Exit codes: 0 every invariant
held, 1 an invariant broke or the demo failed, 2 bad arguments or the engine extra is missing,
130/143 interrupted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from weightbus.cli._common import (
    EXIT_USAGE,
    MetricsHostOption,
    MetricsPortOption,
    VerboseOption,
    check_nats_url,
    fail,
    run_async,
    setup_logging,
)
from weightbus.errors import BusError

__all__ = ["register"]


@contextmanager
def _private_tempdir() -> Iterator[str]:
    """Point ``tempfile`` at a fresh directory for the duration, then remove it with everything in it."""
    saved = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="weightbus-demo-run-", ignore_cleanup_errors=True) as tmp:
        tempfile.tempdir = tmp
        try:
            yield tmp
        finally:
            tempfile.tempdir = saved


def _missing_engine_extra(model: str) -> list[str]:
    needed = ["starlette", "uvicorn"] + (["torch"] if model == "torch" else [])
    return [name for name in needed if importlib.util.find_spec(name) is None]


def demo_command(
    steps: Annotated[int, typer.Option("--steps", min=2, help="Training steps (one drain and one push each).")] = 6,
    engines: Annotated[int, typer.Option("--engines", min=1, help="CPU reference engines to start.")] = 2,
    model: Annotated[
        str, typer.Option("--model", help="Engine model: hash (no torch) or torch (a tiny CPU torch LM).")
    ] = "torch",
    max_staleness: Annotated[int, typer.Option("--max-staleness", min=0, help="Largest staleness kept.")] = 1,
    on_stale: Annotated[str, typer.Option("--on-stale", help="recycle or drop groups that are not kept.")] = "recycle",
    nats: Annotated[
        str | None,
        typer.Option(
            "--nats", envvar="WEIGHTBUS_NATS", help="Use this NATS instead of an embedded one.", callback=check_nats_url
        ),
    ] = None,
    metrics_port: MetricsPortOption = None,
    metrics_host: MetricsHostOption = "127.0.0.1",
    verbose: VerboseOption = 0,
) -> None:
    """Run a fully-async RL loop on this machine and show weightbus controlling its staleness.

    Starts an embedded nats-server and CPU reference engines (SGLang 0.5.23 API), then a trainer that
    pauses, pushes, stamps, verifies, publishes and resumes the engines each step, and a rollout manager
    that drains groups judged against the live version. Mid-run the training cell fails over (the new cell
    resumes the counter, the old one is fenced), one push is a LoRA adapter, and at the end a rogue
    publisher announces version 1 (held and alerted).

    Exit codes: 0 every invariant held, 1 an invariant broke or the demo failed, 2 bad arguments or the
    engine extra is missing, 130/143 interrupted.
    """
    setup_logging(verbose)
    if model not in ("hash", "torch"):
        raise fail(f"--model must be hash or torch, not {model!r}", EXIT_USAGE)
    if on_stale not in ("recycle", "drop"):
        raise fail(f"--on-stale must be recycle or drop, not {on_stale!r}", EXIT_USAGE)
    missing = _missing_engine_extra(model)
    if missing:
        raise fail(
            f"the demo needs the 'engine' extra ({', '.join(missing)} missing): pip install 'weightbus[engine]'",
            EXIT_USAGE,
        )
    try:
        from weightbus.demo import DemoConfig, run_demo
    except ImportError as exc:
        raise fail(f"the demo needs the 'engine' extra: {exc}", EXIT_USAGE) from None

    # The demo module decides where its metrics bind; pass the host on when it takes one.
    extra: dict[str, object] = {}
    if "metrics_host" in {f.name for f in dataclasses.fields(DemoConfig)}:
        extra["metrics_host"] = metrics_host
    elif metrics_host != "127.0.0.1":
        raise fail("this demo serves metrics on 127.0.0.1 only; --metrics-host is not supported", EXIT_USAGE)
    config = DemoConfig(
        **extra,  # type: ignore[arg-type]
        steps=steps,
        engines=engines,
        model=model,  # type: ignore[arg-type]
        max_staleness=max_staleness,
        on_stale=on_stale,  # type: ignore[arg-type]
        nats_url=nats,
        metrics_port=metrics_port,
        failover_at=min(3, steps - 1),
        lora_at=steps - 1 if steps >= 4 else None,
    )
    try:
        with _private_tempdir():
            result = run_async(run_demo(config, emit=typer.echo))
    except ImportError as exc:
        raise fail(f"the demo needs the 'engine' extra: {exc}", EXIT_USAGE) from None
    except (BusError, OSError, RuntimeError) as exc:
        raise fail(f"the demo failed: {exc}", 1) from None
    typer.echo("")
    typer.echo(
        f"final version v{result.final_version}; tracker v{result.tracker_version}; "
        f"{result.groups_generated} groups generated; regressions counted {result.regressions:.0f}; "
        + (f"mean publish-to-observe lag {result.lag_mean_ms:.2f} ms" if result.lag_mean_ms is not None else "")
    )
    if result.problems:
        for problem in result.problems:
            typer.echo(f"PROBLEM: {problem}", err=True)
        raise typer.Exit(1)
    typer.echo(
        "every invariant held: versions only moved forward across the failover, no kept group was "
        f"older than {max_staleness} version(s), the rogue regression was held and alerted."
    )


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command("demo")(demo_command)
