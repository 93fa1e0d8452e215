"""The demo's report files: ``report.json`` and ``report.png`` of one run, and the trade-off figures of several."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightbus.rl.report import TIME_FIELDS, DemoResult, trained_staleness

__all__ = [
    "ADMISSION_MODES",
    "admission_numbers",
    "plot_admission_tradeoff",
    "plot_report",
    "reward_verdict",
    "tradeoff_numbers",
    "write_admission_tradeoff",
    "write_report",
    "write_tradeoff",
]

#: The admission modes the trade-off compares, the baseline (the filter alone) first.
ADMISSION_MODES = ("off", "cap", "bounded")
_SMOOTH = 5


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
        | dict(zip(("trained_staleness_avg", "trained_staleness_max"), trained_staleness(row), strict=True))
        # Over every group the drain judged, recycled and dropped ones too (the row's staleness_avg/max).
        | {"judged_staleness_avg": row["staleness_avg"], "judged_staleness_max": row["staleness_max"]}
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
        [trained_staleness(row)[1] or 0 for row in result.rows],
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
            "tokens_not_trained_share": result.summary["tokens_not_trained_share"],
            "trained_staleness_avg": result.summary["trained_staleness_avg"],
            "judged_staleness_avg": result.summary["judged_staleness_avg"],
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
    right.bar(bounds, [(numbers[b]["tokens_not_trained_share"] or 0) * 100 for b in bounds], color="tab:red")
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


def _run_entry(result: DemoResult) -> dict[str, Any]:
    """One run of the admission trade-off: its waste, rates and reward curve."""
    clock = _training_clock(result.rows)
    wall = clock[-1] if clock else None
    s = result.summary
    stepped = sum(row["step_s"] for row in result.rows)
    waited = sum(row.get("batch_wait_s") or 0.0 for row in result.rows)
    return {
        "seed": result.config.get("seed"),
        "reward_first": s["reward_first"],
        "reward_last": s["reward_last"],
        "wall_s": wall,
        "tokens_generated": s["tokens_generated"],
        "tokens_not_trained_share": s["tokens_not_trained_share"],
        "tokens_not_trained_by_reason": s.get("tokens_not_trained_by_reason", {}),
        "generated_tokens_per_s": s["tokens_generated"] / wall if wall else None,
        "trained_tokens_per_s": s["tokens_generated"] * (1 - (s["tokens_not_trained_share"] or 0)) / wall
        if wall
        else None,
        # At bound 0 only what is generated while the trainer waits for its batch can be trained: this share of
        # the training time caps what any admission can generate usefully.
        "batch_wait_share": waited / stepped if stepped else None,
        "early_aborts": s.get("early_aborts", 0),
        "tokens_saved": s.get("tokens_saved", 0),
        "trained_staleness_avg": s["trained_staleness_avg"],
        "judged_staleness_avg": s["judged_staleness_avg"],
        "in_flight_versions_avg": s.get("in_flight_versions_avg"),
        "in_queue_versions_avg": s.get("in_queue_versions_avg"),
        "kept_share_by_length": s.get("kept_share_by_length", {}),
        "kept_share_by_reward": s.get("kept_share_by_reward", {}),
        "ok": result.ok,
        "curve": [[t, row["reward"]] for t, row in zip(clock, result.rows, strict=True)],
    }


def _mean_of(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _se(values: list[float]) -> float | None:
    """The standard error of the mean of ``values`` (None below two)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


_SUMMED = ("tokens_generated", "early_aborts", "tokens_saved")
_SHARES = ("kept_share_by_length", "kept_share_by_reward")


