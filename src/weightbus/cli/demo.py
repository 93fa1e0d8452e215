"""``weightbus demo``: supervise the fully-async RL loop as separate processes (what ``make demo`` runs)."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from weightbus.cli._common import VerboseOption, fail, setup_logging
from weightbus.cli.exits import signal_exit_code

if TYPE_CHECKING:
    from weightbus.rl.report import DemoResult

__all__ = ["demo_command", "register"]

#: What the demo's processes import: the reference engine's server, torch, safetensors and the router.
_EXTRAS = ("starlette", "uvicorn", "torch", "safetensors", "sglang_router")


def demo_command(
    steps: Annotated[int, typer.Option("--steps", min=2, help="Training steps.")] = 80,
    max_staleness: Annotated[int, typer.Option("--max-staleness", min=0, help="Largest staleness kept.")] = 1,
    on_stale: Annotated[str, typer.Option("--on-stale", help="recycle or drop groups that are not kept.")] = "recycle",
    seed: Annotated[int, typer.Option("--seed", help="Weights, sampling and prompts.")] = 0,
    out: Annotated[Path, typer.Option("--out", help="Where report.json and report.png go.")] = Path("demo-report"),
    no_faults: Annotated[
        bool, typer.Option("--no-faults", help="A clean run: inject no fault but those given a step below.")
    ] = False,
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
    lora_rank: Annotated[
        int | None, typer.Option("--lora-rank", min=1, help="Train and push a LoRA adapter of this rank.")
    ] = None,
    admission: Annotated[
        str,
        typer.Option(
            "--admission",
            help="Pace generation: bounded (by the staleness budget), cap (a fixed number of groups running), "
            "or off (generate, then judge).",
        ),
    ] = "bounded",
    early_abort: Annotated[
        bool,
        typer.Option(
            "--early-abort/--no-early-abort",
            help="Abort groups at the engines once they are certain to exceed the bound; recycle their prompts.",
        ),
    ] = True,
    compare_admission: Annotated[
        str | None,
        typer.Option(
            "--compare-admission",
            help="Run once per bound (e.g. 0,1,2,4) and per admission mode (off, cap, bounded) and write "
            "OUT/admission-tradeoff.png and .json.",
        ),
    ] = None,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            min=1,
            help="With --compare-admission: run every bound and mode this many times (seeds SEED, SEED+1, ...), "
            "interleaved, and compare each mode with off repeat by repeat.",
        ),
    ] = 1,
    compare_staleness: Annotated[
        str | None,
        typer.Option(
            "--compare-staleness",
            help="Run once per bound (e.g. 0,1,2,4) and write OUT/staleness-tradeoff.png and .json.",
        ),
    ] = None,
    verbose: VerboseOption = 0,
) -> None:
    """Run a fully-async RL loop that learns: NATS, 2 engines, the SGLang router, rollout, trainer, recorder.

    By default it injects the four faults at spread steps (trainer failover, NATS kill, rollout restart, engine
    restart; --no-faults for a clean run, --X-at STEP to move one). Prints one line per step, writes
    OUT/report.json and OUT/report.png, says which checks held and which were vacuous (not exercised), and exits 1
    if an invariant broke (versions went backwards, a trained group exceeded the bound, an announced version was not
    on every engine, a fault was not survived, a restarted engine was not alerted).
    """
    setup_logging(verbose)
    if on_stale not in ("recycle", "drop"):
        raise fail("--on-stale must be recycle or drop", 2)
    if admission not in ("off", "cap", "bounded"):
        raise fail("--admission must be off, cap or bounded", 2)
    compare_bounds = None if compare_admission is None else _bounds(compare_admission, "--compare-admission")
    if repeats > 1 and compare_bounds is None:
        raise fail("--repeats only applies to --compare-admission", 2)
    missing = [name for name in _EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        raise fail(
            f"the demo needs the 'engine' and 'rl' extras ({', '.join(missing)} missing): "
            "pip install 'weightbus[engine,rl]'",
            2,
        )
    from weightbus.demo import DemoConfig, run_demo
    from weightbus.errors import DemoError

    if compare_bounds is not None:
        _compare_admission(compare_bounds, steps=steps, on_stale=on_stale, seed=seed, out=out, repeats=repeats)
        return
    if compare_staleness is not None:
        bounds = _bounds(compare_staleness, "--compare-staleness")
        _compare(bounds, steps=steps, on_stale=on_stale, seed=seed, out=out, admission=admission)
        return

    config = DemoConfig(
        steps=steps,
        max_staleness=max_staleness,
        on_stale=on_stale,  # type: ignore[arg-type]
        seed=seed,
        out_dir=str(out),
        faults=not no_faults,
        failover_at=failover_at,
        kill_nats_at=kill_nats_at,
        restart_rollout_at=restart_rollout_at,
        restart_engine_at=restart_engine_at,
        lora_rank=lora_rank,
        admission=admission,  # type: ignore[arg-type]
        early_abort=early_abort,
    )
    try:
        result = run_demo(config, emit=typer.echo)
    except DemoError as exc:
        raise fail(str(exc), 1) from None
    except KeyboardInterrupt as exc:
        sig = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
        raise typer.Exit(signal_exit_code(sig)) from None
    typer.echo("")
    _print_summary(result)
    typer.echo(f"report: {out / 'report.json'}, {out / 'report.png'}")
    _verdict(result)


def _print_summary(result: DemoResult) -> None:
    """The run's headline numbers: reward, staleness (trained, judged apart), lag, tokens not trained, alerts, time."""
    s = result.summary
    typer.echo(
        f"reward {s['reward_first']:.3f} (first quarter) -> {s['reward_last']:.3f} (last quarter); "
        f"final v{s['final_version']}; {_staleness(s)}; "
        f"publish-to-record lag p50 {s['propagation_lag_ms_p50'] or 0:.2f} ms; {_tokens(s)}; {s['wall_s']:.0f} s"
    )
    typer.echo(
        f"groups filtered for a non-version label ('default' after an engine restart): "
        f"{s['unknown_version_groups']}; engine-out-of-sync alerts: {s['engine_out_of_sync_alerts']} "
        f"({len(s['restart_alerts'])} naming a restarted engine); "
        f"regression alerts for the rogue v1: {s['regression_alerts']}"
    )
    if s["weightbus_share"] is not None:
        typer.echo(
            f"step time: weightbus's own {s['weightbus_share'] * 100:.2f}% "
            f"({s['weightbus_ms_mean']:.2f} ms of {s['step_ms_mean']:.0f} ms per step), "
            f"engines' HTTP inside update() {s['engine_http_share'] * 100:.1f}%, "
            f"the trainer's push {s['push_share'] * 100:.1f}%"
        )


