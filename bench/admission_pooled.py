"""Pool the paired comparisons of several ``weightbus demo --compare-admission`` runs, bound by bound.

Each run's ``versus_off`` holds, per bound and mode, one paired difference (reward at the common time) and one
paired ratio (generated tokens per second) per repeat against ``off``'s run of the same repeat. Runs with
different seeds are independent samples of the same comparison, so their pairs pool: the mean and standard
error over all of them. Results go to stdout and ``bench/results/admission-repeats/pooled.json``.

Usage: python bench/admission_pooled.py [RUN.json ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
DEFAULT_RUNS = (RESULTS / "admission-tradeoff.json", RESULTS / "admission-repeats" / "admission-tradeoff.json")


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per bound present in every run, and per mode but ``off``: the pooled paired differences and ratios."""
    bounds = set.intersection(*(set(run["versus_off"]) for run in runs))
    out: dict[str, Any] = {}
    for bound in sorted(bounds, key=int):
        modes = set.intersection(*({m for m in run["versus_off"][bound] if m not in _NOT_MODES} for run in runs))
        for mode in sorted(modes - {"off"}):
            diffs = [d for run in runs for d in run["versus_off"][bound][mode]["reward_vs_off_each"]]
            rates = [r for run in runs for r in run["versus_off"][bound][mode]["rate_vs_off_each"]]
            shares = [run["versus_off"][bound][mode]["tokens_not_trained_share_max"] for run in runs]
            out.setdefault(bound, {})[mode] = {
                "pairs": len(diffs),
                "reward_vs_off": statistics.fmean(diffs),
                "reward_vs_off_se": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None,
                "rate_vs_off": statistics.fmean(rates),
                "rate_vs_off_min": min(rates),
                "tokens_not_trained_share_max": max(shares),
            }
    return out


_NOT_MODES = {"repeats", "common_s", "common_s_each"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, default=list(DEFAULT_RUNS))
    parser.add_argument("--out", type=Path, default=RESULTS / "admission-repeats" / "pooled.json")
    args = parser.parse_args()
    root = RESULTS.parent.parent.resolve()
    names = [str(p.resolve().relative_to(root)) if p.resolve().is_relative_to(root) else str(p) for p in args.runs]
    pooled = {"runs": names, "pooled": pool([json.loads(p.read_text()) for p in args.runs])}
    text = json.dumps(pooled, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
