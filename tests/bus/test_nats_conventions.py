"""The ``nats`` CLI's conventions in the library: ``NATS_*`` variables and contexts, below weightbus's own.

Precedence, per value: explicit > ``WEIGHTBUS_*`` > ``NATS_*`` > the context; the last two fill in by group
(a credential, a client certificate, a CA), and a user without a password from them is a token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weightbus.bus import ConnectOptions, connect
from weightbus.bus.options import NATS_ENV, context_path, load_context, nats_url_from_env
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import BusConfigError, BusConnectError

SECRET = "c0ntext-s3cret-pw"


def write_context(config_home: Path, name: str, body: dict[str, Any]) -> Path:
    path = config_home / "nats" / "context" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))
    return path


def test_the_nats_cli_variables_are_read_after_weightbus_ones() -> None:
    assert NATS_ENV["creds"] == "NATS_CREDS" and NATS_ENV["nkey_seed"] == "NATS_NKEY"
    env = {"NATS_USER": "n-user", "NATS_PASSWORD": "n-pw", "NATS_CA": "n-ca.pem"}
    opts = ConnectOptions.from_env(env)
    assert (opts.user, opts.password, opts.tls_ca) == ("n-user", "n-pw", "n-ca.pem")
    # WEIGHTBUS_* wins over NATS_*, an explicit value over both.
    opts = ConnectOptions.from_env({**env, "WEIGHTBUS_USER": "w-user", "WEIGHTBUS_PASSWORD": "w-pw"})
    assert (opts.user, opts.password) == ("w-user", "w-pw")
    opts = ConnectOptions.from_env({**env, "WEIGHTBUS_USER": "w-user"}, user="x-user", password="x-pw")
    assert (opts.user, opts.password) == ("x-user", "x-pw")
    # A credential from NATS_* never joins one given above it: an explicit creds file drops NATS_USER.
    opts = ConnectOptions.from_env({**env, "WEIGHTBUS_CREDS": "w.creds"})
    assert (opts.creds, opts.user, opts.password, opts.tls_ca) == ("w.creds", None, None, "n-ca.pem")
    assert ConnectOptions.from_env({"NATS_CREDS": "a.creds", "NATS_NKEY": "b.nk"}, creds="c").nkey_seed is None


def test_a_nats_user_without_a_password_is_a_token() -> None:
    opts = ConnectOptions.from_env({"NATS_USER": "tok-123"})
    assert (opts.user, opts.token) == (None, "tok-123")
    assert "tok-123" not in repr(opts) and opts.redact("x tok-123") == "x ***"
    assert ConnectOptions.from_env({"NATS_TOKEN": "tok-9"}).token == "tok-9"
    # weightbus's own --user keeps its meaning: a user with an empty password.
    assert ConnectOptions.from_env({"WEIGHTBUS_USER": "u"}).user == "u"


def test_the_url_order_ends_with_the_context(tmp_path: Path) -> None:
    write_context(tmp_path, "prod", {"url": "nats://ctx:4333"})
    env = {"XDG_CONFIG_HOME": str(tmp_path), "NATS_CONTEXT": "prod"}
    assert nats_url_from_env("d", env) == "nats://ctx:4333"
    assert nats_url_from_env("d", {**env, "NATS_URL": "nats://n:1"}) == "nats://n:1"
    assert nats_url_from_env("d", {**env, "WEIGHTBUS_NATS": "nats://w:1", "NATS_URL": "nats://n:1"}) == "nats://w:1"
    assert nats_url_from_env("d", {"XDG_CONFIG_HOME": str(tmp_path)}) == "d"
    assert nats_url_from_env("d", {"XDG_CONFIG_HOME": str(tmp_path)}, context="prod") == "nats://ctx:4333"


def test_a_context_is_read_from_xdg_config_home_or_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert context_path("a", {"HOME": str(home)}) == home / ".config" / "nats" / "context" / "a.json"
    assert context_path("a", {"HOME": str(home), "XDG_CONFIG_HOME": str(tmp_path / "x")}) == (
        tmp_path / "x" / "nats" / "context" / "a.json"
    )
    body = {
        "description": "ignored",
        "url": "tls://h:4222",
        "user": "alice",
        "password": SECRET,
        "ca": "~/ca.pem",
        "cert": "",
        "key": "",
        "creds": "",
        "nkey": "",
        "token": "",
        "nsc": "",
        "jetstream_domain": "",
    }
    write_context(home / ".config", "staging", body)
    ctx = load_context("staging", {"HOME": str(home)})
    assert ctx.url == "tls://h:4222" and dict(ctx.values) == {
        "user": "alice",
        "password": SECRET,
        "tls_ca": str(Path("~/ca.pem").expanduser()),
    }
    assert SECRET not in repr(ctx)
    # A path is read as given.
    assert load_context(str(context_path("staging", {"HOME": str(home)}))).url == "tls://h:4222"


def test_explicit_values_and_variables_override_a_context(tmp_path: Path) -> None:
    write_context(
        tmp_path, "c", {"user": "ctx-user", "password": "ctx-pw", "ca": "ctx-ca.pem", "cert": "c.pem", "key": "k.pem"}
    )
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    opts = ConnectOptions.from_env(env, context="c")
    assert (opts.user, opts.password, opts.tls_ca, opts.tls_cert, opts.tls_key) == (
        "ctx-user",
        "ctx-pw",
        "ctx-ca.pem",
        "c.pem",
        "k.pem",
    )
    opts = ConnectOptions.from_env({**env, "NATS_CONTEXT": "c", "NATS_TOKEN": "t", "WEIGHTBUS_TLS_CA": "w-ca.pem"})
    assert (opts.token, opts.user, opts.password, opts.tls_ca, opts.tls_cert) == (
        "t",
        None,
        None,
        "w-ca.pem",
        "c.pem",
    )
    opts = ConnectOptions.from_env({**env, "NATS_CONTEXT": "c"}, creds="x.creds", replicas=3)
    assert (opts.creds, opts.user, opts.replicas) == ("x.creds", None, 3)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("{not json", "not JSON"),
        ("[1]", "not a JSON object"),
        (json.dumps({"user": 7}), "user must be a string"),
        (json.dumps({"nsc": "nsc://op/acc/user"}), "does not support nsc"),
        (json.dumps({"url": "nats://h", "jetstream_domain": "hub"}), "jetstream_domain"),
    ],
)
def test_a_context_weightbus_cannot_honour_is_a_typed_error(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "nats" / "context" / "bad.json"
    path.parent.mkdir(parents=True)
    path.write_text(body)
    with pytest.raises(BusConfigError, match=needle) as info:
        ConnectOptions.from_env({"XDG_CONFIG_HOME": str(tmp_path), "NATS_CONTEXT": "bad"})
    assert str(path) in str(info.value)


def test_a_missing_context_names_its_file(tmp_path: Path) -> None:
    with pytest.raises(BusConfigError, match="nats context 'nope'.*file not found"):
        ConnectOptions.from_env({"XDG_CONFIG_HOME": str(tmp_path)}, context="nope")


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    conf = tmp_path / "users.conf"
    conf.write_text("authorization { users: [ {user: alice, password: %s} ] }\n" % SECRET)
    with EmbeddedNats(config=conf) as server:
        yield server


@pytest.mark.nats
async def test_connect_authenticates_with_nats_variables_and_a_context(
    password_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("WEIGHTBUS_USER", "WEIGHTBUS_PASSWORD", "WEIGHTBUS_TOKEN", "WEIGHTBUS_CREDS", "NATS_CONTEXT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("NATS_USER", "alice")
    monkeypatch.setenv("NATS_PASSWORD", SECRET)
    bus = await connect(password_server.url, connect_timeout=3, ensure_stream=False)  # options from NATS_*
    await bus.aclose()
    monkeypatch.setenv("NATS_PASSWORD", SECRET + "x")
    with pytest.raises(BusConnectError) as info:
        await connect(password_server.url, connect_timeout=3, ensure_stream=False)
    assert info.value.cause == "auth"
    monkeypatch.delenv("NATS_USER")
    monkeypatch.delenv("NATS_PASSWORD")
    write_context(tmp_path, "local", {"url": password_server.url, "user": "alice", "password": SECRET})
    monkeypatch.setenv("NATS_CONTEXT", "local")
    bus = await connect(nats_url_from_env("nats://unused.invalid:1"), connect_timeout=3, ensure_stream=False)
    await bus.aclose()
