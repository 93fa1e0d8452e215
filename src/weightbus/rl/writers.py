"""The demo's report files: ``report.json`` and ``report.png`` of one run, the staleness and admission trade-offs'
of several.

The figures are drawn with matplotlib (imported here only, on the Agg backend): reward per step against the
staleness trained on, on integer ticks with the bound drawn, faults marked; for the staleness trade-off, reward
against wall time per bound next to the share of generated tokens never trained on; for the admission trade-off,
reward against wall time per bound and mode, the share of tokens not trained on and the generated tokens per
second, each mode next to the filter alone (``off``) at the same bound.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from weightbus.rl.report import TIME_FIELDS, DemoResult

__all__ = [
    "ADMISSION_MODES",
    "admission_numbers",
    "plot_report",
    "tradeoff_numbers",
    "write_admission_tradeoff",
    "write_report",
    "write_tradeoff",
]

#: The admission modes the trade-off compares, the baseline (the filter alone) first.
ADMISSION_MODES = ("off", "cap", "bounded")
_SMOOTH = 5


def _trained_staleness(row: dict[str, Any]) -> int | None:
    known = [row["trained_under"] - g["oldest"] for g in row["groups"] if g["oldest"] is not None]
    return max(known) if known else None


def write_report(result: DemoResult, out_dir: Path) -> None:
    """Write ``report.json`` and ``report.png`` (reward and staleness per step, faults marked) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [
        {
            k: row[k]
            for k in (
                "step",
                "version",
                "reward",
                "staleness_avg",
                "staleness_max",
                "kept",
                "recycled",
                "dropped",
                "step_s",
                "weightbus_s",
                "batch_wait_s",
                "trained_under",
            )
        }
        | {"lag_s": row.get("lag_s")}
        | {key: row.get(key) for key in TIME_FIELDS}
        | {"trained_staleness_max": _trained_staleness(row)}
        for row in result.rows
    ]
    body = {
        "config": result.config,
        "summary": result.summary,
        "faults": result.faults,
        "problems": result.problems,
        "ok": result.ok,
        "steps": steps,
    }
    (out_dir / "report.json").write_text(json.dumps(body, indent=2) + "\n")
    fig = plot_report(result)
    fig.savefig(out_dir / "report.png", dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def plot_report(result: DemoResult) -> Any:
    """The report's figure: reward per step, and staleness per step on integer ticks with the bound drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [row["step"] for row in result.rows]
    ax.plot(xs, [row["reward"] for row in result.rows], color="tab:blue", label="mean reward")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward", color="tab:blue")
    ax2 = ax.twinx()
    ax2.step(
        xs,
        [_trained_staleness(row) or 0 for row in result.rows],
        color="tab:orange",
        where="mid",
        label="max staleness trained on",
    )
    ax2.plot(
        xs,
        [row["staleness_max"] or 0 for row in result.rows],
        color="tab:orange",
        alpha=0.5,
        ls=":",
        label="max staleness judged (recycled too)",
    )
    bound = result.config.get("max_staleness")
    if bound is not None:
        ax2.axhline(bound, color="tab:red", lw=1, alpha=0.6, label=f"bound (max_staleness {bound})")
        ax2.set_ylim(bottom=0, top=max(ax2.get_ylim()[1], bound + 0.5))
    # Staleness counts versions: whole numbers only.
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("staleness (versions)", color="tab:orange")
    ax2.legend(loc="lower right", fontsize=7)
    for fault in result.faults:
        ax.axvline(fault["step"], color="red", ls="--", lw=1)
        ax.annotate(
            fault["kind"], (fault["step"], ax.get_ylim()[1]), fontsize=7, color="red", rotation=90, va="top", ha="right"
        )
    ax.set_title("weightbus demo: reward and staleness per step")
    fig.tight_layout()
    return fig


def _training_clock(rows: list[dict[str, Any]]) -> list[float]:
    """Seconds since the first step began, at the end of each step."""
    if not rows:
        return []
    origin = rows[0]["time"] - rows[0]["step_s"]
    return [row["time"] - origin for row in rows]


def tradeoff_numbers(results: dict[int, DemoResult]) -> dict[str, Any]:
    """Per staleness bound: reward against wall time, the final reward, and the share of tokens not trained on."""
    out: dict[str, Any] = {}
    for bound, result in sorted(results.items()):
        clock = _training_clock(result.rows)
        out[str(bound)] = {
            "reward_first": result.summary["reward_first"],
            "reward_last": result.summary["reward_last"],
            "wall_s": clock[-1] if clock else None,
            "tokens_generated": result.summary["tokens_generated"],
            "tokens_wasted_share": result.summary["tokens_wasted_share"],
            "staleness_avg": result.summary["staleness_avg"],
            "ok": result.ok,
            "curve": [[t, row["reward"]] for t, row in zip(clock, result.rows, strict=True)],
        }
    return out


def write_tradeoff(results: dict[int, DemoResult], out_dir: Path) -> dict[str, Any]:
    """Write ``staleness-tradeoff.json`` and ``staleness-tradeoff.png`` (reward against wall time per bound, and
    the share of generated tokens wasted on recycled or dropped groups); returns the numbers."""
    numbers = tradeoff_numbers(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "staleness-tradeoff.json").write_text(json.dumps(numbers, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for bound, entry in numbers.items():
        curve = entry["curve"]
        window = 5
        smooth = [statistics.fmean(r for _, r in curve[max(0, i - window + 1) : i + 1]) for i in range(len(curve))]
        left.plot([t for t, _ in curve], smooth, label=f"max_staleness {bound}")
    left.set_xlabel("wall time since training began (s)")
    left.set_ylabel("mean reward (5-step moving average)")
    left.legend()
    bounds = list(numbers)
    right.bar(bounds, [(numbers[b]["tokens_wasted_share"] or 0) * 100 for b in bounds], color="tab:red")
    right.set_xlabel("max_staleness")
    right.set_ylabel("% of generated tokens not trained on")
    fig.suptitle("weightbus: the staleness trade-off")
    fig.tight_layout()
    fig.savefig(out_dir / "staleness-tradeoff.png", dpi=100)
    plt.close(fig)
    return numbers


def _reward_at(curve: list[list[float]], t: float) -> float | None:
    """The mean reward of the last ``_SMOOTH`` steps that ended by wall time ``t``."""
    done = [r for at, r in curve if at <= t]
    return statistics.fmean(done[-_SMOOTH:]) if done else None


def admission_numbers(results: dict[tuple[str, int], DemoResult]) -> dict[str, Any]:
    """Per admission mode and bound: tokens not trained on, generated tokens per second, reward against wall time;
    and per bound, each mode against the filter alone (``off``) after the same wall time.

    Returns:
        ``{"runs": {mode: {bound: {...}}}, "versus_off": {bound: {mode: {...}}}}``: ``tokens_not_trained_share``
        is the share of generated tokens the trainer never got (recycled, dropped, aborted, or left over);
        ``reward_at_common_s`` is the reward (``_SMOOTH``-step mean) at the shortest wall time of the bound's runs.
    """
    runs: dict[str, dict[str, Any]] = {}
    for (mode, bound), result in sorted(
        results.items(), key=lambda item: (ADMISSION_MODES.index(item[0][0]), item[0][1])
    ):
        clock = _training_clock(result.rows)
        wall = clock[-1] if clock else None
        s = result.summary
        runs.setdefault(mode, {})[str(bound)] = {
            "reward_first": s["reward_first"],
            "reward_last": s["reward_last"],
            "wall_s": wall,
            "tokens_generated": s["tokens_generated"],
            "tokens_not_trained_share": s["tokens_wasted_share"],
            "tokens_not_trained_by_reason": s.get("tokens_not_trained_by_reason", {}),
            "generated_tokens_per_s": s["tokens_generated"] / wall if wall else None,
            "trained_tokens_per_s": (
                s["tokens_generated"] * (1 - (s["tokens_wasted_share"] or 0)) / wall if wall else None
            ),
            "early_aborts": s.get("early_aborts", 0),
            "tokens_saved": s.get("tokens_saved", 0),
            "staleness_avg": s["staleness_avg"],
            "in_flight_versions_avg": s.get("in_flight_versions_avg"),
            "in_queue_versions_avg": s.get("in_queue_versions_avg"),
            "kept_share_by_length": s.get("kept_share_by_length", {}),
            "kept_share_by_reward": s.get("kept_share_by_reward", {}),
            "ok": result.ok,
            "curve": [[t, row["reward"]] for t, row in zip(clock, result.rows, strict=True)],
        }
    versus: dict[str, Any] = {}
    bounds = sorted({bound for _, bound in results})
    for bound in bounds:
        key = str(bound)
        entries = {mode: runs[mode][key] for mode in runs if key in runs[mode]}
        walls = [e["wall_s"] for e in entries.values() if e["wall_s"]]
        if "off" not in entries or not walls:
            continue
        common = min(walls)
        base = entries["off"]
        base_reward = _reward_at(base["curve"], common)
        rows: dict[str, Any] = {"common_s": common}
        for mode, e in entries.items():
            reward = _reward_at(e["curve"], common)
            rate, base_rate = e["generated_tokens_per_s"], base["generated_tokens_per_s"]
            trained, base_trained = e["trained_tokens_per_s"], base["trained_tokens_per_s"]
            rows[mode] = {
                "tokens_not_trained_share": e["tokens_not_trained_share"],
                "reward_at_common_s": reward,
                "reward_vs_off": None if reward is None or base_reward is None else reward - base_reward,
                "generated_tokens_per_s": rate,
                "rate_vs_off": rate / base_rate if rate and base_rate else None,
                "trained_tokens_per_s": trained,
                "trained_rate_vs_off": trained / base_trained if trained and base_trained else None,
            }
        versus[key] = rows
    return {"runs": runs, "versus_off": versus, "targets": _targets(versus)}


#: The issue's targets for admission against the filter alone: tokens not trained on below these shares.
_WASTE_TARGETS = {"0": 0.05, "1": 0.01}


def _targets(versus: dict[str, Any]) -> dict[str, Any]:
    """Each mode against the filter alone at bounds 0 and 1: tokens not trained on below 5 % and 1 %, reward
    after the same wall time no lower, generated tokens per second at least 90 % of off's."""
    out: dict[str, Any] = {}
    for bound, limit in _WASTE_TARGETS.items():
        rows = versus.get(bound)
        if rows is None:
            continue
        for mode, row in rows.items():
            if mode in ("common_s", "off"):
                continue
            share, reward, rate = row["tokens_not_trained_share"], row["reward_vs_off"], row["rate_vs_off"]
            out.setdefault(bound, {})[mode] = {
                "tokens_not_trained": share is not None and share < limit,
                "reward_no_lower": reward is not None and reward >= 0,
                "rate_at_least_90_percent": rate is not None and rate >= 0.9,
            }
    return out


def write_admission_tradeoff(results: dict[tuple[str, int], DemoResult], out_dir: Path) -> dict[str, Any]:
    """Write ``admission-tradeoff.json`` and ``admission-tradeoff.png``; returns the numbers (``admission_numbers``)."""
    numbers = admission_numbers(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "admission-tradeoff.json").write_text(json.dumps(numbers, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = numbers["runs"]
    modes = [m for m in ADMISSION_MODES if m in runs]
    bounds = sorted({int(b) for m in modes for b in runs[m]})
    fig = plt.figure(figsize=(4 * max(2, len(bounds)), 7.5))
    grid = fig.add_gridspec(2, max(2, len(bounds)))
    styles = {"off": ("tab:gray", "--"), "cap": ("tab:orange", "-."), "bounded": ("tab:blue", "-")}
    for i, bound in enumerate(bounds):
        ax = fig.add_subplot(grid[0, i])
        for mode in modes:
            entry = runs[mode].get(str(bound))
            if entry is None:
                continue
            curve = entry["curve"]
            smooth = [statistics.fmean(r for _, r in curve[max(0, j - _SMOOTH + 1) : j + 1]) for j in range(len(curve))]
            color, ls = styles.get(mode, ("black", "-"))
            ax.plot([t for t, _ in curve], smooth, color=color, ls=ls, label=mode)
        ax.set_title(f"max_staleness {bound}")
        ax.set_xlabel("wall time since training began (s)")
        if i == 0:
            ax.set_ylabel(f"mean reward ({_SMOOTH}-step moving average)")
        ax.legend(fontsize=7)
    half = max(2, len(bounds)) // 2
    waste = fig.add_subplot(grid[1, :half])
    rate = fig.add_subplot(grid[1, half:])
    width = 0.8 / max(1, len(modes))
    for k, mode in enumerate(modes):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(bounds))]
        entries = [runs[mode].get(str(b), {}) for b in bounds]
        color = styles.get(mode, ("black", "-"))[0]
        waste.bar(xs, [(e.get("tokens_not_trained_share") or 0) * 100 for e in entries], width, color=color, label=mode)
        rate.bar(xs, [e.get("generated_tokens_per_s") or 0 for e in entries], width, color=color, label=mode)
    for ax, label in ((waste, "% of generated tokens not trained on"), (rate, "generated tokens per second")):
        ax.set_xticks(range(len(bounds)), [str(b) for b in bounds])
        ax.set_xlabel("max_staleness")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("weightbus: admission against the filter alone (off), per staleness bound")
    fig.tight_layout()
    fig.savefig(out_dir / "admission-tradeoff.png", dpi=100)
    plt.close(fig)
    return numbers
