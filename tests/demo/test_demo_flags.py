"""``weightbus demo``'s admission and early-abort settings reach the rollout's config file; bad flags are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from weightbus.cli import app
from weightbus.demo import DemoConfig
from weightbus.demo.children import Layout
from weightbus.rl.config import RolloutConfig, load_config


def _rollout_config(tmp_path: Path, config: DemoConfig) -> RolloutConfig:
    layout = Layout(tmp=tmp_path, nats_url="nats://127.0.0.1:1", engine_ports=[1, 2], router_port=3)
    layout.rollout(config, 0)  # writes the child's config; starts nothing
    return load_config(tmp_path / "rollout-0.json", RolloutConfig)


def test_the_default_is_bounded_admission_with_early_abort(tmp_path: Path) -> None:
    spec = _rollout_config(tmp_path, DemoConfig(out_dir=None))
    assert (spec.admission, spec.cap, spec.early_abort) == ("bounded", None, True)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (DemoConfig(out_dir=None, admission="cap"), ("cap", 2, True)),
        (DemoConfig(out_dir=None, admission="cap", cap=3), ("cap", 3, True)),
        (DemoConfig(out_dir=None, admission="off", early_abort=False), ("off", None, False)),
    ],
)
def test_admission_and_early_abort_reach_the_rollout(tmp_path: Path, config: DemoConfig, expected: tuple) -> None:
    spec = _rollout_config(tmp_path, config)
    assert (spec.admission, spec.cap, spec.early_abort) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--admission", "sometimes"], "--admission must be off, cap or bounded"),
        (["--compare-admission", "0,x"], "--compare-admission takes bounds like 0,1,2,4"),
        (["--compare-admission", "-1"], "--compare-admission needs one or more bounds >= 0"),
        (["--repeats", "3"], "--repeats only applies to --compare-admission"),
    ],
)
def test_bad_admission_flags_are_refused(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["demo", *args])
    assert result.exit_code == 2
    assert message in result.output