def _aggregate(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one mode and bound: means (sums for counts, ranges for the main figures), and every run."""
    out: dict[str, Any] = {"repeats": entries}
    for key in entries[0]:
        if key in ("curve", "seed", "ok", "tokens_not_trained_by_reason") or key in _SHARES:
            continue
        values = [e[key] for e in entries]
        out[key] = sum(values) if key in _SUMMED else _mean_of(values)
        if key not in _SUMMED and all(v is not None for v in values):
            out[f"{key}_range"] = [min(values), max(values)]
    reasons: dict[str, int] = {}
    for e in entries:
        for reason, n in e["tokens_not_trained_by_reason"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    out["tokens_not_trained_by_reason"] = reasons
    for key in _SHARES:
        buckets = sorted({b for e in entries for b in e[key]})
        out[key] = {b: _mean_of([e[key].get(b) for e in entries]) for b in buckets}
    out["ok"] = all(e["ok"] for e in entries)
    return out


def admission_numbers(results: dict[tuple[str, int], list[DemoResult]]) -> dict[str, Any]:
    """Per admission mode and bound: tokens not trained on, generated tokens per second, reward against wall time;
    and per bound, each mode against the filter alone (``off``) after the same wall time, repeat by repeat.

    Args:
        results: per ``(mode, bound)``, the runs in repeat order; repeat ``r`` of every mode at a bound is
            compared with repeat ``r`` of ``off`` (they ran one after the other, on the same machine state).

    Returns:
        ``{"runs": {mode: {bound: {...}}}, "versus_off": {bound: {mode: {...}}}, "targets": ...}``: each run
        entry is a mean over the repeats (``repeats`` holds every run); ``tokens_not_trained_share`` is the share
        of generated tokens the trainer never got (recycled, dropped, aborted, or left over);
        ``reward_at_common_s`` is the reward (``_SMOOTH``-step mean) at the shortest wall time of the bound's runs
        of the same repeat, and ``reward_vs_off`` the mean of the paired differences (``reward_vs_off_se`` its
        standard error).
    """
    runs: dict[str, dict[str, Any]] = {}
    order = sorted(results.items(), key=lambda item: (ADMISSION_MODES.index(item[0][0]), item[0][1]))
    for (mode, bound), each in order:
        if each:
            runs.setdefault(mode, {})[str(bound)] = _aggregate([_run_entry(r) for r in each])
    versus: dict[str, Any] = {}
    for bound in sorted({bound for _, bound in results}):
        row = _versus_off({mode: runs[mode][str(bound)]["repeats"] for mode in runs if str(bound) in runs[mode]})
        if row is not None:
            versus[str(bound)] = row
    return {"runs": runs, "versus_off": versus, "targets": _targets(versus)}


def _versus_off(by_mode: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """One bound: every mode against ``off``, paired repeat by repeat."""
    if "off" not in by_mode:
        return None
    n = min(len(entries) for entries in by_mode.values())
    commons = []
    for r in range(n):
        walls = [entries[r]["wall_s"] for entries in by_mode.values() if entries[r]["wall_s"]]
        commons.append(min(walls) if walls else None)
    if not any(commons):
        return None
    rows: dict[str, Any] = {"repeats": n, "common_s": _mean_of(commons), "common_s_each": commons}
    base = by_mode["off"]
    for mode, entries in by_mode.items():
        rewards, diffs, rates, trained = [], [], [], []
        for r in range(n):
            e, b, common = entries[r], base[r], commons[r]
            if common is None:
                continue
            reward, base_reward = _reward_at(e["curve"], common), _reward_at(b["curve"], common)
            rewards.append(reward)
            if reward is not None and base_reward is not None:
                diffs.append(reward - base_reward)
            if e["generated_tokens_per_s"] and b["generated_tokens_per_s"]:
                rates.append(e["generated_tokens_per_s"] / b["generated_tokens_per_s"])
            if e["trained_tokens_per_s"] and b["trained_tokens_per_s"]:
                trained.append(e["trained_tokens_per_s"] / b["trained_tokens_per_s"])
        shares = [e["tokens_not_trained_share"] for e in entries[:n] if e["tokens_not_trained_share"] is not None]
        rows[mode] = {
            "tokens_not_trained_share": _mean_of(shares),
            "tokens_not_trained_share_max": max(shares) if shares else None,
            "reward_at_common_s": _mean_of(rewards),
            "reward_vs_off": _mean_of(diffs),
            "reward_vs_off_se": _se(diffs),
            "reward_vs_off_each": diffs,
            "generated_tokens_per_s": _mean_of([e["generated_tokens_per_s"] for e in entries[:n]]),
            "rate_vs_off": _mean_of(rates),
            "rate_vs_off_each": rates,
            "trained_tokens_per_s": _mean_of([e["trained_tokens_per_s"] for e in entries[:n]]),
            "trained_rate_vs_off": _mean_of(trained),
            "batch_wait_share": _mean_of([e["batch_wait_share"] for e in entries[:n]]),
        }
    return rows


#: The issue's targets for admission against the filter alone: tokens not trained on below these shares.
_WASTE_TARGETS = {"0": 0.05, "1": 0.01}


def reward_verdict(mean: float | None, se: float | None) -> str:
    """``met`` (the mean paired difference is not below 0), ``within noise`` (below, by less than two standard
    errors), ``not met`` (by more), or ``unknown`` (no difference measured)."""
    if mean is None:
        return "unknown"
    if mean >= 0:
        return "met"
    return "within noise" if se is not None and mean + 2 * se >= 0 else "not met"


def _targets(versus: dict[str, Any]) -> dict[str, Any]:
    """Each mode against the filter alone at bounds 0 and 1: tokens not trained on below 5 % and 1 % in every
    repeat, reward after the same wall time no lower (``reward_verdict``), generated tokens per second at least
    90 % of off's (the mean of the paired ratios)."""
    out: dict[str, Any] = {}
    for bound, limit in _WASTE_TARGETS.items():
        rows = versus.get(bound)
        if rows is None:
            continue
        for mode, row in rows.items():
            if mode == "off" or not isinstance(row, dict):
                continue
            share, rate = row["tokens_not_trained_share_max"], row["rate_vs_off"]
            out.setdefault(bound, {})[mode] = {
                "tokens_not_trained": share is not None and share < limit,
                "reward_no_lower": reward_verdict(row["reward_vs_off"], row["reward_vs_off_se"]),
                "rate_at_least_90_percent": rate is not None and rate >= 0.9,
            }
    return out


def _mean_curve(entries: list[dict[str, Any]], points: int = 120) -> tuple[list[float], list[float]]:
    """The reward (``_reward_at``) averaged over the runs, on a time grid up to the shortest run's end."""
    end = min((e["wall_s"] for e in entries if e["wall_s"]), default=None)
    if end is None:
        return [], []
    ts = [end * (i + 1) / points for i in range(points)]
    ys = [_mean_of([_reward_at(e["curve"], t) for e in entries]) for t in ts]
    kept = [(t, y) for t, y in zip(ts, ys, strict=True) if y is not None]
    return [t for t, _ in kept], [y for _, y in kept]


def write_admission_tradeoff(results: dict[tuple[str, int], list[DemoResult]], out_dir: Path) -> dict[str, Any]:
    """Write ``admission-tradeoff.json`` and ``admission-tradeoff.png``; returns the numbers (``admission_numbers``)."""
    numbers = admission_numbers(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "admission-tradeoff.json").write_text(json.dumps(numbers, indent=2) + "\n")
    plot_admission_tradeoff(numbers, out_dir / "admission-tradeoff.png")
    return numbers


def plot_admission_tradeoff(numbers: dict[str, Any], path: Path) -> None:
    """Draw ``admission-tradeoff.png`` from the numbers (``admission_numbers``, or a written JSON) to ``path``."""
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
            color, ls = styles.get(mode, ("black", "-"))
            for run in entry["repeats"] if len(entry["repeats"]) > 1 else []:
                ax.plot(*_mean_curve([run]), color=color, ls=ls, lw=0.6, alpha=0.3)
            n = len(entry["repeats"])
            label = mode if n == 1 else f"{mode} (mean of {n})"
            ax.plot(*_mean_curve(entry["repeats"]), color=color, ls=ls, label=label)
        ax.set_title(f"max_staleness {bound}")
        ax.set_xlabel("wall time since training began (s)")
        if i == 0:
            ax.set_ylabel(f"mean reward ({_SMOOTH}-step mean)")
        ax.legend(fontsize=7)
    half = max(2, len(bounds)) // 2
    waste = fig.add_subplot(grid[1, :half])
    rate = fig.add_subplot(grid[1, half:])
    width = 0.8 / max(1, len(modes))
    for k, mode in enumerate(modes):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(bounds))]
        entries = [runs[mode].get(str(b), {}) for b in bounds]
        color = styles.get(mode, ("black", "-"))[0]
        for ax, key, scale in ((waste, "tokens_not_trained_share", 100), (rate, "generated_tokens_per_s", 1)):
            heights = [(e.get(key) or 0) * scale for e in entries]
            spans = [e.get(f"{key}_range") or [e.get(key) or 0] * 2 for e in entries]
            errors = [
                [h - lo * scale for h, (lo, _) in zip(heights, spans, strict=True)],
                [hi * scale - h for h, (_, hi) in zip(heights, spans, strict=True)],
            ]
            ax.bar(xs, heights, width, color=color, label=mode, yerr=errors, capsize=2)
    for ax, label in ((waste, "% of generated tokens not trained on"), (rate, "generated tokens per second")):
        ax.set_xticks(range(len(bounds)), [str(b) for b in bounds])
        ax.set_xlabel("max_staleness")
        ax.set_ylabel(label)
        ax.set_title("bars: mean over the repeats; whiskers: their range", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle("weightbus: admission against the filter alone (off), per staleness bound")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
