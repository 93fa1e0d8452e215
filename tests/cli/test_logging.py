"""Every command takes ``--log-level`` and ``--log-format``; the lines are human on a terminal, JSON when asked.

The subprocess runs connect to a port nothing listens on: the bus logs a debug line (``error=``) and an info line
(``url=``) before the command's one ``error:`` line, so the level and the format show without a server.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner

from weightbus.cli import app
from weightbus.process.logs import HumanFormatter, JsonFormatter, choose_logging, setup_logging

_CLOSED = "nats://127.0.0.1:1"  # a privileged port nothing listens on: refused at once
_HUMAN = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) \S+ ")


def _leaves(command: typer.core.TyperGroup | typer.core.TyperCommand, path: list[str]) -> Iterator[list[str]]:
    sub = getattr(command, "commands", None)
    if sub is None:
        yield path
        return
    for name, child in sorted(sub.items()):
        yield from _leaves(child, [*path, name])


_COMMANDS = list(_leaves(typer.main.get_command(app), []))


def test_the_walk_found_the_commands() -> None:
    assert ["demo"] in _COMMANDS and ["stream", "create"] in _COMMANDS and len(_COMMANDS) >= 14


@pytest.mark.parametrize("path", _COMMANDS, ids=" ".join)
def test_every_command_lists_the_log_options(path: list[str]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "--log-level" in result.output and "--log-format" in result.output
    assert "WEIGHTBUS_LOG_LEVEL" in result.output and "WEIGHTBUS_LOG_FORMAT" in result.output


def _status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTBUS_LOG_")}
    return subprocess.run(
        [sys.executable, "-m", "weightbus.cli", "status", "-p", "demo", "--nats", _CLOSED, "--connect-timeout", "0.5"]
        + list(args),
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


def _log_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not line.startswith("error: ")]


def test_by_default_nothing_below_warning_is_logged() -> None:
    done = _status()
    assert done.returncode == 5, done.stderr
    assert _log_lines(done.stderr) == [], done.stderr
    assert done.stderr.startswith("error: cannot connect to NATS")


@pytest.mark.parametrize(
    ("args", "env"),
    [(["--log-level", "debug"], None), ([], {"WEIGHTBUS_LOG_LEVEL": "debug"}), (["--log-level", "DEBUG"], None)],
    ids=["flag", "env", "upper-case"],
)
def test_debug_logs_debug_lines_as_json_off_a_terminal(args: list[str], env: dict[str, str] | None) -> None:
    done = _status(*args, env=env)
    assert done.returncode == 5, done.stderr
    records = [json.loads(line) for line in _log_lines(done.stderr)]  # stderr is a pipe: auto means json
    assert any(r["level"] == "debug" and r["logger"].startswith("weightbus") and "error" in r for r in records)
    assert any(r["level"] == "info" and r.get("url") == _CLOSED for r in records), records


def test_info_logs_no_debug_line() -> None:
    records = [json.loads(line) for line in _log_lines(_status("--log-level", "info").stderr)]
    assert records and {r["level"] for r in records} == {"info"}


def test_json_lines_carry_the_extra_fields() -> None:
    done = _status("--log-level", "debug", "--log-format", "json")
    records = [json.loads(line) for line in _log_lines(done.stderr)]
    assert {"ts", "level", "logger", "msg"} <= set(records[0])
    assert any(r.get("url") == _CLOSED and r["msg"] == "NATS connection closed" for r in records), records


@pytest.mark.parametrize(
    ("args", "env"), [(["--log-format", "human"], None), ([], {"WEIGHTBUS_LOG_FORMAT": "human"})], ids=["flag", "env"]
)
def test_human_format_when_forced_has_key_value_fields(args: list[str], env: dict[str, str] | None) -> None:
    done = _status("--log-level", "debug", *args, env=env)
    lines = _log_lines(done.stderr)
    assert lines and all(_HUMAN.match(line) for line in lines), done.stderr
    assert any(" INFO weightbus.bus NATS connection closed " in line and f"url={_CLOSED}" in line for line in lines)
    assert any(line.startswith(tuple("0123456789")) and " error=" in line for line in lines)
    assert not any(line.startswith("{") for line in lines)


def test_verbose_still_lowers_the_level() -> None:
    records = [json.loads(line) for line in _log_lines(_status("-vv").stderr)]
    assert any(r["level"] == "debug" for r in records)


@pytest.mark.parametrize(
    ("args", "flag"), [(["--log-level", "loud"], "--log-level"), (["--log-format", "xml"], "--log-format")]
)
def test_a_bad_value_is_one_error_line(args: list[str], flag: str) -> None:
    result = CliRunner().invoke(app, ["schema", *args])
    assert result.exit_code == 2
    assert f"error: {flag}" in result.output


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restored() -> Iterator[None]:
    yield
    choose_logging()


def test_auto_is_human_on_a_terminal_and_json_on_a_pipe(monkeypatch: pytest.MonkeyPatch, restored: None) -> None:
    monkeypatch.delenv("WEIGHTBUS_LOG_FORMAT", raising=False)
    for stream, formatter in ((_Terminal(), HumanFormatter), (io.StringIO(), JsonFormatter)):
        monkeypatch.setattr(sys, "stderr", stream)
        setup_logging()
        assert type(logging.getLogger().handlers[0].formatter) is formatter
    choose_logging(fmt="json")
    monkeypatch.setattr(sys, "stderr", _Terminal())
    setup_logging()
    assert type(logging.getLogger().handlers[0].formatter) is JsonFormatter


def test_the_human_line() -> None:
    record = logging.makeLogRecord(
        {"name": "weightbus.consumers", "levelno": logging.WARNING, "levelname": "WARNING", "msg": "tracker deaf"}
    )
    record.policy = "demo"
    record.age_s = 3.1
    record.note = "two words"
    line = HumanFormatter().format(record)
    assert re.fullmatch(
        r'\d\d:\d\d:\d\d WARNING weightbus\.consumers tracker deaf policy=demo age_s=3\.1 note="two words"', line
    ), line


def test_the_choice_does_not_outlive_the_command() -> None:
    CliRunner().invoke(app, ["schema", "--log-level", "debug"])
    setup_logging()
    assert logging.getLogger().level == logging.WARNING
