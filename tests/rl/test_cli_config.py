"""``weightbus rollout`` / ``trainer`` / ``engine``: one config object from ``--config FILE`` and the flags.

Before, each child of the demo was argv spelled in several places, ``--lora`` meant three things and ``--policy``
defaulted to ``policy`` on these two commands only. Now a flag given overrides the file's field, an unknown or
out-of-range field is one ``error:`` line and exit 2, and ``--policy`` is required (or ``WEIGHTBUS_POLICY``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from weightbus.cli import app
from weightbus.errors import ConfigError
from weightbus.process.progress import ProgressPrinter, format_progress
from weightbus.refengine.config import EngineConfig
from weightbus.rl.config import RolloutConfig, TrainerConfig, dump_config, load_config, make_config


def test_flags_given_override_the_file_and_the_rest_comes_from_it(tmp_path: Path) -> None:
    base = RolloutConfig(router_url="http://r:1", policy="p", group_size=4, seed=7)
    path = dump_config(base, tmp_path / "rollout.json")
    loaded = load_config(path, RolloutConfig)
    assert loaded == base
    merged = make_config(RolloutConfig, loaded, seed=9, group_size=None, follow_lora=True)
    assert (merged.seed, merged.group_size, merged.follow_lora, merged.router_url) == (9, 4, True, "http://r:1")


def test_a_bad_config_is_a_typed_error_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="group_size"):
        make_config(RolloutConfig, router_url="r", policy="p", group_size=1)
    with pytest.raises(ConfigError, match="policy"):
        make_config(TrainerConfig, router_url="r", run_dir="d")
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"router_url": "r", "policy": "p", "group_sise": 4}))
    with pytest.raises(ConfigError, match="group_sise"):
        load_config(path, RolloutConfig)
    assert make_config(EngineConfig, port=1234, model="policy").model == "policy"
    with pytest.raises(ConfigError, match="model"):
        make_config(EngineConfig, model="gpt")


@pytest.mark.parametrize("command", ["rollout", "trainer"])
def test_policy_is_required_on_the_rl_commands(command: str, tmp_path: Path) -> None:
    args = [command, "--router", "http://127.0.0.1:9", "--nats", "nats://127.0.0.1:9"]
    if command == "trainer":
        args += ["--run-dir", str(tmp_path)]
    result = CliRunner().invoke(app, args, env={"WEIGHTBUS_POLICY": None})
    assert result.exit_code == 2
    assert "--policy is required" in result.output and "WEIGHTBUS_POLICY" in result.output


def test_an_unknown_field_in_the_config_file_is_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps({"router_url": "r", "policy": "p", "lora": True}))
    result = CliRunner().invoke(app, ["rollout", "--config", str(path)])
    assert result.exit_code == 2 and "unknown field `lora`" in result.output, result.output


def test_each_lora_flag_means_one_thing() -> None:
    runner = CliRunner()
    env = {"COLUMNS": "200"}
    trainer = runner.invoke(app, ["trainer", "--help"], env=env).output
    rollout = runner.invoke(app, ["rollout", "--help"], env=env).output
    demo = runner.invoke(app, ["demo", "--help"], env=env).output
    assert "--lora-rank" in trainer and "--lora-rank" in demo and "--follow-lora" in rollout
    for text in (trainer, rollout, demo):
        assert "--lora " not in text


def test_progress_is_plain_lines_off_a_terminal_and_nothing_when_quiet() -> None:
    out = io.StringIO()
    with ProgressPrinter("trainer", total=3, stream=out) as printer:
        printer.report({"step": "1/3", "version": 2, "reward": 0.25, "staleness_max": None}, completed=1)
    assert out.getvalue() == "trainer step=1/3 version=2 reward=0.250 staleness_max=-\n"
    assert "\x1b" not in out.getvalue()
    quiet = io.StringIO()
    with ProgressPrinter("rollout", quiet=True, stream=quiet) as printer:
        printer.report({"batch": 1})
    assert quiet.getvalue() == ""
    assert format_progress("rollout", {"batch": 2, "kept": 8}) == "rollout batch=2 kept=8"
