"""A CA made in the test, the certificates it issues, and a nats-server that requires TLS (and, optionally, a user).

``tests/bus/test_connect_options.py`` tests the TLS options themselves; the drop-ins' connect tests reach a server
that requires TLS and a password through them. Needs ``trustme`` (a test dependency): a test skips without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from weightbus.embedded.server import EmbeddedNats


def tls_files(directory: Path) -> dict[str, str]:
    """A fresh CA (``ca``), a server certificate for 127.0.0.1 (``cert``, ``key``) and a client one
    (``client_cert``, ``client_key``), written under ``directory``; their paths."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("weightbus-client")
    files = {
        "ca": directory / "ca.pem",
        "cert": directory / "server.pem",
        "key": directory / "server-key.pem",
        "client_cert": directory / "client.pem",
        "client_key": directory / "client-key.pem",
    }
    ca.cert_pem.write_to_path(files["ca"])
    server_cert.cert_chain_pems[0].write_to_path(files["cert"])
    server_cert.private_key_pem.write_to_path(files["key"])
    client_cert.cert_chain_pems[0].write_to_path(files["client_cert"])
    client_cert.private_key_pem.write_to_path(files["client_key"])
    return {k: str(v) for k, v in files.items()}


def tls_server(
    directory: Path, files: dict[str, str], *, verify: bool, users: dict[str, str] | None = None
) -> EmbeddedNats:
    """A nats-server (not started) that requires TLS with ``files``' certificate (``verify``: and a client
    certificate), and, with ``users``, one of those users and its password; its URL is ``tls://``."""
    conf = directory / f"tls-{verify}.conf"
    text = (
        "tls {\n"
        f'  cert_file: "{files["cert"]}"\n'
        f'  key_file: "{files["key"]}"\n'
        f'  ca_file: "{files["ca"]}"\n'
        f"  verify: {'true' if verify else 'false'}\n"
        "}\n"
    )
    if users:
        entries = ", ".join(f"{{user: {user}, password: {password}}}" for user, password in users.items())
        text += f"authorization {{ users: [ {entries} ] }}\n"
    conf.write_text(text)
    server = EmbeddedNats(config=conf)
    server.scheme = "tls"
    return server
