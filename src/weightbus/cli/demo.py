"""``weightbus demo``: supervise the fully-async RL loop as separate processes (what ``make demo`` runs).

Its flags are ``DemoConfig``'s fields (``cli.config_flags``), plus the comparisons, which run several configs.
"""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

import msgspec
import typer

from weightbus.cli._common import VerboseOption, fail, setup_logging
from weightbus.cli.config_flags import ConfigFlags, Flag
from weightbus.cli.exits import signal_exit_code
from weightbus.demo.config import DemoConfig

if TYPE_CHECKING:
    from weightbus.rl.report import DemoResult

__all__ = ["DEMO_FLAGS", "demo_command", "register"]

#: What the demo's processes import: the reference engine's server, torch, safetensors and the router.
_EXTRAS = ("starlette", "uvicorn", "torch", "safetensors", "sglang_router")


#: One flag per field of ``DemoConfig``, but its policy (internal to the demo's own NATS, so no ``--policy``
#: with ``WEIGHTBUS_POLICY`` to leak in from the shell); ``out_dir`` is ``--out``, ``cap`` ``--admission-cap`` as on
#: ``weightbus rollout``.
DEMO_FLAGS: Final = ConfigFlags(
    DemoConfig,
    {"out_dir": Flag(("--out",), path=True), "cap": Flag(("--admission-cap",)), "policy": None},
    config_file=False,
)


@DEMO_FLAGS
def demo_command(
    config: DemoConfig,
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
    from weightbus.demo import run_demo
    from weightbus.errors import DemoError

    out = Path(config.out_dir or ".")
    if compare_bounds is not None:
        _compare_admission(compare_bounds, config, out=out, repeats=repeats)
        return
    if compare_staleness is not None:
        _compare(_bounds(compare_staleness, "--compare-staleness"), config, out=out)
        return
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


def _trial(config: DemoConfig, **changes: object) -> DemoConfig:
    """One run of a comparison: ``config`` with ``changes``, and no fault (a trade-off compares settings, not
    recoveries)."""
    no_faults = dict.fromkeys(("failover_at", "kill_nats_at", "restart_rollout_at", "restart_engine_at"))
    return msgspec.structs.replace(config, faults=False, **no_faults, **changes)


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
        f"restarted engines caught up from the bus: {len(s.get('restart_caught_up', []))}; "
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


def _compare(bounds: list[int], base: DemoConfig, *, out: Path) -> None:
    from weightbus.demo import run_demo
    from weightbus.errors import DemoError
    from weightbus.rl.writers import write_tradeoff

    results = {}
    for bound in bounds:
        typer.echo(f"== max_staleness {bound}")
        config = _trial(base, max_staleness=bound, out_dir=str(out / f"staleness-{bound}"))
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


def _compare_admission(bounds: list[int], base: DemoConfig, *, out: Path, repeats: int) -> None:
    """Each repeat runs every bound and mode once, so the modes compared at a bound ran minutes apart at most;
    ``off`` is the filter alone (no admission, no early abort), as before admission."""
    from weightbus.demo import run_demo
    from weightbus.errors import DemoError
    from weightbus.rl.writers import ADMISSION_MODES, write_admission_tradeoff

    results: dict[tuple[str, int], list[DemoResult]] = {}
    for repeat in range(repeats):
        for bound in bounds:
            for mode in ADMISSION_MODES:
                typer.echo(f"== repeat {repeat + 1}/{repeats}, max_staleness {bound}, admission {mode}")
                suffix = "" if repeats == 1 else f"-r{repeat + 1}"
                config = _trial(
                    base,
                    max_staleness=bound,
                    seed=base.seed + repeat,
                    out_dir=str(out / f"admission-{mode}-{bound}{suffix}"),
                    admission=mode,
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