def _staleness(s: dict[str, Any]) -> str:
    """The trained groups' staleness (what the bound holds for), and apart the judged groups', recycled ones too."""

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    return (
        f"staleness trained avg {num(s['trained_staleness_avg'], '.2f')} max {num(s['trained_staleness_max'], 'd')} "
        f"(judged max {num(s['judged_staleness_max'], 'd')})"
    )


def _tokens(s: dict[str, Any]) -> str:
    """The share of tokens not trained on, over every rollout process of the run."""
    processes = s["rollout_processes"]
    return (
        f"{(s['tokens_not_trained_share'] or 0) * 100:.0f}% of {s['tokens_generated']:,} tokens generated "
        f"(by {processes} rollout process{'es' if processes != 1 else ''}) not trained on"
    )


def _verdict(result: DemoResult) -> None:
    """Which checks held, which were vacuous (nothing exercised them), which failed; exit 1 on a failure."""
    by = {v: [name for name, verdict in result.checks.items() if verdict == v] for v in ("held", "vacuous", "failed")}
    if by["held"]:
        typer.echo("held: " + ", ".join(by["held"]))
    if by["vacuous"]:
        typer.echo("vacuous (not exercised by this run): " + ", ".join(by["vacuous"]))
    for name in by["failed"]:
        for problem in result.problems[name][:5]:
            typer.echo(f"BROKEN {name}: {problem}", err=True)
    if by["failed"]:
        raise typer.Exit(1)


def _bounds(text: str, flag: str) -> list[int]:
    try:
        bounds = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise fail(f"{flag} takes bounds like 0,1,2,4, not {text!r}", 2) from None
    if not bounds or min(bounds) < 0:
        raise fail(f"{flag} needs one or more bounds >= 0", 2)
    return bounds


