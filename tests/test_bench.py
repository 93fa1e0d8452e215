"""The benchmarks still run against the current public API and record what they claim (a small run of each).

``make bench`` is not part of the suite; these keep its scripts from rotting when the publisher, tracker or stage
change: every published version must reach every subscriber process, and the update's phases must account for the
engine requests actually made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

pytestmark = [pytest.mark.slow, pytest.mark.nats]


def _run(script: str, *args: str, timeout: float = 120) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_propagation_delivers_every_version_to_every_subscriber_process(tmp_path: Path) -> None:
    _run(
        "propagation.py",
        *("--versions", "30", "--subscribers", "1,3", "--repeats", "1", "--interval", "0.005"),
        *("--rows", "weightbus,nats_core,jetstream,jetstream_events,http_poll", "--out", str(tmp_path)),
        *("--loop", "asyncio"),  # make bench runs the default, uvloop
    )
    result = json.loads((tmp_path / "propagation.json").read_text())
    report = (tmp_path / "propagation.md").read_text()
    assert result["config"]["event_loop"] == "asyncio" and "every NATS row's subscribers: asyncio;" in report
    for label in ("| raw JetStream ordered consumer (last", "| raw JetStream ordered consumer of weightbus"):
        assert report.count(label) == 2, label  # latency and CPU tables
    trials = result["trials"]
    assert {(t["row"], t["M"]) for t in trials} == {
        (row, m) for row in ("weightbus", "nats_core", "jetstream", "jetstream_events", "http_poll") for m in (1, 3)
    }
    for t in trials:
        assert t["error"] is None, t
        assert t["lost"] == 0, t
        assert t["heavy_imports"] == [], t  # 64 of these share 2 cores: no torch on the subscriber path
        assert t["samples"] == 30 * t["M"], t
        # Received after it was published (shared CLOCK_REALTIME), and within the trial.
        assert 0 < t["p50_ms"] <= t["p99_ms"] <= t["max_ms"] < 10_000, t
    poll, bus = result["summary"]["http_poll"]["1"], result["summary"]["weightbus"]["1"]
    assert poll["p50_ms"] > bus["p50_ms"]
    assert set(result["ratios"]["3"]) >= {"weightbus_over_jetstream_p50", "poll_over_weightbus_p50"}


def test_update_phases_account_for_every_engine_request(tmp_path: Path) -> None:
    _run("update.py", "--rounds", "5", "--warmup", "1", "--out", str(tmp_path))
    result = json.loads((tmp_path / "update.json").read_text())
    assert result["event_loop"] == "uvloop"
    requests = result["requests_per_update"]
    assert requests["/pause_generation"] == requests["/continue_generation"] == 2
    assert requests["/update_weights_from_disk"] == 2
    summary = result["summary"]
    assert set(summary) == {"pause", "push", "stamp", "announce", "resume", "update"}
    for phase in summary.values():
        assert phase["own_p50_ms"] >= 0 and phase["engine_http_p50_ms"] >= 0
    # The push is the trainer's HTTP: nearly all of it is engine time.
    assert summary["push"]["engine_http_p50_ms"] > summary["push"]["own_p50_ms"]
    assert summary["update"]["wall_p50_ms"] >= summary["update"]["engine_http_p50_ms"] > 0


def test_fleet_measures_each_size_side_by_side_and_the_faulty_engines(tmp_path: Path) -> None:
    _run(
        "fleet.py",
        *("--sizes", "1,4", "--rounds", "2", "--warmup", "1", "--slow", "0.2", "--fault-rounds", "1"),
        *("--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "fleet.json").read_text())
    assert result["machine"]["nproc"] >= 1 and result["machine"]["cpu_model"]
    by_size = result["summary"]["by_size"]
    for n in ("1", "4"):
        row = by_size[n]
        assert row["converged"] == "2/2"  # every engine's WeightApplied reached the subscriber process
        assert row["requests_per_update"] == {
            "/continue_generation": int(n),
            "/model_info": 2 * int(n),
            "/pause_generation": int(n),
            "/update_weight_version": int(n),
            "/update_weights_from_disk": int(n),
        }
        assert set(row["phases"]) == {"take", "pause", "relabel", "push", "stamp", "announce", "resume"}
        assert 0 < row["control_p50_ms"] < row["update_wall_p50_ms"]
    assert result["summary"]["ratio_biggest_over_smallest"]["control"] > 0
    raw = result["raw"]
    assert raw["connections"]["accepted_during_rounds"] == 0  # keep-alive: no reconnect per step
    (slow,) = raw["faults"]["slow"]["rounds"]
    assert slow["announced"] and slow["phases"]["pause"] >= 0.2  # a step waits for its slowest engine
    (failing,) = raw["faults"]["failing"]["rounds"]
    assert failing["error"].startswith("EngineError") and not failing["announced"]
    assert failing["resumed_others"] >= 3  # the engines it paused were resumed
    assert raw["faults"]["failing"]["next_update_after_repair"]["announced"]
    (bounded,) = raw["bounded"]["rounds"]
    assert bounded["peak_control_in_flight"] <= raw["bounded"]["max_in_flight"] == 1
    assert "N = 4 / N = 1" in (tmp_path / "fleet.md").read_text()


def test_drain_reports_groups_per_second_and_the_ratio(tmp_path: Path) -> None:
    _run("drain.py", "--groups", "2000", "--http-groups", "50", "--repeat", "1", "--out", str(tmp_path), "--profile")
    result = json.loads((tmp_path / "drain.json").read_text())
    assert result["stage"]["groups_per_s"] > 0 and result["http_poll"]["groups_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["stage"]["groups_per_s"] / result["http_poll"]["groups_per_s"])
    assert result["stage"]["kept"] == 1500  # a quarter of the groups are too stale
    profile = (tmp_path / "drain-profile.txt").read_text()
    assert "judge_ns_per_group" in profile and "tally.py" in profile and "FullyAsyncBuffer.drain" in profile


def test_demo_overhead_keeps_each_steps_split_from_a_real_demo_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sglang_router")
    _run("demo_overhead.py", "--steps", "3", "--out", str(tmp_path))
    result = json.loads((tmp_path / "demo-overhead.json").read_text())
    assert result["ok"] is True and result["exit_code"] == 0
    assert [row["step"] for row in result["steps"]] == [1, 2, 3]
    for row in result["steps"]:
        assert row["weightbus_ms"] == pytest.approx(row["update_own_ms"] + row["rollout_wait_ms"] + row["drain_ms"])
        assert 0 < row["weightbus_ms"] < row["step_ms"]
        assert 0 < row["engine_http_ms"] <= row["update_ms"]
    share = sum(r["weightbus_ms"] for r in result["steps"]) / sum(r["step_ms"] for r in result["steps"])
    assert result["summary"]["weightbus_share"] == pytest.approx(share)
    assert "weightbus's own" in (tmp_path / "demo-overhead.md").read_text()


def test_admission_measures_the_check_and_the_shared_round_trips(tmp_path: Path) -> None:
    _run("admission.py", "--n", "2000", "--seconds", "0.5", "--out", str(tmp_path))
    result = json.loads((tmp_path / "admission.json").read_text())
    assert result["in_process"]["try_acquire_release_us"] > result["in_process"]["noop_call_us"] > 0
    for run in result["shared"].values():
        assert run["groups"] > 0 and run["round_trips_per_group"] > 0
        assert run["peak_used"] <= run["allowance"]  # three processes sharing one budget never over-admitted


def test_admission_pooled_pools_the_committed_runs_pair_by_pair(tmp_path: Path) -> None:
    _run("admission_pooled.py", "--out", str(tmp_path / "pooled.json"))
    pooled = json.loads((tmp_path / "pooled.json").read_text())["pooled"]
    runs = [
        json.loads((BENCH / "results" / name).read_text())["versus_off"]
        for name in ("admission-tradeoff.json", "admission-repeats/admission-tradeoff.json")
    ]
    for bound in ("0", "1"):
        diffs = [d for run in runs for d in run[bound]["bounded"]["reward_vs_off_each"]]
        assert pooled[bound]["bounded"]["pairs"] == len(diffs)
        assert abs(pooled[bound]["bounded"]["reward_vs_off"] - sum(diffs) / len(diffs)) < 1e-12


def test_fanout_delivers_every_version_to_every_follower_on_one_server_and_the_cluster(tmp_path: Path) -> None:
    _run(
        "fanout.py",
        *("--trackers", "16", "--processes", "4", "--versions", "5", "--interval", "0.05", "--repeats", "1"),
        *("--out", str(tmp_path)),
        timeout=240,
    )
    result = json.loads((tmp_path / "fanout.json").read_text())
    trials = result["trials"]
    assert {(t["server"], t["layout"], t["row"]) for t in trials} == {
        (server, layout, row)
        for server in ("single", "cluster")
        for layout in ("coroutines", "processes")
        for row in ("weightbus", "jetstream")
    }
    for t in trials:
        assert t["error"] is None and t["lost"] == 0, t
        assert t["followers"] == 16 and t["deliveries"] == 16 * 5 and t["server_cpu_s"] >= 0
    report = (tmp_path / "fanout.md").read_text()
    assert report.count("| single | coroutines |") == 3  # two rows and the ratio
