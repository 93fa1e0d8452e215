"""The propagation benchmark's report: pooled quantiles, the ratios against the targets, markdown, plot.

Pure functions of the result dict that ``bench/propagation.py`` writes to ``propagation.json``, so ``--replot``
rewrites the ``.md`` and ``.png`` from a stored run.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from propagation_rows import ROWS, quantiles

__all__ = ["LABELS", "TARGETS", "fmt", "ratios", "summarise", "write_reports"]

LABELS = {
    "weightbus": "weightbus VersionPublisher → VersionTracker",
    "weightbus_mark_now": "the same, the counter's mark written at once (mark_delay=0)",
    "nats_core": "raw NATS core pub/sub",
    "jetstream": "raw JetStream ordered consumer (last per subject)",
    "jetstream_events": "raw JetStream ordered consumer of weightbus's own events",
    "redis": "Redis Streams XADD → XREAD BLOCK",
    "http_poll": "HTTP /model_info poll, 1 s TTL",
}
TARGETS = {
    "weightbus_over_jetstream_p50_max": 1.05,
    "poll_over_weightbus_p50_min": 250.0,
}


# -- report -------------------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def summarise(
    pooled: dict[tuple[str, int], list[float]], trials: list[dict[str, Any]], ms: list[int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in ROWS:
        out[row] = {}
        for m in ms:
            mine = [t for t in trials if t["row"] == row and t["M"] == m]
            errors = sorted({t["error"] for t in mine if t.get("error")})
            stats = quantiles(pooled.get((row, m), []))
            stats.update(
                lost=sum(t.get("lost", 0) for t in mine),
                trial_p50_ms=[t.get("p50_ms") for t in mine],
                subscriber_cpu_us_per_version=_median([t.get("subscriber_cpu_us_per_version") for t in mine]),
                load=[t["load_before"] for t in mine],
                error="; ".join(errors) or None,
            )
            out[row][str(m)] = stats
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratios(summary: dict[str, Any], ms: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in ms:
        key = str(m)
        wb, now, js, js_events, rd, poll = (
            summary[r][key]
            for r in ("weightbus", "weightbus_mark_now", "jetstream", "jetstream_events", "redis", "http_poll")
        )
        out[key] = {
            "weightbus_over_jetstream_p50": _ratio(wb["p50_ms"], js["p50_ms"]),
            "mark_now_over_jetstream_p50": _ratio(now["p50_ms"], js["p50_ms"]),
            "weightbus_over_jetstream_events_p50": _ratio(wb["p50_ms"], js_events["p50_ms"]),
            "weightbus_over_redis_p50": _ratio(wb["p50_ms"], rd["p50_ms"]),
            "weightbus_over_redis_p99": _ratio(wb["p99_ms"], rd["p99_ms"]),
            "poll_over_weightbus_p50": _ratio(poll["p50_ms"], wb["p50_ms"]),
        }
        r = out[key]
        out[key]["targets_met"] = {
            "p50 <= 1.05x jetstream": _le(
                r["weightbus_over_jetstream_p50"], TARGETS["weightbus_over_jetstream_p50_max"]
            ),
            "p50 below redis": _lt(r["weightbus_over_redis_p50"], 1.0),
            "p99 below redis": _lt(r["weightbus_over_redis_p99"], 1.0),
            "poll p50 >= 250x": _ge(r["poll_over_weightbus_p50"], TARGETS["poll_over_weightbus_p50_min"]),
        }
    return out


def _le(x: float | None, y: float) -> bool | None:
    return None if x is None else x <= y


def _lt(x: float | None, y: float) -> bool | None:
    return None if x is None else x < y


def _ge(x: float | None, y: float) -> bool | None:
    return None if x is None else x >= y


def fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


def _markdown(result: dict[str, Any]) -> str:
    ms = result["config"]["subscribers"]
    summary, ratios = result["summary"], result["ratios"]
    lines = [
        "# Propagation: publish call → subscriber holds the version",
        "",
        f"{result['config']['repeats']} repeats, rows interleaved; one publisher, a version every "
        f"{1000 * result['config']['interval_s']:g} ms; versions per trial by M: "
        + ", ".join(f"M={m}: {n}" for m, n in result["config"]["versions"].items())
        + f". Machine: {result['machine']['cpus']} CPUs{_model(result['machine'])}, 1-min load average "
        f"{result['machine']['load_min']:.2f}"
        f"–{result['machine']['load_max']:.2f} during the trials; {result['machine']['note']} Event loop of the "
        f"publisher and every NATS row's subscribers: {result['config'].get('event_loop', 'asyncio')}; the Redis "
        "row's client blocks on its socket, the poll row sleeps.",
        "",
        "p50 / p99 / max in ms, pooled over every subscriber, version and repeat:",
        "",
        "| row | " + " | ".join(f"M = {m}" for m in ms) + " |",
        "|---|" + "---|" * len(ms),
    ]
    for row in ROWS:
        cells = []
        for m in ms:
            s = summary[row][str(m)]
            if s["p50_ms"] is None:
                cells.append(s["error"] or "no data")
            else:
                lost = f" ({s['lost']} lost)" if s["lost"] else ""
                cells.append(f"{fmt(s['p50_ms'])} / {fmt(s['p99_ms'])} / {fmt(s['max_ms'])}{lost}")
        lines.append(f"| {LABELS[row]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Ratios (targets: weightbus p50 ≤ 1.05× JetStream, p50 and p99 below Redis, poll ≥ 250× weightbus):",
        "",
    ]
    lines += [
        "| M | weightbus / JetStream p50 | mark at once / JetStream p50 | weightbus / JetStream of its events p50 "
        "| weightbus / Redis p50 | weightbus / Redis p99 | poll / weightbus p50 |"
    ]
    lines += ["|---|---|---|---|---|---|---|"]
    for m in ms:
        r = ratios[str(m)]
        cells = [
            fmt(r.get(k)) + ("×" if r.get(k) is not None else "")
            for k in (
                "weightbus_over_jetstream_p50",
                "mark_now_over_jetstream_p50",
                "weightbus_over_jetstream_events_p50",
                "weightbus_over_redis_p50",
                "weightbus_over_redis_p99",
                "poll_over_weightbus_p50",
            )
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU one subscriber process spends per version, µs (median over processes and repeats; the HTTP poll "
        "spends it per poll, not per version):",
        "",
        "| row | " + " | ".join(f"M = {m}" for m in ms) + " |",
        "|---|" + "---|" * len(ms),
    ]
    for row in ROWS:
        cells = [fmt(summary[row][str(m)]["subscriber_cpu_us_per_version"]) for m in ms]
        lines.append(f"| {LABELS[row]} | " + " | ".join(cells) + " |")
    lines += ["", f"Whole run: {result['duration_s']:.0f} s. Raw data: propagation.json; plot: propagation.png.", ""]
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no plot"
    ms = result["config"]["subscribers"]
    fig, ax = plt.subplots(figsize=(9, 5.6))
    width = 0.8 / len(ROWS)
    for i, row in enumerate(ROWS):
        xs = [j + (i - (len(ROWS) - 1) / 2) * width for j in range(len(ms))]
        p50 = [result["summary"][row][str(m)]["p50_ms"] or 0 for m in ms]
        p99 = [result["summary"][row][str(m)]["p99_ms"] or 0 for m in ms]
        bars = ax.bar(xs, p50, width, label=LABELS[row])
        ax.scatter(xs, p99, marker="_", s=200, color=bars.patches[0].get_facecolor(), zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(range(len(ms)), [f"M = {m} subscribers" for m in ms])
    ax.set_ylabel("publish → held, ms (bar: p50, tick: p99)")
    ax.set_title("Version propagation, same run, interleaved")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, frameon=False)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend sits below the axes, outside the figure
    plt.close(fig)
    return None


def _print_ratios(result: dict[str, Any]) -> None:
    for m, r in result["ratios"].items():
        print(
            f"M={m:>3}: weightbus/JetStream p50 {fmt(r['weightbus_over_jetstream_p50'])}x "
            f"(mark at once {fmt(r.get('mark_now_over_jetstream_p50'))}x)   "
            f"weightbus/Redis p50 {fmt(r['weightbus_over_redis_p50'])}x p99 {fmt(r['weightbus_over_redis_p99'])}x   "
            f"poll/weightbus p50 {fmt(r['poll_over_weightbus_p50'])}x"
        )


# -- main ---------------------------------------------------------------------------------------------------------


def write_reports(result: dict[str, Any], out: Path) -> None:
    (out / "propagation.md").write_text(_markdown(result))
    problem = _plot(result, out / "propagation.png")
    print(_markdown(result))
    _print_ratios(result)
    if problem:
        print(problem)
    print(f"wrote {out}/propagation.json, .md" + ("" if problem else ", .png"))


def _model(machine: dict[str, Any]) -> str:
    """`` (<CPU model>)`` where the run recorded it (runs before it was recorded say nothing)."""
    model = machine.get("cpu_model")
    return f" ({model})" if model else ""