def _compare(bounds: list[int], *, steps: int, on_stale: str, seed: int, out: Path, admission: str) -> None:
    from weightbus.demo import DemoConfig, run_demo
    from weightbus.errors import DemoError
    from weightbus.rl.writers import write_tradeoff

    results = {}
    for bound in bounds:
        typer.echo(f"== max_staleness {bound}")
        config = DemoConfig(
            steps=steps,
            max_staleness=bound,
            on_stale=on_stale,  # type: ignore[arg-type]
            seed=seed,
            out_dir=str(out / f"staleness-{bound}"),
            faults=False,  # the trade-off compares bounds, not recoveries
            admission=admission,  # type: ignore[arg-type]
        )
        try:
            results[bound] = run_demo(config, emit=lambda line: None)
        except DemoError as exc:
            raise fail(str(exc), 1) from None
        s = results[bound].summary
        typer.echo(
            f"   reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, {s['wall_s']:.0f} s, "
            f"{(s['tokens_not_trained_share'] or 0) * 100:.0f}% of tokens not trained on"
        )
    numbers = write_tradeoff(results, out)
    typer.echo("")
    typer.echo("max_staleness  reward(last quarter)  training s  tokens not trained on")
    for label, entry in numbers.items():
        typer.echo(
            f"{label:>13}  {entry['reward_last']:>20.3f}  {entry['wall_s']:>10.1f}  "
            f"{(entry['tokens_not_trained_share'] or 0) * 100:>20.0f}%"
        )
    typer.echo(f"report: {out / 'staleness-tradeoff.png'}, {out / 'staleness-tradeoff.json'}")
    if not all(r.ok for r in results.values()):
        raise typer.Exit(1)


def _compare_admission(bounds: list[int], *, steps: int, on_stale: str, seed: int, out: Path, repeats: int) -> None:
    """Each repeat runs every bound and mode once, so the modes compared at a bound ran minutes apart at most;
    ``off`` is the filter alone (no admission, no early abort), as before admission."""
    from weightbus.demo import DemoConfig, run_demo
    from weightbus.errors import DemoError
    from weightbus.rl.writers import ADMISSION_MODES, write_admission_tradeoff

    results: dict[tuple[str, int], list[DemoResult]] = {}
    for repeat in range(repeats):
        for bound in bounds:
            for mode in ADMISSION_MODES:
                typer.echo(f"== repeat {repeat + 1}/{repeats}, max_staleness {bound}, admission {mode}")
                suffix = "" if repeats == 1 else f"-r{repeat + 1}"
                config = DemoConfig(
                    steps=steps,
                    max_staleness=bound,
                    on_stale=on_stale,  # type: ignore[arg-type]
                    seed=seed + repeat,
                    out_dir=str(out / f"admission-{mode}-{bound}{suffix}"),
                    faults=False,  # the trade-off compares admission, not recoveries
                    admission=mode,  # type: ignore[arg-type]
                    early_abort=mode != "off",
                )
                try:
                    result = run_demo(config, emit=lambda line: None)
                except DemoError as exc:
                    raise fail(str(exc), 1) from None
                results.setdefault((mode, bound), []).append(result)
                s = result.summary
                typer.echo(
                    f"   reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, {s['wall_s']:.0f} s, "
                    f"{(s['tokens_not_trained_share'] or 0) * 100:.1f}% of tokens not trained on, "
                    f"{s['early_aborts']} early aborts"
                )
    numbers = write_admission_tradeoff(results, out)
    _admission_table(numbers)
    typer.echo(f"report: {out / 'admission-tradeoff.png'}, {out / 'admission-tradeoff.json'}")
    if not all(r.ok for each in results.values() for r in each):
        raise typer.Exit(1)


def _admission_table(numbers: dict[str, Any]) -> None:
    from weightbus.rl.writers import ADMISSION_MODES

    typer.echo("")
    typer.echo(
        "bound  mode     not trained  generated/s  (vs off)  trained/s  (vs off)  reward at common time  (vs off)"
    )
    for bound, rows in numbers["versus_off"].items():
        for mode in ADMISSION_MODES:
            row = rows.get(mode)
            if row is None:
                continue
            vs_rate = "" if row["rate_vs_off"] is None else f"{row['rate_vs_off'] * 100:.0f}%"
            vs_trained = "" if row["trained_rate_vs_off"] is None else f"{row['trained_rate_vs_off'] * 100:.0f}%"
            vs_reward = "" if row["reward_vs_off"] is None else f"{row['reward_vs_off']:+.3f}"
            if row["reward_vs_off_se"] is not None and mode != "off":
                vs_reward += f" ±{row['reward_vs_off_se']:.3f}"
            typer.echo(
                f"{bound:>5}  {mode:<7}  {(row['tokens_not_trained_share'] or 0) * 100:>10.1f}%  "
                f"{row['generated_tokens_per_s'] or 0:>11.0f}  {vs_rate:>8}  "
                f"{row['trained_tokens_per_s'] or 0:>9.0f}  {vs_trained:>8}  "
                f"{row['reward_at_common_s'] or 0:>21.3f}  {vs_reward:>8}"
            )
    if any(rows.get("repeats", 1) > 1 for rows in numbers["versus_off"].values()):
        typer.echo("(means over the repeats, each mode paired with off's run of the same repeat; ± one standard error)")


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command("demo")(demo_command)
