"""The demo's verdict: invariants computed from the bus recording and from what the trainer actually trained on.

Each check ends ``held``, ``failed`` (the demo exits 1) or ``vacuous`` (nothing to judge: not a failure, not evidence).
Staleness is reported twice, never mixed: *trained* (the groups kept into a batch, ``trained_under - oldest``, what the
bound holds for) and *judged* (every group the drain judged, recycled and dropped ones too). Token counts are
run-wide: each rollout process counts from its own start, so they are summed over the processes. See docs/demo.md.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from weightbus.consumers.monitor import kept_share

__all__ = [
    "FAILED",
    "HELD",
    "ROGUE_ID",
    "TIME_FIELDS",
    "VACUOUS",
    "DemoResult",
    "analyse",
    "overhead_summary",
    "run_tokens",
    "trained_staleness",
    "waste_summary",
]

#: The trainer id of the demo's rogue publisher, which bypasses the counter to announce v1 at the end.
ROGUE_ID = "rogue-script"


@dataclass
class DemoResult:
    """What a demo run measured and which invariants broke.

    Attributes:
        rows: one record per training step (from ``steps.jsonl``).
        problems: every broken invariant, by check name.
        faults: the faults injected (kind, step, time).
        summary: headline numbers (rewards, staleness, lag, waste, wall time).
    """

    rows: list[dict[str, Any]]
    problems: dict[str, list[str]]
    faults: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    announced: list[dict[str, Any]] = field(default_factory=list)
    """Every ``WeightUpdated`` recorded, in stream order (wire JSON)."""
    read_backs: list[dict[str, Any]] = field(default_factory=list)
    """Every ``WeightApplied`` recorded (wire JSON)."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """Every alert recorded (wire JSON: ``VersionRegressed``, ``EngineOutOfSync``, ``FleetQuarantined``, ...)."""
    checks: dict[str, str] = field(default_factory=dict)
    """Each check's verdict: ``held``, ``failed``, or ``vacuous`` (nothing to judge: a fault never injected, say)."""

    @property
    def ok(self) -> bool:
        """Whether every invariant held."""
        return not any(self.problems.values())


