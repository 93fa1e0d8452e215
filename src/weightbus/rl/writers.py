"""The demo's report files: ``report.json`` and ``report.png`` of one run, the staleness trade-off's of several.

The figures are drawn with matplotlib (imported here only, on the Agg backend): reward per step against the
staleness trained on, on integer ticks with the bound drawn, faults marked; and, for the trade-off, reward against
wall time per bound next to the share of generated tokens never trained on.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from weightbus.rl.report import TIME_FIELDS, DemoResult

__all__ = ["plot_report", "tradeoff_numbers", "write_report", "write_tradeoff"]


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
