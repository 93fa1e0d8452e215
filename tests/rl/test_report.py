"""The demo's checker flags each broken invariant from a recording and the trained rows (it must be able to fail)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from weightbus.demo import FAULTS, DemoConfig
from weightbus.rl.report import ROGUE_ID, analyse
from weightbus.rl.writers import plot_report, tradeoff_numbers, write_report, write_tradeoff

ENGINES = ["http://e0", "http://e1"]


def _updated(seq: int, version: int, trainer: str = "trainer-0") -> dict[str, Any]:
    event = {
        "type": "weight.updated",
        "policy": "demo",
        "version": version,
        "epoch": 0,
        "trainer_id": trainer,
        "published_at": 100.0 + seq,
        "engines": ENGINES,
    }
    return {"subject": "weightbus.demo.weights", "seq": seq, "received_at": 100.001 + seq, "event": event}


def _applied(seq: int, version: int, engine: str, read_back: str | None = None) -> dict[str, Any]:
    read = str(version) if read_back is None else read_back
    event = {
        "type": "weight.applied",
        "policy": "demo",
        "version": version,
        "engine": engine,
        "read_back": read,
        "ok": read == str(version),
        "published_at": 100.0 + seq,
    }
    return {"subject": "weightbus.demo.applied", "seq": seq, "received_at": 100.0 + seq, "event": event}


def _row(step: int, trained_under: int, oldest: list[int | None], unknown: bool = False) -> dict[str, Any]:
    groups = [{"oldest": o, "newest": o, "unknown": unknown or o is None} for o in oldest]
    return {
        "step": step,
        "trainer_id": "trainer-0",
        "trained_under": trained_under,
        "version": trained_under + 1,
        "reward": 0.1 * step,
        "groups": groups,
        "judged_at": trained_under,
        "kept": len(groups),
        "recycled": 0,
        "dropped": 0,
        "staleness_avg": 0.5,
        "staleness_max": 1,
        "tokens_generated": 100,
        "tokens_not_trained": 10,
        "batch_wait_s": 0.1,
        "weightbus_s": 0.02,
        "step_s": 0.2,
        "time": 1000.0 + step,
    }


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _healthy() -> list[dict[str, Any]]:
    records = []
    for i, v in enumerate((1, 2, 3)):
        records += [_applied(10 * i + 1, v, ENGINES[0]), _applied(10 * i + 2, v, ENGINES[1]), _updated(10 * i + 3, v)]
    return records


def test_a_healthy_run_has_no_problems_and_writes_its_report(tmp_path: Path) -> None:
    config = DemoConfig(steps=2, out_dir=None)
    rows = [_row(1, 2, [1, 2]), _row(2, 3, [2, 3])]
    # A resubscribing recorder may write an event twice: de-duplicated, not a regression.
    recording = _write(tmp_path / "bus.jsonl", _healthy() + [_updated(23, 3)])
    result = analyse(config, rows=rows, recording=recording, faults=[], engines=ENGINES, wall_s=1.0)
    assert result.ok, result.problems
    assert result.summary["reward_first"] == pytest.approx(0.1)
    assert result.summary["tokens_not_trained_share"] == pytest.approx(0.1)
    write_report(result, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "report.json").read_text())["ok"] is True
    assert (tmp_path / "out" / "report.png").stat().st_size > 0


def test_each_broken_invariant_is_named(tmp_path: Path) -> None:
    config = DemoConfig(steps=3, max_staleness=1, out_dir=None)
    records = _healthy()
    records.append(_updated(40, 2))  # a version going backwards from a trainer
    records.append(_applied(41, 2, ENGINES[1], read_back="default"))
    records.append(_updated(42, 4))  # announced without engine read-backs
    records.append(_updated(43, 1, trainer=ROGUE_ID))  # the rogue, with no alert recorded
    rows = [_row(1, 3, [1]), _row(2, 3, [None], unknown=True)]  # staleness 2 > 1; a "default" label
    recording = _write(tmp_path / "bus.jsonl", records)
    result = analyse(config, rows=rows, recording=recording, faults=[], engines=ENGINES, wall_s=1.0)
    assert not result.ok
    assert result.problems["versions_forward"] == ["v2 announced after v3"]
    assert any("v1 trained under v3" in p for p in result.problems["staleness_bound"])
    assert any("non-version label" in p for p in result.problems["staleness_bound"])
    assert any("v4 has no ok read-back" in p for p in result.problems["engines_in_sync"])
    assert result.problems["faults_survived"] == ["training stopped at step 2 of 3"]
    assert result.problems["regression_caught"]


def _out_of_sync(seq: int, engine: str, published_at: float, reason: str = "unexpected_label") -> dict[str, Any]:
    event = {
        "type": "alert.engine_out_of_sync",
        "policy": "demo",
        "engine": engine,
        "expected": "3",
        "actual": "default",
        "trainer_id": "trainer-0",
        "published_at": published_at,
        "reason": reason,
    }
    return {"subject": "weightbus.demo.alerts", "seq": seq, "received_at": published_at, "event": event}


def test_a_restarted_engine_must_be_caught_up_or_alerted_as_unexpected_label_after_its_restart(tmp_path: Path) -> None:
    config = DemoConfig(steps=2, out_dir=None)
    rows = [_row(1, 2, [1, 2]), _row(2, 3, [2, 3])]
    restart = {"kind": "restart-engine", "step": 1, "time": 150.0, "engine": ENGINES[0]}

    def check(*alerts: dict[str, Any]) -> Any:
        recording = _write(tmp_path / "bus.jsonl", _healthy() + list(alerts))
        return analyse(config, rows=rows, recording=recording, faults=[restart], engines=ENGINES, wall_s=1.0)

    not_alerted = [
        check(),
        check(_out_of_sync(50, ENGINES[0], 149.0)),  # before the restart: not about it
        check(_out_of_sync(50, ENGINES[1], 151.0)),  # the other engine
        check(_out_of_sync(50, ENGINES[0], 151.0, reason="read_back")),
    ]
    for result in not_alerted:
        assert result.problems["restart_alerted"] == [
            f"engine {ENGINES[0]}, restarted after step 1, was neither caught up from the bus nor alerted as "
            "EngineOutOfSync(reason=unexpected_label)"
        ]
        assert result.summary["restart_alerts"] == []
    alerted = check(_out_of_sync(50, ENGINES[1], 151.0), _out_of_sync(51, ENGINES[0], 152.0))
    assert alerted.ok, alerted.problems
    assert alerted.summary["engine_out_of_sync_alerts"] == 2
    assert alerted.summary["restart_alerts"] == [
        {"engine": ENGINES[0], "actual": "default", "expected": "3", "published_at": 152.0}
    ]


def test_a_restarted_engine_caught_up_from_the_bus_needs_its_read_back_after_the_restart(tmp_path: Path) -> None:
    config = DemoConfig(steps=2, out_dir=None)
    rows = [_row(1, 2, [1, 2]), _row(2, 3, [2, 3])]
    said = {"outcome": "caught_up", "version": 3, "before": "default", "loaded": [3], "time": 126.0}
    restart = {"kind": "restart-engine", "step": 1, "time": 125.0, "engine": ENGINES[0], "catchup": said}

    def check(fault: dict[str, Any], *extra: dict[str, Any]) -> Any:
        recording = _write(tmp_path / "bus.jsonl", _healthy() + list(extra))
        return analyse(config, rows=rows, recording=recording, faults=[fault], engines=ENGINES, wall_s=1.0)

    healed = check(restart, _applied(30, 3, ENGINES[0]))  # the catch-up's WeightApplied, at 130.0
    assert healed.ok, healed.problems
    assert healed.summary["restart_caught_up"] == [ENGINES[0]] and healed.summary["restart_alerts"] == []
    not_healed = [
        check(restart),  # the catch-up said so, but the bus never heard a read-back after the restart
        check(restart | {"catchup": {"outcome": "failed", "reason": "bus"}}, _applied(30, 3, ENGINES[0])),
        check(restart | {"catchup": said | {"outcome": "current"}}, _applied(30, 3, ENGINES[0])),
        check(restart, _applied(30, 3, ENGINES[0], read_back="quarantine:3")),
    ]
    for result in not_healed:
        assert result.problems["restart_alerted"], result.summary
        assert result.summary["restart_caught_up"] == []


def test_overhead_shares_are_totals_over_the_steps_time(tmp_path: Path) -> None:
    rows = [_row(1, 2, [2]), _row(2, 3, [3])]
    rows[0] |= {"step_s": 0.3, "weightbus_s": 0.003, "engine_http_s": 0.03, "push_s": 0.06}
    rows[1] |= {"step_s": 0.1, "weightbus_s": 0.001, "engine_http_s": 0.01, "push_s": 0.02}
    result = analyse(
        DemoConfig(steps=2, out_dir=None),
        rows=rows,
        recording=_write(tmp_path / "bus.jsonl", _healthy()),
        faults=[],
        engines=ENGINES,
        wall_s=1.0,
    )
    s = result.summary
    assert s["weightbus_share"] == pytest.approx(0.01)
    assert s["engine_http_share"] == pytest.approx(0.1)
    assert s["push_share"] == pytest.approx(0.2)
    assert s["step_ms_mean"] == pytest.approx(200.0)
    assert s["weightbus_ms_p50"] == pytest.approx(2.0)
    write_report(result, tmp_path / "out")
    steps = json.loads((tmp_path / "out" / "report.json").read_text())["steps"]
    got = [(r["weightbus_s"], r["engine_http_s"], r["push_s"]) for r in steps]
    assert got == [(0.003, 0.03, 0.06), (0.001, 0.01, 0.02)]


def test_tradeoff_numbers_and_plot(tmp_path: Path) -> None:
    config = DemoConfig(steps=2, out_dir=None)
    recording = _write(tmp_path / "bus.jsonl", _healthy())
    results = {
        b: analyse(
            config, rows=[_row(1, 2, [2]), _row(2, 3, [3])], recording=recording, faults=[], engines=ENGINES, wall_s=1.0
        )
        for b in (0, 2)
    }
    numbers = tradeoff_numbers(results)
    assert list(numbers) == ["0", "2"]
    assert numbers["0"]["curve"][0] == [pytest.approx(0.2), pytest.approx(0.1)]
    write_tradeoff(results, tmp_path / "out")
    assert (tmp_path / "out" / "staleness-tradeoff.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "staleness-tradeoff.json").read_text())["2"]["ok"] is True


def test_a_check_with_nothing_to_judge_is_vacuous_not_held(tmp_path: Path) -> None:
    # A clean run (no fault, no rogue announcement): the fault checks have no problem, yet they proved nothing.
    config = DemoConfig(steps=2, out_dir=None, faults=False)
    rows = [_row(1, 2, [1, 2]), _row(2, 3, [2, 3])]
    recording = _write(tmp_path / "bus.jsonl", _healthy())
    result = analyse(config, rows=rows, recording=recording, faults=[], engines=ENGINES, wall_s=1.0)
    assert result.ok
    assert result.checks == {
        "versions_forward": "held",
        "staleness_bound": "held",
        "engines_in_sync": "held",
        "faults_survived": "vacuous",
        "regression_caught": "vacuous",
        "restart_alerted": "vacuous",
        "tokens_accounted": "held",
    }
    # With the faults injected and the rogue announced and alerted, the same checks are exercised.
    restart = {"kind": "restart-engine", "step": 1, "time": 150.0, "engine": ENGINES[0]}
    rogue = _updated(50, 1, trainer=ROGUE_ID)
    held = {
        "type": "alert.version_regressed",
        "policy": "demo",
        "current": 3,
        "incoming": 1,
        "action": "hold",
        "published_at": 160.0,
    }
    records = [*_healthy(), _out_of_sync(40, ENGINES[0], 151.0), rogue, {"seq": 51, "event": held}]
    recording = _write(tmp_path / "faults.jsonl", records)
    faults = [{"kind": "failover", "step": 1, "time": 140.0}, restart]
    result = analyse(config, rows=rows, recording=recording, faults=faults, engines=ENGINES, wall_s=1.0)
    assert result.checks["restart_alerted"] == "held" and result.checks["regression_caught"] == "held"
    # The failover's replacement never published: a failure, never vacuous.
    assert result.checks["faults_survived"] == "failed"
    assert json.loads(json.dumps(result.checks))  # goes into report.json as is


def test_the_staleness_axis_has_integer_ticks_and_a_line_at_the_bound(tmp_path: Path) -> None:
    config = DemoConfig(steps=2, max_staleness=2, out_dir=None)
    rows = [_row(1, 2, [1, 2]), _row(2, 3, [2, 3])]
    result = analyse(
        config, rows=rows, recording=_write(tmp_path / "b.jsonl", _healthy()), faults=[], engines=ENGINES, wall_s=1.0
    )
    fig = plot_report(result)
    try:
        staleness = fig.axes[1]
        ticks = [t for t in staleness.get_yticks() if staleness.get_ylim()[0] <= t <= staleness.get_ylim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        bounds = [line for line in staleness.get_lines() if list(line.get_ydata()) == [2, 2]]
        assert len(bounds) == 1
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_demo_injects_every_fault_at_spread_steps_by_default() -> None:
    plan = DemoConfig(steps=80).fault_plan()
    assert list(plan) == list(FAULTS) and list(plan.values()) == [16, 32, 48, 64]
    assert DemoConfig(steps=80, faults=False).fault_plan() == {}
    # An explicit step wins, with or without the others.
    assert DemoConfig(steps=80, faults=False, kill_nats_at=5).fault_plan() == {"kill-nats": 5}
    assert DemoConfig(steps=80, failover_at=3).fault_plan()["failover"] == 3
    # Short runs still inject each fault before the last step.
    short = DemoConfig(steps=3).fault_plan()
    assert len(short) == 4 and all(1 <= at < 3 for at in short.values())


def test_the_demo_summary_lists_vacuous_checks_apart_from_held_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightbus.cli.demo import _verdict

    config = DemoConfig(steps=2, out_dir=None, faults=False)
    rows = [_row(1, 2, [1, 2]), _row(2, 3, [2, 3])]
    result = analyse(
        config, rows=rows, recording=_write(tmp_path / "b.jsonl", _healthy()), faults=[], engines=ENGINES, wall_s=1.0
    )
    _verdict(result)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "held: versions_forward, staleness_bound, engines_in_sync, tokens_accounted",
        "vacuous (not exercised by this run): faults_survived, regression_caught, restart_alerted",
    ]


def _drain(seq: int, **fields: Any) -> dict[str, Any]:
    event = {"type": "drain.report", "policy": "demo", "consumer": "r", "seq": seq, "current": 3, "kept": 1}
    return {"subject": "weightbus.demo.drains", "seq": 100 + seq, "received_at": 200.0, "event": {**event, **fields}}


def test_waste_and_bias_come_from_the_drain_reports(tmp_path: Path) -> None:
    config = DemoConfig(steps=2, out_dir=None, faults=False)
    drains = [
        _drain(
            1,
            tokens_generated=100,
            tokens_trained=70,
            tokens_not_trained={"stale": 30},
            in_flight_versions_avg=0.5,
            in_queue_versions_avg=1.0,
            by_length={"kept": {"0-16": 2}, "recycled": {"17-64": 2}},
        ),
        _drain(
            2,
            tokens_generated=50,
            tokens_trained=40,
            tokens_not_trained={"stale": 5, "aborted": 5},
            early_aborts=1,
            tokens_saved=12,
            in_flight_versions_avg=1.5,
            by_length={"kept": {"17-64": 2}},
            by_reward={"aborted": {"<=0": 1}},
        ),
    ]
    recording = _write(tmp_path / "bus.jsonl", _healthy() + drains)
    s = analyse(config, rows=[_row(1, 2, [2])], recording=recording, faults=[], engines=ENGINES, wall_s=1.0).summary
    assert (s["drain_tokens_generated"], s["drain_tokens_trained"]) == (150, 110)
    assert s["tokens_not_trained_by_reason"] == {"stale": 35, "aborted": 5}
    assert (s["early_aborts"], s["tokens_saved"]) == (1, 12)
    assert s["in_flight_versions_avg"] == pytest.approx(1.0) and s["in_queue_versions_avg"] == pytest.approx(1.0)
    assert s["kept_share_by_length"] == {"0-16": 1.0, "17-64": 0.5}
    assert s["kept_share_by_reward"] == {"<=0": 0.0}


def _admission_run(tmp_path: Path, wasted: int, step_s: float, reward_shift: float = 0.0, wait_s: float = 0.1) -> Any:
    config = DemoConfig(steps=4, out_dir=None, faults=False)
    recording = _write(tmp_path / "bus.jsonl", _healthy())
    rows = [
        _row(i, i + 1, [i + 1])
        | {
            "tokens_not_trained": wasted,
            "step_s": step_s,
            "batch_wait_s": wait_s,
            "time": 1000.0 + i * step_s,
            "reward": 0.1 * i + reward_shift,
        }
        for i in range(1, 5)
    ]
    return analyse(config, rows=rows, recording=recording, faults=[], engines=ENGINES, wall_s=1.0)


def test_admission_numbers_compare_each_mode_with_the_filter_alone(tmp_path: Path) -> None:
    from weightbus.rl.writers import admission_numbers, write_admission_tradeoff

    def run(wasted: int, step_s: float) -> Any:
        return _admission_run(tmp_path, wasted, step_s)

    results = {
        ("off", 0): [run(40, 1.0)],
        ("bounded", 0): [run(2, 2.0)],
        ("cap", 0): [run(10, 1.0)],
        ("off", 1): [run(5, 1.0)],
    }
    numbers = admission_numbers(results)
    assert list(numbers["runs"]) == ["off", "cap", "bounded"]
    off, bounded = numbers["runs"]["off"]["0"], numbers["runs"]["bounded"]["0"]
    assert off["tokens_not_trained_share"] == pytest.approx(0.4) and bounded[
        "tokens_not_trained_share"
    ] == pytest.approx(0.02)
    assert off["wall_s"] == pytest.approx(4.0) and bounded["wall_s"] == pytest.approx(8.0)
    assert off["generated_tokens_per_s"] == pytest.approx(25.0) and bounded["generated_tokens_per_s"] == pytest.approx(
        12.5
    )
    assert bounded["batch_wait_share"] == pytest.approx(0.05)  # 0.1 s of each 2 s step waited for the batch
    versus = numbers["versus_off"]["0"]
    assert versus["common_s"] == pytest.approx(4.0) and versus["repeats"] == 1
    assert versus["bounded"]["rate_vs_off"] == pytest.approx(0.5)
    # After the same 4 s, the slower run has trained 2 steps (rewards 0.1, 0.2) against off's 4 (0.1 .. 0.4).
    assert versus["bounded"]["reward_at_common_s"] == pytest.approx(0.15)
    assert versus["bounded"]["reward_vs_off"] == pytest.approx(0.15 - 0.25)
    assert versus["bounded"]["reward_vs_off_se"] is None  # one repeat: no spread to judge the gap against
    assert versus["off"]["rate_vs_off"] == pytest.approx(1.0)
    assert set(numbers["versus_off"]) == {"0", "1"} and set(numbers["versus_off"]["1"]) == {
        "repeats",
        "common_s",
        "common_s_each",
        "off",
    }
    assert versus["bounded"]["trained_rate_vs_off"] == pytest.approx((12.5 * 0.98) / (25.0 * 0.6))
    assert numbers["targets"]["0"]["bounded"] == {
        "tokens_not_trained": True,  # 2 % < 5 %
        "reward_no_lower": "not met",
        "rate_at_least_90_percent": False,
    }
    assert numbers["targets"]["0"]["cap"]["tokens_not_trained"] is False  # 10 %
    write_admission_tradeoff(results, tmp_path / "out")
    assert (tmp_path / "out" / "admission-tradeoff.png").stat().st_size > 0
    written = json.loads((tmp_path / "out" / "admission-tradeoff.json").read_text())
    assert written["versus_off"]["0"]["cap"]["tokens_not_trained_share"] == pytest.approx(0.1)


def test_repeats_are_paired_with_off_run_by_run(tmp_path: Path) -> None:
    from weightbus.rl.writers import admission_numbers, write_admission_tradeoff

    # Repeat 1 is a slow machine for both modes, repeat 2 a fast one: pairing compares like with like.
    results = {
        ("off", 1): [_admission_run(tmp_path, 5, 2.0), _admission_run(tmp_path, 5, 1.0)],
        ("bounded", 1): [
            _admission_run(tmp_path, 0, 2.0, reward_shift=-0.05),
            _admission_run(tmp_path, 1, 1.0, reward_shift=0.03, wait_s=0.5),
        ],
    }
    numbers = admission_numbers(results)
    bounded = numbers["runs"]["bounded"]["1"]
    assert len(bounded["repeats"]) == 2 and bounded["tokens_generated"] == 200  # summed over the repeats
    assert bounded["tokens_not_trained_share_range"] == pytest.approx([0.0, 0.01])
    assert bounded["batch_wait_share"] == pytest.approx((0.05 + 0.5) / 2)
    versus = numbers["versus_off"]["1"]
    assert versus["repeats"] == 2 and versus["common_s_each"] == pytest.approx([8.0, 4.0])
    # Same speed as off in each repeat: the rate ratio is 1 in both, though the repeats' rates differ by 2x.
    assert versus["bounded"]["rate_vs_off_each"] == pytest.approx([1.0, 1.0])
    assert versus["bounded"]["reward_vs_off_each"] == pytest.approx([-0.05, 0.03])
    assert versus["bounded"]["reward_vs_off"] == pytest.approx(-0.01)
    assert versus["bounded"]["reward_vs_off_se"] == pytest.approx(0.04)
    assert versus["bounded"]["tokens_not_trained_share_max"] == pytest.approx(0.01)
    target = numbers["targets"]["1"]["bounded"]
    assert target == {
        "tokens_not_trained": False,  # 1 % in repeat 2 is not below 1 %
        "reward_no_lower": "within noise",  # -0.01 with a standard error of 0.04
        "rate_at_least_90_percent": True,
    }
    write_admission_tradeoff(results, tmp_path / "out")
    assert (tmp_path / "out" / "admission-tradeoff.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("mean", "se", "verdict"),
    [
        (0.0, None, "met"),
        (0.01, 0.5, "met"),
        (-0.01, 0.01, "within noise"),
        (-0.03, 0.01, "not met"),
        (-0.01, None, "not met"),
        (None, None, "unknown"),
    ],
)
def test_reward_verdict(mean: float | None, se: float | None, verdict: str) -> None:
    from weightbus.rl.writers import reward_verdict

    assert reward_verdict(mean, se) == verdict


def _recycling_row(step: int) -> dict[str, Any]:
    """A step at bound 1 whose kept groups are all fresh while the drain judged (and recycled) a group 7 behind."""
    return _row(step, 5, [5, 5]) | {"recycled": 1, "staleness_avg": 3.5, "staleness_max": 7}


def test_the_step_line_shows_the_trained_staleness_and_the_judged_one_apart() -> None:
    from weightbus.demo.supervisor import _format_step

    line = _format_step(_recycling_row(1) | {"step_s": 0.2, "weightbus_s": 0.01}, None)
    assert "staleness avg 0.00 max 0 (judged max 7)" in line
    assert "avg 3.50" not in line


def test_the_summary_gives_the_trained_staleness_and_no_unchecked_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightbus.cli.demo import _print_summary

    config = DemoConfig(steps=2, max_staleness=1, out_dir=None, faults=False)
    rows = [_recycling_row(1), _recycling_row(2)]
    result = analyse(
        config, rows=rows, recording=_write(tmp_path / "b.jsonl", _healthy()), faults=[], engines=ENGINES, wall_s=1.0
    )
    s = result.summary
    assert (s["trained_staleness_avg"], s["trained_staleness_max"]) == (0.0, 0)
    assert (s["judged_staleness_avg"], s["judged_staleness_max"]) == (3.5, 7)
    assert result.checks["staleness_bound"] == "held"
    _print_summary(result)
    out = capsys.readouterr().out
    assert "staleness trained avg 0.00 max 0 (judged max 7)" in out
    assert "target" not in out
    # report.json names each staleness for what it is.
    write_report(result, tmp_path / "out")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    step = report["steps"][0]
    assert (step["trained_staleness_avg"], step["trained_staleness_max"]) == (0.0, 0)
    assert (step["judged_staleness_avg"], step["judged_staleness_max"]) == (3.5, 7)
    assert "staleness_max" not in step and "staleness_max" not in report["summary"]


def _served(step: int, rollout: str | None, generated: int, not_trained: int) -> dict[str, Any]:
    row = _row(step, step + 1, [step + 1]) | {"tokens_generated": generated, "tokens_not_trained": not_trained}
    return row if rollout is None else row | {"rollout_id": rollout}


@pytest.mark.parametrize("named", [True, False], ids=["rollout_id", "older rows"])
def test_tokens_not_trained_cover_every_rollout_process_of_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], named: bool
) -> None:
    from weightbus.cli.demo import _print_summary

    first, second = ("rollout:a", "rollout:b") if named else (None, None)
    # The rollout restarted after step 2: the second one counts from zero again.
    rows = [
        _served(1, first, 100, 10),
        _served(2, first, 300, 60),
        _served(3, second, 50, 5),
        _served(4, second, 120, 20),
    ]
    config = DemoConfig(steps=4, out_dir=None, faults=False)
    result = analyse(
        config, rows=rows, recording=_write(tmp_path / "b.jsonl", _healthy()), faults=[], engines=ENGINES, wall_s=1.0
    )
    s = result.summary
    assert (s["tokens_generated"], s["tokens_trained"], s["tokens_not_trained"]) == (420, 340, 80)
    assert s["rollout_processes"] == 2
    assert s["tokens_not_trained_share"] == pytest.approx(80 / 420)  # not the last process's 20 / 120
    assert s["tokens_generated"] >= s["tokens_trained"]
    assert result.checks["tokens_accounted"] == "held"
    _print_summary(result)
    assert "19% of 420 tokens generated (by 2 rollout processes) not trained on" in capsys.readouterr().out


def test_tokens_accounted_fails_on_counts_that_do_not_add_up(tmp_path: Path) -> None:
    config = DemoConfig(steps=2, out_dir=None, faults=False)
    # One process whose count went backwards, and a step claiming more not trained than generated.
    rows = [_served(1, "rollout:a", 300, 10), _served(2, "rollout:a", 200, 250)]
    result = analyse(
        config, rows=rows, recording=_write(tmp_path / "b.jsonl", _healthy()), faults=[], engines=ENGINES, wall_s=1.0
    )
    assert result.checks["tokens_accounted"] == "failed"
    problems = result.problems["tokens_accounted"]
    assert any("200 tokens generated after 300" in p for p in problems)
    assert any("250 tokens not trained of 200 generated" in p for p in problems)