def _recorded(path: Path) -> list[dict[str, Any]]:
    seen: set[tuple[str, int | None, str]] = set()
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        key = (rec.get("subject", ""), rec.get("seq"), json.dumps(rec.get("event"), sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        out.append(rec)
    return out


def _quarter_means(rewards: list[float]) -> tuple[float | None, float | None]:
    if not rewards:
        return None, None
    q = max(1, len(rewards) // 4)
    return statistics.fmean(rewards[:q]), statistics.fmean(rewards[-q:])


#: Per-step time fields of ``steps.jsonl`` (seconds) copied into ``report.json``; see :mod:`weightbus.rl.trainer`.
TIME_FIELDS = ("update_s", "push_s", "engine_http_s", "update_own_s", "rollout_wait_s", "drain_s")


def _ms(values: list[float], q: int) -> float | None:
    """The ``q``-th percentile of ``values`` (seconds), in milliseconds."""
    if len(values) < 2:
        return values[0] * 1000 if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def overhead_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The share of step time spent in weightbus's own code, in the engines' HTTP and in the push, over ``rows``.

    Shares are totals over totals (``sum(weightbus_s) / sum(step_s)``); per-step values are in milliseconds.
    """

    def total(key: str) -> float:
        return sum(row.get(key) or 0.0 for row in rows)

    step_s = total("step_s")
    own = [row["weightbus_s"] for row in rows if row.get("weightbus_s") is not None]
    out: dict[str, Any] = {
        f"{name}_share": total(key) / step_s if step_s > 0 else None
        for name, key in (("weightbus", "weightbus_s"), ("engine_http", "engine_http_s"), ("push", "push_s"))
    }
    out["weightbus_ms_p50"] = _ms(own, 50)
    out["weightbus_ms_p99"] = _ms(own, 99)
    for key in ("step_s", "weightbus_s", *TIME_FIELDS):
        out[f"{key[:-2]}_ms_mean"] = total(key) / len(rows) * 1000 if rows else None
    return out


class _Recorded:
    """The recorded events of one run, by kind (the rogue announcement apart from the trainers')."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        def of(kind: str) -> list[dict[str, Any]]:
            return [r["event"] for r in records if r["event"].get("type") == kind]

        all_updates = sorted(
            (r for r in records if r["event"].get("type") == "weight.updated"), key=lambda r: r.get("seq") or 0
        )
        self.updates = [r for r in all_updates if r["event"]["trainer_id"] != ROGUE_ID]
        self.rogue = [r["event"] for r in all_updates if r["event"]["trainer_id"] == ROGUE_ID]
        self.regressions = of("alert.version_regressed")
        self.drains = of("drain.report")
        self.applied = of("weight.applied")
        self.out_of_sync = of("alert.engine_out_of_sync")
        self.alerts = [r["event"] for r in records if str(r["event"].get("type", "")).startswith("alert.")]
        self.versions = [r["event"]["version"] for r in self.updates]


def _versions_forward(rec: _Recorded) -> list[str]:
    problems = [
        f"v{after} announced after v{before}"
        for before, after in zip(rec.versions, rec.versions[1:], strict=False)
        if after <= before
    ]
    return problems if rec.versions else ["no WeightUpdated was recorded"]


def _staleness_bound(rows: list[dict[str, Any]], max_staleness: int) -> list[str]:
    problems = []
    for row in rows:
        for i, group in enumerate(row["groups"]):
            if group["unknown"] or group["oldest"] is None:
                problems.append(f"step {row['step']} group {i} has a non-version label")
            elif row["trained_under"] - group["oldest"] > max_staleness:
                problems.append(
                    f"step {row['step']} group {i}: v{group['oldest']} trained under v{row['trained_under']}"
                )
    return problems


def trained_staleness(row: dict[str, Any]) -> tuple[float | None, int | None]:
    """The mean and max staleness of the groups one step trained on (``trained_under - oldest``, known labels only).

    Args:
        row: a ``steps.jsonl`` record (its ``groups`` and ``trained_under``).
    """
    known = [row["trained_under"] - g["oldest"] for g in row["groups"] if g["oldest"] is not None]
    return (statistics.fmean(known), max(known)) if known else (None, None)


def _incarnations(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The rows by the rollout process that served their batch, in order of first appearance.

    A row without ``rollout_id`` (an older ``steps.jsonl``) starts a new process when its ``tokens_generated``
    falls below the previous row's: the counts start from zero with each process.
    """
    by_id: dict[str, list[dict[str, Any]]] = {}
    unnamed: list[list[dict[str, Any]]] = []
    order: list[list[dict[str, Any]]] = []
    for row in rows:
        rollout = row.get("rollout_id")
        if rollout:
            if rollout not in by_id:
                by_id[rollout] = []
                order.append(by_id[rollout])
            by_id[rollout].append(row)
        elif unnamed and row.get("tokens_generated", 0) >= unnamed[-1][-1].get("tokens_generated", 0):
            unnamed[-1].append(row)
        else:
            unnamed.append([row])
            order.append(unnamed[-1])
    return order


def run_tokens(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Tokens generated, trained and not trained over the whole run: each rollout process's last count, summed.

    A rollout's reply counts from that process's start (``BatchReply.tokens_generated``), so a restarted rollout
    starts again from zero; ``tokens_trained`` is what the rollouts delivered (generated less not trained).
    """
    generated = not_trained = 0
    processes = _incarnations(rows)
    for served in processes:
        last = max(served, key=lambda row: row.get("tokens_generated", 0))
        generated += last.get("tokens_generated", 0)
        not_trained += last.get("tokens_not_trained", 0)
    return {
        "tokens_generated": generated,
        "tokens_trained": generated - not_trained,
        "tokens_not_trained": not_trained,
        "rollout_processes": len(processes),
    }


def _tokens_accounted(rows: list[dict[str, Any]]) -> list[str]:
    """Each rollout process's counts only grow, and no step claims more tokens not trained than generated."""
    problems = []
    for served in _incarnations(rows):
        for before, after in zip(served, served[1:], strict=False):
            if after.get("tokens_generated", 0) < before.get("tokens_generated", 0):
                problems.append(
                    f"step {after['step']}: rollout {after.get('rollout_id')} counts {after['tokens_generated']} "
                    f"tokens generated after {before['tokens_generated']}"
                )
    for row in rows:
        if not 0 <= row.get("tokens_not_trained", 0) <= row.get("tokens_generated", 0):
            problems.append(
                f"step {row['step']}: {row.get('tokens_not_trained')} tokens not trained of "
                f"{row.get('tokens_generated')} generated"
            )
    tokens = run_tokens(rows)
    if tokens["tokens_trained"] > tokens["tokens_generated"]:
        problems.append(f"{tokens['tokens_trained']} tokens trained of {tokens['tokens_generated']} generated")
    return problems


def _engines_in_sync(rec: _Recorded, engines: list[str]) -> list[str]:
    applied = rec.applied
    ok_reads = {(a["engine"], a["version"]) for a in applied if a.get("ok") and a.get("read_back") == str(a["version"])}
    return [
        f"v{r['event']['version']} has no ok read-back from {engine}"
        for r in rec.updates
        for engine in r["event"].get("engines") or engines
        if (engine, r["event"]["version"]) not in ok_reads
    ]


def _faults_survived(rec: _Recorded, rows: list[dict[str, Any]], steps: int, faults: list[dict[str, Any]]) -> list[str]:
    problems = []
    last_step = max((row["step"] for row in rows), default=0)
    if last_step < steps:
        problems.append(f"training stopped at step {last_step} of {steps}")
    if any(fault["kind"] == "failover" for fault in faults):
        before = [r["event"] for r in rec.updates if r["event"]["trainer_id"] == "trainer-0"]
        after = [r["event"] for r in rec.updates if r["event"]["trainer_id"] == "trainer-1"]
        if not after:
            problems.append("the replacement trainer never published")
        elif before and after[0]["version"] <= before[-1]["version"]:
            problems.append(f"the replacement trainer published v{after[0]['version']} after v{before[-1]['version']}")
    return problems


def _caught_up(rec: _Recorded, fault: dict[str, Any]) -> bool:
    """Whether the catch-up after ``fault`` brought its engine to a version, read back on the bus after the restart."""
    catchup = fault.get("catchup") or {}
    if catchup.get("outcome") != "caught_up":
        return False
    return any(
        a["engine"] == fault.get("engine")
        and a["version"] == catchup.get("version")
        and a.get("ok")
        and a["published_at"] >= fault["time"]
        for a in rec.applied
    )


def _restart_alerts(rec: _Recorded, faults: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The alerts naming each restarted engine after its restart, and a problem per engine neither caught up from
    the bus (``producers.catch_up``, read back) nor alerted by the trainer's next update."""
    alerts, problems = [], []
    for fault in faults:
        if fault["kind"] != "restart-engine":
            continue
        engine = fault.get("engine")
        named = [
            a
            for a in rec.out_of_sync
            if a.get("reason") == "unexpected_label" and a["engine"] == engine and a["published_at"] >= fault["time"]
        ]
        alerts += named
        if not named and not _caught_up(rec, fault):
            problems.append(
                f"engine {engine}, restarted after step {fault['step']}, was neither caught up from the bus nor "
                "alerted as EngineOutOfSync(reason=unexpected_label)"
            )
    return alerts, problems


#: Each check's verdict: every problem is a failure; a check with nothing to judge is vacuous, not held.
HELD, FAILED, VACUOUS = "held", "failed", "vacuous"


def _verdicts(
    problems: dict[str, list[str]], rec: _Recorded, rows: list[dict[str, Any]], faults: list[dict[str, Any]]
) -> dict[str, str]:
    kinds = {fault["kind"] for fault in faults}
    exercised = {
        "versions_forward": len(rec.versions) >= 2,
        "staleness_bound": any(row["groups"] for row in rows),
        "engines_in_sync": bool(rec.updates),
        "faults_survived": bool(faults),
        "regression_caught": bool(rec.rogue),
        "restart_alerted": "restart-engine" in kinds,
        "tokens_accounted": any(row.get("tokens_generated") for row in rows),
    }
    return {name: FAILED if problems[name] else HELD if exercised[name] else VACUOUS for name in problems}


def _summary(
    rec: _Recorded,
    rows: list[dict[str, Any]],
    restart_alerts: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    first, last = _quarter_means([row["reward"] for row in rows])
    lags = [r["received_at"] - r["event"]["published_at"] for r in rec.updates if r.get("received_at")]
    tokens = run_tokens(rows)
    trained = [trained_staleness(row) for row in rows]
    trained_avgs = [avg for avg, _ in trained if avg is not None]
    trained_maxes = [top for _, top in trained if top is not None]
    judged = [row["staleness_avg"] for row in rows if row["staleness_avg"] is not None]
    judged_maxes = [row["staleness_max"] for row in rows if row["staleness_max"] is not None]
    return {
        "steps": max((row["step"] for row in rows), default=0),
        "final_version": rec.versions[-1] if rec.versions else None,
        "reward_first": first,
        "reward_last": last,
        # Trained: the groups kept into the batches (what the bound holds for). Judged: every group the drains
        # judged, recycled and dropped ones too (the rollout's ``staleness_avg``/``staleness_max``).
        "trained_staleness_avg": statistics.fmean(trained_avgs) if trained_avgs else None,
        "trained_staleness_max": max(trained_maxes, default=None),
        "judged_staleness_avg": statistics.fmean(judged) if judged else None,
        "judged_staleness_max": max(judged_maxes, default=None),
        "propagation_lag_ms_p50": statistics.median(lags) * 1000 if lags else None,
        **tokens,
        "tokens_not_trained_share": tokens["tokens_not_trained"] / tokens["tokens_generated"]
        if tokens["tokens_generated"]
        else None,
        **overhead_summary(rows),
        "wall_s": wall_s,
        "unknown_version_groups": sum(d.get("reasons", {}).get("unknown_version", 0) for d in rec.drains),
        "engine_out_of_sync_alerts": len(rec.out_of_sync),
        "restart_alerts": [
            {
                "engine": a["engine"],
                "actual": a.get("actual"),
                "expected": a.get("expected"),
                "published_at": a["published_at"],
            }
            for a in restart_alerts
        ],
        "regression_alerts": len(rec.regressions),
        **waste_summary(rec.drains),
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def waste_summary(drains: list[dict[str, Any]]) -> dict[str, Any]:
    """Waste and bias over a run's drain reports (wire JSON): see the module docstring."""
    not_trained: dict[str, int] = {}
    by_length: dict[str, dict[str, int]] = {}
    by_reward: dict[str, dict[str, int]] = {}
    for d in drains:
        for reason, n in (d.get("tokens_not_trained") or {}).items():
            not_trained[reason] = not_trained.get(reason, 0) + n
        for target, counts in ((by_length, d.get("by_length") or {}), (by_reward, d.get("by_reward") or {})):
            for outcome, buckets in counts.items():
                into = target.setdefault(outcome, {})
                for bucket, n in buckets.items():
                    into[bucket] = into.get(bucket, 0) + n

    def values(key: str) -> list[float]:
        return [d[key] for d in drains if d.get(key) is not None]

    generated = sum(d.get("tokens_generated", 0) for d in drains)
    return {
        "drain_tokens_generated": generated,
        "drain_tokens_trained": sum(d.get("tokens_trained", 0) for d in drains),
        "tokens_not_trained_by_reason": not_trained,
        "early_aborts": sum(d.get("early_aborts", 0) for d in drains),
        "tokens_saved": sum(d.get("tokens_saved", 0) for d in drains),
        "in_flight_versions_avg": _mean(values("in_flight_versions_avg")),
        "in_queue_versions_avg": _mean(values("in_queue_versions_avg")),
        "in_flight_s_avg": _mean(values("in_flight_s_avg")),
        "in_queue_s_avg": _mean(values("in_queue_s_avg")),
        "kept_share_by_length": dict(sorted(kept_share(by_length).items())),
        "kept_share_by_reward": dict(sorted(kept_share(by_reward).items())),
    }


def _config_dict(config: Any) -> dict[str, Any]:
    fields = msgspec.structs.asdict(config) if isinstance(config, msgspec.Struct) else asdict(config)
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in fields.items()}


def analyse(
    config: Any,
    *,
    rows: list[dict[str, Any]],
    recording: Path,
    faults: list[dict[str, Any]],
    engines: list[str],
    wall_s: float,
) -> DemoResult:
    """Check the invariants of one run (see the module docstring).

    Args:
        config: the run's config (its ``steps`` and ``max_staleness`` are checked against).
        rows: the trainer's ``steps.jsonl`` records.
        recording: the recorder's JSON lines of the bus.
        faults: the faults injected (kind, step, time, and ``engine`` for an engine restart).
        engines: the engines' URLs (for updates that name none).
        wall_s: the run's wall time.
    """
    rec = _Recorded(_recorded(recording))
    restart_alerts, restart_problems = _restart_alerts(rec, faults)
    problems: dict[str, list[str]] = {
        "versions_forward": _versions_forward(rec),
        "staleness_bound": _staleness_bound(rows, config.max_staleness),
        "engines_in_sync": _engines_in_sync(rec, engines),
        "faults_survived": _faults_survived(rec, rows, config.steps, faults),
        "regression_caught": [],
        "restart_alerted": restart_problems,
        "tokens_accounted": _tokens_accounted(rows),
    }
    if rec.rogue and not any(a["incoming"] == 1 and a["action"] == "hold" for a in rec.regressions):
        problems["regression_caught"].append("the rogue v1 was not held and alerted by the rollout's tracker")
    summary = _summary(rec, rows, restart_alerts, wall_s)
    # The restarted engines brought back from the bus by the catch-up before the trainer's push reached them.
    summary["restart_caught_up"] = [
        f.get("engine") for f in faults if f["kind"] == "restart-engine" and _caught_up(rec, f)
    ]
    return DemoResult(
        rows=rows,
        problems=problems,
        faults=faults,
        summary=summary,
        config=_config_dict(config),
        announced=[r["event"] for r in rec.updates],
        read_backs=rec.applied,
        alerts=rec.alerts,
        checks=_verdicts(problems, rec, rows, faults),
    )
