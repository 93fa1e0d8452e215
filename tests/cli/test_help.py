"""Every command explains itself with --help, and the console script is wired."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from weightbus.cli import app

COMMANDS = [
    "server",
    "schema",
    "record",
    "replay",
    "publish",
    "status",
    "watch",
    "follow",
    "engine",
    "rollout",
    "trainer",
    "demo",
]


def test_top_level_help_lists_every_command() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output
    assert len(result.output.splitlines()) > 5


def test_schema_command_prints_every_family() -> None:
    import json

    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0
    assert set(json.loads(result.output)) == {"weights", "applied", "alerts", "drains", "counter", "admission"}
    bad = CliRunner().invoke(app, ["schema", "nope"])
    assert bad.exit_code != 0


def test_version_module_entry_point_and_completion() -> None:
    import subprocess
    import sys

    from weightbus.cli import package_version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"weightbus {package_version()}"
    run = subprocess.run([sys.executable, "-m", "weightbus", "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == f"weightbus {package_version()}"
    assert "--install-completion" in CliRunner().invoke(app, ["--help"]).output


def test_every_long_running_command_can_bind_metrics_for_a_cluster() -> None:
    for command in ("watch", "follow", "record", "rollout", "trainer"):
        text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "--metrics-host" in text and "--metrics-port" in text, command
