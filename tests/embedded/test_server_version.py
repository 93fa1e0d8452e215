"""The embedded server refuses a nats-server older than ``MIN_NATS_SERVER_VERSION``, before starting anything."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from weightbus.cli import app
from weightbus.embedded.server import (
    MIN_NATS_SERVER_VERSION,
    EmbeddedNats,
    NatsServerStartError,
    NatsServerVersionError,
    check_nats_server_version,
    find_nats_server,
)


def fake_server(directory: Path, version_line: str) -> Path:
    """A ``nats-server`` that prints ``version_line`` for ``--version`` and logs every other invocation."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nats-server"
    calls = directory / "calls.log"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then echo "{version_line}"; exit 0; fi\n'
        f'echo "$@" >> "{calls}"\n'
        "exit 3\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture
def old_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake 2.9.10 first on PATH, and no nats-server beside the interpreter (as with a system python)."""
    script = fake_server(tmp_path / "bin", "nats-server: v2.9.10")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "nobin" / "python"))
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    return script


def test_an_old_server_on_path_is_refused_naming_binary_version_and_minimum(old_on_path: Path) -> None:
    assert find_nats_server() == str(old_on_path)
    server = EmbeddedNats()
    with pytest.raises(NatsServerVersionError) as info:
        server.start()
    err = info.value
    assert (err.binary, err.version, err.minimum) == (str(old_on_path), "2.9.10", MIN_NATS_SERVER_VERSION)
    for needle in (str(old_on_path), "2.9.10", MIN_NATS_SERVER_VERSION):
        assert needle in str(err)
    assert isinstance(err, NatsServerStartError)  # callers that handle a failed start handle this one
    assert server.process is None
    assert not (old_on_path.parent / "calls.log").exists()  # only --version ran: nothing was started
    server.stop()


def test_weightbus_server_reports_the_old_binary_in_one_line(old_on_path: Path) -> None:
    result = CliRunner().invoke(app, ["server"])
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "2.9.10" in lines[0] and MIN_NATS_SERVER_VERSION in lines[0] and str(old_on_path) in lines[0]


@pytest.mark.parametrize(
    ("line", "ok"),
    [
        ("nats-server: v2.10.0", True),
        ("nats-server: v2.15.1", True),
        ("nats-server: v3.0.0-beta.1", True),
        ("nats-server: v2.9.25", False),
        ("nats-server: v1.4.1", False),
        ("nats-server: development build", False),
    ],
)
def test_the_minimum_is_compared_as_a_version(tmp_path: Path, line: str, ok: bool) -> None:
    script = fake_server(tmp_path, line)
    if ok:
        assert check_nats_server_version(str(script)) == line.split(": v", 1)[1].split("-")[0]
    else:
        with pytest.raises(NatsServerVersionError) as info:
            check_nats_server_version(str(script))
        assert (info.value.version is None) == ("development" in line)


def test_a_binary_that_cannot_run_is_a_start_error(tmp_path: Path) -> None:
    missing = tmp_path / "nats-server"
    with pytest.raises(NatsServerStartError, match=str(missing)):
        check_nats_server_version(str(missing))


def test_the_installed_server_is_new_enough() -> None:
    assert check_nats_server_version(find_nats_server())
