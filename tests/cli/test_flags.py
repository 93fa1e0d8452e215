"""One meaning per flag, everywhere: the same name has the same type and environment variable on every
command; a missing required option is one ``error:`` line; ``--policy`` and the NATS URL come from the
environment when not given (``WEIGHTBUS_POLICY``; ``WEIGHTBUS_NATS``, else ``NATS_URL``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from weightbus.cli import app
from weightbus.embedded.server import free_port

runner = CliRunner()
#: The commands whose --policy is an optional filter rather than the policy they act on.
_POLICY_FILTERS = {"watch"}


def _clean_env(**values: str | None) -> dict[str, str | None]:
    """No NATS URL or policy from the caller's shell, plus ``values``."""
    return {"WEIGHTBUS_NATS": None, "NATS_URL": None, "WEIGHTBUS_POLICY": None, **values}


def one_line_error(result: Any, code: int, *needles: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert result.exit_code == code, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not any(box in result.output for box in "╭│╰"), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def _commands() -> Iterator[tuple[str, Any]]:
    def walk(path: str, command: Any) -> Iterator[tuple[str, Any]]:
        subcommands = getattr(command, "commands", None)
        if subcommands is None:
            yield path, command
            return
        for name, sub in subcommands.items():
            yield from walk(f"{path} {name}".strip(), sub)

    yield from walk("", get_command(app))


def _options() -> dict[str, dict[str, tuple[Any, ...]]]:
    """flag -> command -> (type, is_flag, envvars) of that flag on that command."""
    table: dict[str, dict[str, tuple[Any, ...]]] = {}
    for path, command in _commands():
        for param in command.params:
            envvar = param.envvar if isinstance(param.envvar, list | tuple) else [param.envvar]
            shape = (
                # ``X | None`` where a ``--config`` file may give the value instead: the same flag.
                str(param.type_descriptor.annotation).removesuffix(" | None"),
                getattr(param, "is_flag", False),
                tuple(e for e in envvar if e),
            )
            for flag in param.opts:
                if flag.startswith("--"):
                    table.setdefault(flag, {})[path] = shape
    return table


#: Commands whose options may come from a ``--config`` file instead: required once both are read.
_CONFIGURED = ("rollout", "trainer")


@pytest.mark.parametrize("flag", sorted(_options()))
def test_a_flag_means_the_same_thing_on_every_command(flag: str) -> None:
    by_command = _options()[flag]
    assert len(set(by_command.values())) == 1, by_command


def test_publish_names_an_adapter_with_lora_adapter() -> None:
    table = _options()
    assert "publish" in table["--lora-adapter"] and "publish" not in table.get("--lora", {})


@pytest.mark.parametrize(
    "path",
    [p for p, c in _commands() if any("--policy" in param.opts for param in c.params)],
)
def test_policy_is_required_wherever_a_command_acts_on_one(path: str) -> None:
    command = dict(_commands())[path]
    param = next(p for p in command.params if "--policy" in p.opts)
    assert param.envvar == "WEIGHTBUS_POLICY"
    if path in _CONFIGURED:
        assert not param.required and "required" in (param.help or "")  # checked after the file is read
    else:
        assert param.required == (path not in _POLICY_FILTERS)


def test_the_api_key_has_one_environment_variable() -> None:
    table = _options()["--api-key"]
    assert {envvars for _, _, envvars in table.values()} == {("WEIGHTBUS_API_KEY",)}, table
    assert {"publish", "status", "engine"} <= set(table)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["status"], "--policy"),
        (["publish", "--no-engines"], "--policy"),
        (["follow"], "--policy"),
        (["record"], "--out"),
        (["replay"], "'trace'"),
        (["status", "--policy", "p", "--connect-timeout", "soon"], "--connect-timeout"),
        (["status", "--policy", "p", "--frobnicate"], "--frobnicate"),
    ],
)
def test_a_usage_error_is_one_error_line_naming_the_command(args: list[str], needle: str) -> None:
    result = runner.invoke(app, args, env=_clean_env())
    one_line_error(result, 2, f"weightbus {args[0]}", needle, "--help")


def test_a_missing_policy_in_a_real_process_is_one_line() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    run = subprocess.run(
        [sys.executable, "-m", "weightbus", "status"], capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr
    assert "WEIGHTBUS_POLICY" in run.stderr


@pytest.mark.nats
def test_the_policy_and_the_nats_url_come_from_the_environment(nats_url: str, policy: str) -> None:
    shown = runner.invoke(app, ["status"], env=_clean_env(WEIGHTBUS_POLICY=policy, NATS_URL=nats_url))
    assert shown.exit_code == 4, shown.output  # reached the server; the policy never published
    assert f"policy     {policy}" in shown.stdout
    # WEIGHTBUS_NATS wins over NATS_URL, and --nats over both.
    dead = f"nats://127.0.0.1:{free_port()}"
    both = _clean_env(WEIGHTBUS_POLICY=policy, WEIGHTBUS_NATS=dead, NATS_URL=nats_url)
    one_line_error(runner.invoke(app, ["status", "--connect-timeout", "1"], env=both), 5, dead)
    assert runner.invoke(app, ["status", "--nats", nats_url], env=both).exit_code == 4
    # An empty variable counts as unset.
    empty = _clean_env(WEIGHTBUS_POLICY=policy, WEIGHTBUS_NATS="", NATS_URL=nats_url)
    assert runner.invoke(app, ["status"], env=empty).exit_code == 4


def test_server_without_a_binary_suggests_no_flag_it_lacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    result = runner.invoke(app, ["server"])
    one_line_error(result, 1, "no nats-server binary found")
    assert "--nats" not in result.stderr


def test_the_library_reads_the_nats_url_in_the_same_order() -> None:
    from weightbus.bus.options import NATS_URL_ENV, nats_url_from_env

    assert NATS_URL_ENV == ("WEIGHTBUS_NATS", "NATS_URL")
    assert nats_url_from_env("d", {}) == "d"
    assert nats_url_from_env("d", {"NATS_URL": "nats://b:1"}) == "nats://b:1"
    assert nats_url_from_env("d", {"NATS_URL": "nats://b:1", "WEIGHTBUS_NATS": "nats://a:1"}) == "nats://a:1"
    assert nats_url_from_env("d", {"NATS_URL": "nats://b:1", "WEIGHTBUS_NATS": ""}) == "nats://b:1"


def test_an_empty_policy_variable_counts_as_unset() -> None:
    one_line_error(runner.invoke(app, ["status"], env=_clean_env(WEIGHTBUS_POLICY="")), 2, "--policy")


def test_an_abort_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import weightbus.cli.status as status

    def eof(coro: Any) -> None:
        coro.close()
        raise EOFError  # what typer turns into Abort (an input closed under a prompt)

    monkeypatch.setattr(status, "run_async", eof)
    one_line_error(runner.invoke(app, ["status", "--policy", "p"], env=_clean_env()), 1, "aborted")
