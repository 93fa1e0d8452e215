"""Credentials, TLS, redaction and connect errors that name their cause."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tls import tls_files as make_tls_files
from tests.tls import tls_server
from weightbus.bus import ConnectOptions, connect, redact_url
from weightbus.embedded.server import EmbeddedNats, find_nats_server, free_port
from weightbus.errors import BusConfigError, BusConnectError

SECRET = "hunter2-s3cr3t-pw"
TOKEN = "tok-9f8e7d6c5b4a"


def test_redact_url_hides_passwords_and_tokens() -> None:
    assert redact_url("nats://alice:pw@h:4222") == "nats://alice:***@h:4222"
    assert redact_url("nats://tok@h:4222,tls://bob:x@g:4443") == "nats://***@h:4222,tls://bob:***@g:4443"
    assert redact_url("nats://h:4222") == "nats://h:4222"
    opts = ConnectOptions(user="u", password=SECRET, token=TOKEN)
    assert SECRET not in repr(opts) and TOKEN not in repr(opts)
    assert opts.redact(f"failed with {SECRET} and {TOKEN}") == "failed with *** and ***"


def test_options_from_env_and_their_checks(tmp_path: Path) -> None:
    env = {"WEIGHTBUS_USER": "u", "WEIGHTBUS_PASSWORD": "p", "WEIGHTBUS_REPLICAS": "3"}
    opts = ConnectOptions.from_env(env)
    assert (opts.user, opts.password, opts.replicas) == ("u", "p", 3)
    assert ConnectOptions.from_env(env, replicas=1).replicas == 1
    with pytest.raises(BusConfigError, match="WEIGHTBUS_REPLICAS"):
        ConnectOptions.from_env({"WEIGHTBUS_REPLICAS": "three"})
    with pytest.raises(BusConfigError, match="needs a user"):
        ConnectOptions(password="p")
    with pytest.raises(BusConfigError, match="both --tls-cert and --tls-key"):
        ConnectOptions(tls_cert="c.pem")
    with pytest.raises(BusConfigError, match="tls-ca file not found"):
        ConnectOptions(tls_ca=str(tmp_path / "nope.pem")).nats_kwargs()


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    conf = tmp_path / "users.conf"
    conf.write_text(
        "authorization { users: [ {user: alice, password: %s}, {user: admin, password: %s} ] }\n" % (SECRET, SECRET)
    )
    with EmbeddedNats(config=conf) as server:
        yield server


@pytest.mark.nats
async def test_wrong_password_is_an_auth_error_and_no_secret_leaks(
    password_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"nats://alice:{SECRET}@127.0.0.1:{password_server.port}"
    bus = await connect(url)  # credentials in the URL still work
    await bus.aclose()
    bus = await connect(password_server.url, options=ConnectOptions(user="alice", password=SECRET))
    await bus.aclose()
    wrong = f"nats://alice:{SECRET}x@127.0.0.1:{password_server.port}"
    with pytest.raises(BusConnectError) as info:
        await connect(wrong, connect_timeout=3)
    assert info.value.cause == "auth", info.value
    with pytest.raises(BusConnectError) as info2:
        await connect(
            password_server.url, options=ConnectOptions(user="alice", password=SECRET + "x"), connect_timeout=3
        )
    assert info2.value.cause == "auth"
    texts = [str(info.value), repr(info.value), info.value.url, str(info2.value), caplog.text]
    for text in texts:
        assert SECRET not in text
    assert "alice:***@" in str(info.value)


@pytest.mark.nats
def test_cli_with_credentials_never_prints_them(password_server: EmbeddedNats) -> None:
    """A run with -vv (debug logs) that connects, then one that fails auth: grep everything for the secret."""
    base = [sys.executable, "-m", "weightbus.cli"]
    ok = subprocess.run(
        [*base, "stream", "check", "-vv", "--nats", password_server.url, "--user", "alice", "--password", SECRET],
        capture_output=True,
        text=True,
        timeout=60,
    )
    url = f"nats://alice:{SECRET}zz@127.0.0.1:{password_server.port}"
    bad = subprocess.run(
        [*base, "follow", "-vv", "--policy", "p", "--nats", url, "--duration", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "authentication failed" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr + ok.stderr
    for out in (ok.stdout, ok.stderr, bad.stdout, bad.stderr):
        assert SECRET not in out


async def test_refused_and_dns_are_named() -> None:
    with pytest.raises(BusConnectError) as refused:
        await connect(f"nats://127.0.0.1:{free_port()}", connect_timeout=1)
    assert refused.value.cause == "refused" and "refused" in str(refused.value)
    with pytest.raises(BusConnectError) as dns:
        await connect("nats://no-such-host.invalid:4222", connect_timeout=1)
    assert dns.value.cause == "dns" and "no-such-host.invalid" in str(dns.value)


@pytest.mark.nats
async def test_no_jetstream_is_named(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [find_nats_server(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if b"Server is ready" in line:
                break
        with pytest.raises(BusConnectError) as info:
            await connect(f"nats://127.0.0.1:{port}", connect_timeout=3)
        assert info.value.cause == "no_jetstream" and "-js" in str(info.value)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()  # else its collection, at whatever test runs then, fails that test


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    return make_tls_files(tmp_path)


@pytest.mark.nats
async def test_tls_with_a_test_ca(tmp_path: Path, tls_files: dict[str, str]) -> None:
    with tls_server(tmp_path, tls_files, verify=False) as server:
        bus = await connect(server.url, options=ConnectOptions(tls_ca=tls_files["ca"]))
        await bus.aclose()
        with pytest.raises(BusConnectError) as untrusted:
            # Without the CA the server's certificate cannot be verified.
            await connect(server.url, options=ConnectOptions(), connect_timeout=3)
        assert untrusted.value.cause == "tls", untrusted.value


@pytest.mark.nats
async def test_tls_with_a_client_certificate(tmp_path: Path, tls_files: dict[str, str]) -> None:
    with tls_server(tmp_path, tls_files, verify=True) as server:
        opts = ConnectOptions(
            tls_ca=tls_files["ca"], tls_cert=tls_files["client_cert"], tls_key=tls_files["client_key"]
        )
        bus = await connect(server.url, options=opts)
        await bus.aclose()
        with pytest.raises(BusConnectError) as no_cert:
            await connect(server.url, options=ConnectOptions(tls_ca=tls_files["ca"]), connect_timeout=3)
        assert no_cert.value.cause == "tls", no_cert.value


@pytest.mark.nats
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_cli_process_publishes_over_tls_on_either_loop(tmp_path: Path, tls_files: dict[str, str], loop: str) -> None:
    env = {**os.environ, "WEIGHTBUS_EVENT_LOOP": loop}
    with tls_server(tmp_path, tls_files, verify=True) as server:
        base = [sys.executable, "-m", "weightbus", "publish", "--policy", f"tls-{loop}", "--no-engines"]
        base += ["--nats", server.url, "--tls-ca", tls_files["ca"]]
        client = ["--tls-cert", tls_files["client_cert"], "--tls-key", tls_files["client_key"]]
        ok = subprocess.run(base + client, capture_output=True, text=True, timeout=60, env=env)
        assert ok.returncode == 0 and ok.stdout.split() == ["1"], ok.stderr
        refused = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode == 5, refused.stderr
        assert "tls" in refused.stderr.lower() and "Traceback" not in refused.stderr, refused.stderr


@pytest.mark.parametrize("command", ["follow", "watch", "publish", "status", "record", "replay", "stream create"])
def test_every_connecting_command_takes_the_connection_flags(command: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weightbus.cli", *command.split(), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--creds", "--nkey", "--token", "--user", "--password", "--tls-ca", "--tls-cert", "--tls-key"):
        assert flag in out.stdout, (command, flag)
    assert "--replicas" in out.stdout and "WEIGHTBUS_REPLICAS" in out.stdout


@pytest.mark.nats
async def test_nkey_seed_file_authenticates(tmp_path: Path) -> None:
    nkeys = pytest.importorskip("nkeys")
    import os

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed)
    conf = tmp_path / "nkey.conf"
    conf.write_text(f"authorization {{ users: [ {{nkey: {public}}} ] }}\n")
    with EmbeddedNats(config=conf) as server:
        bus = await connect(server.url, options=ConnectOptions(nkey_seed=str(seed_file)))
        await bus.aclose()
        with pytest.raises(BusConnectError) as info:
            await connect(server.url, options=ConnectOptions(), connect_timeout=3)
        assert info.value.cause == "auth"


def test_options_become_the_nats_py_arguments(tmp_path: Path) -> None:
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    kwargs = ConnectOptions(creds=str(creds), token=TOKEN).nats_kwargs()
    assert kwargs == {"user_credentials": str(creds), "token": TOKEN}
    kwargs = ConnectOptions(user="u", password=SECRET).nats_kwargs()
    assert kwargs == {"user": "u", "password": SECRET}
    with pytest.raises(BusConfigError, match="creds file not found"):
        ConnectOptions(creds=str(tmp_path / "missing.creds")).nats_kwargs()
