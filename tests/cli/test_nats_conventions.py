"""The ``nats`` CLI's conventions on every connecting command: ``-s``/``--server``, ``NATS_*`` variables and
``--context``/``NATS_CONTEXT``, in the order flag > ``WEIGHTBUS_*`` > ``NATS_*`` > context.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from weightbus.bus.options import ENV, NATS_ENV, ConnectOptions
from weightbus.cli import app
from weightbus.cli.connection import with_connection
from weightbus.cli.options import DEFAULT_NATS, NatsOption
from weightbus.embedded.server import EmbeddedNats, free_port

runner = CliRunner()
SECRET = "cli-ctx-s3cret"
#: Every variable that could reach a command from the caller's shell, unset.
_UNSET = {var: None for var in [*ENV.values(), *NATS_ENV.values(), "WEIGHTBUS_NATS", "NATS_URL", "NATS_CONTEXT"]}


def _connecting_commands() -> list[str]:
    found = []

    def walk(path: str, command: object) -> None:
        subs = getattr(command, "commands", None)
        if subs is None:
            if any("--creds" in p.opts for p in command.params):  # type: ignore[attr-defined]
                found.append(path)
            return
        for name, sub in subs.items():
            walk(f"{path} {name}".strip(), sub)

    walk("", get_command(app))
    return found


def test_every_connecting_command_takes_server_and_context() -> None:
    commands = _connecting_commands()
    assert {"status", "publish", "follow", "watch", "stream check", "rollout", "trainer"} <= set(commands)
    top = get_command(app)
    for path in commands:
        command = top
        for part in path.split():
            command = command.commands[part]  # type: ignore[attr-defined]
        opts = {o for p in command.params for o in p.opts}
        assert {"--nats", "--server", "-s", "--context"} <= opts, path


def test_help_shows_the_new_options() -> None:
    result = runner.invoke(app, ["stream", "check", "--help"], env={**_UNSET, "COLUMNS": "200"})
    assert result.exit_code == 0
    for needle in ("--server", "-s", "--context", "NATS_CONTEXT", "NATS_CREDS", "NATS_PASSWORD"):
        assert needle in result.stdout, needle


def _resolved(args: list[str], env: dict[str, str | None]) -> tuple[str, ConnectOptions]:
    """The URL and options a connecting command would use, without connecting anywhere."""
    seen: dict[str, object] = {}

    def probe(nats: NatsOption = DEFAULT_NATS, connection: ConnectOptions = ConnectOptions()) -> None:  # noqa: B008
        seen.update(nats=nats, connection=connection)

    probe_app = typer.Typer()
    probe_app.command()(with_connection(probe))
    result = runner.invoke(probe_app, args, env={**_UNSET, **env})
    assert result.exit_code == 0, result.output
    return str(seen["nats"]), seen["connection"]  # type: ignore[return-value]


def test_the_url_comes_from_the_flag_the_variables_then_the_context(tmp_path: Path) -> None:
    home = {"XDG_CONFIG_HOME": str(tmp_path)}
    _context(tmp_path, "c", {"url": "nats://ctx.invalid:1", "token": "ctx-token"})
    assert _resolved([], home)[0] == DEFAULT_NATS
    url, opts = _resolved(["--context", "c"], home)
    assert (url, opts.token) == ("nats://ctx.invalid:1", "ctx-token")
    assert _resolved([], {**home, "NATS_CONTEXT": "c"})[0] == "nats://ctx.invalid:1"
    assert _resolved(["--context", "c"], {**home, "NATS_URL": "nats://n.invalid:1"})[0] == "nats://n.invalid:1"
    assert _resolved(["--context", "c"], {**home, "WEIGHTBUS_NATS": "nats://w.invalid:1"})[0] == "nats://w.invalid:1"
    # A flag equal to the default is still a flag: the context does not replace it.
    assert _resolved(["--context", "c", "-s", DEFAULT_NATS], home)[0] == DEFAULT_NATS
    url, opts = _resolved(["--context", "c", "--server", "nats://f.invalid:1", "--token", "flag-token"], home)
    assert (url, opts.token) == ("nats://f.invalid:1", "flag-token")


def test_a_config_file_url_beats_the_context(tmp_path: Path) -> None:
    """``rollout``/``trainer`` take ``--config FILE``: its ``nats_url`` is explicit, above a context."""
    seen: dict[str, object] = {}

    def probe(
        config: Annotated[Path | None, typer.Option("--config")] = None,
        nats_url: Annotated[str | None, typer.Option("--nats")] = None,
        connection: ConnectOptions = ConnectOptions(),  # noqa: B008
    ) -> None:
        seen["nats_url"] = nats_url

    probe_app = typer.Typer()
    probe_app.command()(with_connection(probe))
    _context(tmp_path, "c", {"url": "nats://ctx.invalid:1"})
    env = {**_UNSET, "XDG_CONFIG_HOME": str(tmp_path)}
    with_url, without_url = tmp_path / "with.json", tmp_path / "without.json"
    with_url.write_text(json.dumps({"nats_url": "nats://file.invalid:1"}))
    without_url.write_text(json.dumps({"policy": "p"}))
    for args, expected in [
        (["--context", "c"], "nats://ctx.invalid:1"),
        (["--context", "c", "--config", str(without_url)], "nats://ctx.invalid:1"),
        (["--context", "c", "--config", str(with_url)], None),  # the command reads it from the file
        (["--context", "c", "--config", str(with_url), "--nats", "nats://f.invalid:1"], "nats://f.invalid:1"),
    ]:
        result = runner.invoke(probe_app, args, env=env)
        assert result.exit_code == 0 and seen["nats_url"] == expected, (args, result.output, seen)


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    conf = tmp_path / "users.conf"
    conf.write_text("authorization { users: [ {user: alice, password: %s} ] }\n" % SECRET)
    with EmbeddedNats(config=conf) as server:
        yield server


def _context(home: Path, name: str, body: dict[str, str]) -> None:
    path = home / "nats" / "context" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))


def _create(args: list[str], env: dict[str, str | None]) -> tuple[int, str]:
    result = runner.invoke(app, ["stream", "create", "--connect-timeout", "3", *args], env={**_UNSET, **env})
    return result.exit_code, result.output


@pytest.mark.nats
def test_credentials_and_urls_in_the_nats_cli_order(password_server: EmbeddedNats, tmp_path: Path) -> None:
    url = password_server.url
    dead = f"nats://127.0.0.1:{free_port()}"
    good = {"NATS_USER": "alice", "NATS_PASSWORD": SECRET}
    # -s is --nats; NATS_USER/NATS_PASSWORD authenticate.
    code, out = _create(["-s", url], good)
    assert code == 0, out
    code, out = _create(["--server", url], {**good, "NATS_PASSWORD": "wrong"})
    assert code == 5 and "authentication failed" in out and SECRET not in out, out
    # WEIGHTBUS_* wins over NATS_*, a flag over both.
    code, out = _create(["-s", url], {**good, "WEIGHTBUS_USER": "alice", "WEIGHTBUS_PASSWORD": "wrong"})
    assert code == 5 and "authentication failed" in out, out
    code, out = _create(
        ["-s", url, "--password", SECRET], {**good, "WEIGHTBUS_USER": "alice", "WEIGHTBUS_PASSWORD": "x"}
    )
    assert code == 0, out
    # A context in $XDG_CONFIG_HOME gives the URL and the credential; NATS_CONTEXT or --context picks it.
    home = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    _context(tmp_path / "xdg", "local", {"url": url, "user": "alice", "password": SECRET})
    assert _resolved(["--context", "local"], home)[0] == url  # checked first: never fall back to 4222 here
    code, out = _create([], {**home, "NATS_CONTEXT": "local"})
    assert code == 0, out
    code, out = _create(["--context", "local"], home)
    assert code == 0, out
    # Explicit values override it: the URL (flag and NATS_URL) and the password.
    code, out = _create(["--context", "local", "--nats", dead], home)
    assert code == 5 and dead in out, out
    code, out = _create(["--context", "local"], {**home, "NATS_URL": dead})
    assert code == 5 and dead in out, out
    code, out = _create(["--context", "local", "--user", "alice", "--password", "wrong"], home)
    assert code == 5 and "authentication failed" in out, out
    # ~/.config is the default when XDG_CONFIG_HOME is unset.
    _context(tmp_path / "home" / ".config", "homectx", {"url": url, "user": "alice", "password": SECRET})
    assert _resolved(["--context", "homectx"], {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": None})[0] == url
    code, out = _create(["--context", "homectx"], {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": None})
    assert code == 0, out


def test_a_missing_context_is_one_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["status", "--policy", "p", "--context", "nope"], env={**_UNSET, "XDG_CONFIG_HOME": str(tmp_path)}
    )
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nats context 'nope'" in lines[0], result.stderr
