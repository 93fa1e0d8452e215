"""TLS asked for is TLS or a typed error: a plaintext server never receives a credential.

A TLS option (``--tls-ca``, ``--tls-cert``) or a ``tls://`` URL must not fall back to plaintext when the server
(or something in the middle) does not ask for TLS. The fake server here records every byte a client sends it,
so the test asserts from what was received that CONNECT (and the password in it) never crossed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._builders import wait_until
from weightbus.bus import ConnectOptions, connect
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import BusConnectError

SECRET = "pl41ntext-must-not-see-this"
TOKEN = "t0ken-must-not-cross"


@dataclass
class FakeServer:
    """A TCP listener that speaks the first line of NATS (a plaintext INFO) and records what it receives."""

    port: int = 0
    received: bytearray = field(default_factory=bytearray)
    connections: int = 0


@pytest.fixture
async def plaintext_server() -> AsyncIterator[FakeServer]:
    fake = FakeServer()
    info = {
        "server_id": "FAKE",
        "server_name": "fake",
        "version": "2.10.0",
        "proto": 1,
        "host": "127.0.0.1",
        "headers": True,
        "auth_required": True,
        "max_payload": 1048576,
        # No tls_required: a server without TLS, or one whose INFO was rewritten in the middle.
    }

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fake.connections += 1
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        try:
            while chunk := await reader.read(65536):
                fake.received.extend(chunk)
                if b"PING" in chunk:  # answer as a server would, so that a client that logged in succeeds
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    try:
        yield fake
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def test_ca(tmp_path: Path) -> str:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(path)
    return str(path)


def _assert_refused(info: pytest.ExceptionInfo[BusConnectError], port: int) -> None:
    assert info.value.cause == "tls", info.value
    assert f"127.0.0.1:{port}" in str(info.value), info.value
    assert "did not encrypt" in str(info.value), info.value
    assert SECRET not in str(info.value) and TOKEN not in str(info.value)


async def test_a_tls_ca_never_sends_credentials_to_a_plaintext_server(
    plaintext_server: FakeServer, test_ca: str
) -> None:
    url = f"nats://127.0.0.1:{plaintext_server.port}"
    opts = ConnectOptions(user="alice", password=SECRET, tls_ca=test_ca)
    with pytest.raises(BusConnectError) as info:
        await connect(url, options=opts, connect_timeout=5)
    _assert_refused(info, plaintext_server.port)
    assert plaintext_server.connections >= 1  # it did reach the server, and refused there
    assert b"CONNECT" not in plaintext_server.received, bytes(plaintext_server.received)
    assert SECRET.encode() not in plaintext_server.received


async def test_a_tls_url_never_sends_credentials_to_a_plaintext_server(plaintext_server: FakeServer) -> None:
    url = f"tls://{TOKEN}@127.0.0.1:{plaintext_server.port}"
    with pytest.raises(BusConnectError) as info:
        await connect(url, options=ConnectOptions(), connect_timeout=5)
    _assert_refused(info, plaintext_server.port)
    assert "***@127.0.0.1" in str(info.value)
    assert b"CONNECT" not in plaintext_server.received and TOKEN.encode() not in plaintext_server.received


async def test_a_tls_url_among_plain_ones_makes_every_server_need_tls(plaintext_server: FakeServer) -> None:
    url = f"nats://127.0.0.1:{plaintext_server.port},tls://127.0.0.1:{plaintext_server.port}"
    opts = ConnectOptions(user="alice", password=SECRET)
    with pytest.raises(BusConnectError) as info:
        await connect(url, options=opts, connect_timeout=3)
    assert info.value.cause == "tls", info.value
    assert SECRET.encode() not in plaintext_server.received


async def test_without_tls_options_a_plaintext_server_is_still_used(plaintext_server: FakeServer) -> None:
    """The control: the fake server is good enough for a client that does not ask for TLS to log in."""
    url = f"nats://127.0.0.1:{plaintext_server.port}"
    bus = await connect(url, options=ConnectOptions(user="alice", password=SECRET), ensure_stream=False)
    await bus.aclose()
    assert SECRET.encode() in plaintext_server.received


@pytest.mark.nats
async def test_a_real_plaintext_nats_server_is_refused_with_a_tls_ca(tmp_path: Path, test_ca: str) -> None:
    conf = tmp_path / "users.conf"
    conf.write_text("authorization { users: [ {user: alice, password: %s} ] }\n" % SECRET)
    with EmbeddedNats(config=conf) as server:
        with pytest.raises(BusConnectError) as info:
            await connect(server.url, options=ConnectOptions(user="alice", password=SECRET, tls_ca=test_ca))
        _assert_refused(info, server.port)
        with pytest.raises(BusConnectError) as as_tls:
            await connect(f"tls://127.0.0.1:{server.port}", options=ConnectOptions(user="alice", password=SECRET))
        _assert_refused(as_tls, server.port)
        bus = await connect(server.url, options=ConnectOptions(user="alice", password=SECRET))  # the control
        await bus.aclose()


@pytest.mark.nats
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_cli_refuses_a_plaintext_server_with_a_tls_ca(tmp_path: Path, test_ca: str, loop: str) -> None:
    with EmbeddedNats() as server:
        done = subprocess.run(
            [sys.executable, "-m", "weightbus", "stream", "check", "--nats", server.url, "--tls-ca", test_ca],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "WEIGHTBUS_EVENT_LOOP": loop},
        )
    assert done.returncode == 5, done
    assert "did not encrypt" in done.stderr and f"127.0.0.1:{server.port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.nats
# nats-py's reconnection loop does not close the socket of an attempt that failed (here: refused before CONNECT);
# the garbage collector does, with a ResourceWarning. Not a leak of weightbus's (every socket ends at close()).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_reconnect_to_a_plaintext_server_on_the_same_port_sends_no_credential(tmp_path: Path) -> None:
    """A TLS server replaced by a plaintext one (a downgrade after a restart): the reconnect is refused too."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(files["ca"])
    cert.cert_chain_pems[0].write_to_path(files["cert"])
    cert.private_key_pem.write_to_path(files["key"])
    conf = tmp_path / "tls.conf"
    conf.write_text(
        f'tls {{ cert_file: "{files["cert"]}"\n key_file: "{files["key"]}" }}\n'
        f"authorization {{ users: [ {{user: alice, password: {SECRET}}} ] }}\n"
    )
    tls_server = EmbeddedNats(config=conf).start()
    port = tls_server.port
    bus = await connect(
        f"nats://127.0.0.1:{port}", options=ConnectOptions(user="alice", password=SECRET, tls_ca=str(files["ca"]))
    )
    fake = FakeServer()
    listener = None
    try:
        tls_server.stop()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            fake.connections += 1
            try:
                writer.write(b'INFO {"server_id":"FAKE","version":"2.10.0","proto":1,"auth_required":true}\r\n')
                await writer.drain()
                while chunk := await reader.read(65536):
                    fake.received.extend(chunk)
            except ConnectionError:
                pass
            finally:
                writer.close()  # also when the loop cancels this handler at the end of the test

        for _ in range(100):  # the port is free once the server is gone; another process could take it meanwhile
            try:
                listener = await asyncio.start_server(serve, "127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.1)
        assert listener is not None, "could not take the port back"
        await wait_until(lambda: fake.connections >= 2, 60, "the client to try to reconnect")
        assert fake.connections >= 2, "the client never tried to reconnect"
        assert not bus.client.is_connected
        assert b"CONNECT" not in fake.received and SECRET.encode() not in fake.received, bytes(fake.received)
    finally:
        await bus.aclose()
        if listener is not None:
            listener.close()
            await listener.wait_closed()
        tls_server.stop()
