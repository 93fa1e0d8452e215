"""Every operator mistake gives one ``error:`` line and its documented exit code, never a traceback.

Each case of the issue runs here: an empty ``--nats``, a server without JetStream, bad ports and
unwritable output paths, an invalid stored event, the demo without the engine extra, a malformed engine
URL, ``replay`` of empty/spaced/wildcard subjects, invalid and oversized events, and a live policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from tests._builders import updated
from weightbus.bus import connect, subjects
from weightbus.bus.trace import TraceRecord, read_trace, write_record
from weightbus.cli import app
from weightbus.embedded.server import find_nats_server, free_port
from weightbus.schemas import WeightUpdated, encode

runner = CliRunner()


def one_line_error(result: Any, code: int, *needles: str) -> None:
    """The command exited ``code`` with exactly one ``error:`` line naming the problem, and no traceback."""
    err = result.stderr
    assert result.exit_code == code, (result.exit_code, result.output)
    # Structured log lines (JSON objects) may precede it; the error itself is one plain line.
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("{")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args))


def write_trace(path: Path, *items: tuple[str, bytes]) -> Path:
    with open(path, "wb") as f:
        for n, (subject, data) in enumerate(items):
            rec = TraceRecord(
                subject=subject, received_at=1.0, event=msgspec.Raw(data), headers={"Nats-Msg-Id": f"t{n}"}
            )
            write_record(f, rec)
    return path


# --- options checked before anything connects -------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "publish", "watch", "follow", "record", "replay"])
def test_an_empty_nats_url_fails_fast(command: str, tmp_path: Path) -> None:
    extra = {
        "status": ["--policy", "p"],
        "publish": ["--policy", "p", "--no-engines"],
        "watch": [],
        "follow": ["--policy", "p"],
        "record": ["--out", str(tmp_path / "x.jsonl")],
        "replay": [
            str(
                write_trace(
                    tmp_path / "t.jsonl", ("weightbus.p.weights", encode(updated(1, policy="p", trainer="trainer-a")))
                )
            )
        ],
    }[command]
    started = time.monotonic()
    one_line_error(invoke(command, *extra, "--nats", ""), 2, "--nats ''", "empty NATS URL")
    assert time.monotonic() - started < 5
    one_line_error(invoke(command, *extra, "--nats", "nats://127.0.0.1:99999"), 2, "1-65535")


def test_the_empty_nats_url_from_the_environment_fails_fast_in_a_real_process() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "weightbus", "status", "--policy", "p"],
        capture_output=True, text=True, timeout=30, env={"WEIGHTBUS_NATS": " ", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 2 and run.stderr.startswith("error: --nats ' '") and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["watch", "--metrics-port", "0"],
        ["follow", "--policy", "p", "--metrics-port", "70000"],
        ["record", "--out", "x.jsonl", "--metrics-port", "-1"],
        ["engine", "--port", "99999"],
        ["server", "--port", "0"],
    ],
)
def test_bad_ports(args: list[str]) -> None:
    one_line_error(invoke(*args), 2, "not in 1-65535")


def test_a_taken_port(nats_server: Any) -> None:
    taken = str(nats_server.port)
    one_line_error(invoke("engine", "--port", taken), 2, f"cannot listen on 127.0.0.1:{taken}")


@pytest.mark.nats
def test_a_taken_metrics_port(nats_url: str, nats_server: Any) -> None:
    args = ["watch", "--nats", nats_url, "--metrics-port", str(nats_server.port), "--duration", "0.1"]
    one_line_error(invoke(*args), 2, "cannot serve metrics on 127.0.0.1:")


@pytest.mark.parametrize("out", ["/nonexistent/x.jsonl", "/proc/x.jsonl"])
def test_record_into_an_unwritable_path(out: str) -> None:
    # A dead URL: the path is refused before anything connects.
    one_line_error(invoke("record", "--out", out, "--nats", f"nats://127.0.0.1:{free_port()}"), 2, out)


def test_server_with_an_unwritable_store(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    one_line_error(invoke("server", "--store", str(blocker)), 2, "is not a directory")
    one_line_error(invoke("server", "--store", "/proc/weightbus-store"), 2, "cannot write in /proc/weightbus-store")


@pytest.mark.parametrize("url", ["::::", "ftp://engine", "http://engine:99999"])
def test_publish_and_status_with_a_malformed_engine_url(url: str) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    one_line_error(invoke("publish", "--policy", "p", "--nats", dead, "--engine", url), 2, "invalid engine URL")
    one_line_error(invoke("status", "--policy", "p", "--nats", dead, "--engine", url), 2, "invalid engine URL")


def test_publish_without_engines_is_refused_unless_told_so() -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    one_line_error(invoke("publish", "--policy", "p", "--nats", dead), 2, "--no-engines")


def test_the_demo_without_the_engine_extra() -> None:
    # A real process in which starlette and uvicorn cannot be imported.
    code = (
        "import sys; sys.modules['starlette'] = None; sys.modules['uvicorn'] = None\n"
        "import importlib.util; real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n in ('starlette', 'uvicorn') else real(n, *a)\n"
        "sys.argv = ['weightbus', 'demo']\n"
        "from weightbus.cli import main; main()"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: the demo needs the 'engine' and 'rl' extras") and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


# --- against a real nats-server ----------------------------------------------------------------------------


@pytest.fixture
def nats_without_jetstream(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [find_nats_server(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:  # ready once the port accepts connections
            assert proc.poll() is None and time.monotonic() < deadline, "nats-server did not start"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.02)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.nats
def test_status_on_a_server_without_jetstream(nats_without_jetstream: str) -> None:
    result = invoke("status", "--policy", "p", "--nats", nats_without_jetstream, "--connect-timeout", "3")
    one_line_error(result, 5, "JetStream")


async def _store_raw(url: str, subject: str, data: bytes, msg_id: str) -> None:
    bus = await connect(url)
    try:
        await bus.publish_raw(subject, data, msg_id=msg_id)
    finally:
        await bus.aclose()


async def _store(url: str, *events: WeightUpdated) -> None:
    bus = await connect(url)
    try:
        for e in events:
            await bus.publish(subjects.weights(e.policy), e, msg_id=f"{e.policy}:{e.trainer_id}:{e.version}")
    finally:
        await bus.aclose()


@pytest.mark.nats
def test_an_invalid_stored_event(nats_url: str, policy: str) -> None:
    asyncio.run(_store(nats_url, updated(3, policy=policy, trainer="trainer-a")))
    bad = b'{"type": "weight.updated", "policy": "%s", "version": -5, "epoch": 1, "trainer_id": "x", "published_at": 1}'
    asyncio.run(_store_raw(nats_url, subjects.weights(policy), bad % policy.encode(), f"{policy}:bad"))
    shown = invoke("status", "--policy", policy, "--nats", nats_url)
    one_line_error(shown, 6, "invalid weights event", "version")
    assert "version    3" in shown.stdout and "INVALID" in shown.stdout
    # One bad payload never stops a trainer: publish skips it (counted) and continues the counter.
    published = invoke("publish", "--policy", policy, "--nats", nats_url, "--no-engines", "--takeover")
    assert published.exit_code == 0 and published.stdout.strip() == "4", published.output


@pytest.mark.nats
@pytest.mark.parametrize(
    ("subject", "why"),
    [
        ("", "''"),
        ("weightbus.p q.weights", "'weightbus.p q.weights'"),
        ("weightbus.*.weights", "'weightbus.*.weights'"),
        ("weightbus.>", "'weightbus.>'"),
    ],
)
def test_replay_refuses_a_subject_that_is_not_concrete(nats_url: str, tmp_path: Path, subject: str, why: str) -> None:
    trace = write_trace(tmp_path / "t.jsonl", (subject, encode(updated(1, policy="p", trainer="trainer-a"))))
    one_line_error(invoke("replay", str(trace), "--nats", nats_url), 2, "record 1", why)


@pytest.mark.nats
def test_replay_validates_every_event_before_publishing_any(nats_url: str, policy: str, tmp_path: Path) -> None:
    w = subjects.weights(policy)
    negative = encode(updated(1, policy=policy, trainer="trainer-a")).replace(b'"version":1', b'"version":-5')
    big = encode(updated(2, policy=policy, trainer="trainer-a")).replace(
        b'"trainer_id":"trainer-a"', b'"trainer_id":"' + b"x" * 2_000_000 + b'"'
    )
    for bad, needle in ((negative, "version"), (big, "oversized")):
        trace = write_trace(tmp_path / "t.jsonl", (w, encode(updated(1, policy=policy, trainer="trainer-a"))), (w, bad))
        one_line_error(invoke("replay", str(trace), "--nats", nats_url), 2, "record 2", needle)
    shown = invoke("status", "--policy", policy, "--nats", nats_url, "--json")
    assert shown.exit_code == 4  # nothing was published: the policy never published


@pytest.mark.nats
def test_replay_into_a_live_policy_needs_force_and_policy_rewrites(nats_url: str, policy: str, tmp_path: Path) -> None:
    w = subjects.weights(policy)
    trace = write_trace(
        tmp_path / "t.jsonl",
        (w, encode(updated(1, policy=policy, trainer="trainer-a"))),
        (w, encode(updated(2, policy=policy, trainer="trainer-a"))),
    )
    assert invoke("replay", str(trace), "--nats", nats_url).exit_code == 0
    one_line_error(invoke("replay", str(trace), "--nats", nats_url, "--new-ids"), 3, "--force", policy)
    again = invoke("replay", str(trace), "--nats", nats_url, "--new-ids", "--force")
    assert again.exit_code == 0 and "replayed 2 new events" in again.stderr
    other = f"{policy}-copy"
    moved = invoke("replay", str(trace), "--nats", nats_url, "--as-policy", other)
    assert moved.exit_code == 0, moved.output
    out = tmp_path / "copy.jsonl"
    recorded = invoke("record", "--out", str(out), "--subjects", subjects.weights(other), "--deliver", "all",
                      "--count", "2", "--duration", "10", "--nats", nats_url)  # fmt: skip
    assert recorded.exit_code == 0, recorded.output
    records = list(read_trace(out))
    assert [r.subject for r in records] == [subjects.weights(other)] * 2
    assert [msgspec.json.decode(bytes(r.event))["policy"] for r in records] == [other, other]
    assert all(r.headers["Nats-Msg-Id"].startswith(f"{other}:") for r in records)


async def test_the_library_refuses_an_empty_url_at_once() -> None:
    from weightbus.errors import BusConnectError

    started = time.monotonic()
    with pytest.raises(BusConnectError, match="no server URL"):
        await connect(" , ", connect_timeout=30)
    assert time.monotonic() - started < 1


# --- rollout and trainer flags checked before anything starts (no NATS, no router, no engine) ---------------

_NOWHERE = ["--router", "http://127.0.0.1:9", "--nats", "nats://127.0.0.1:9"]


@pytest.fixture
def not_pem(tmp_path: Path) -> str:
    path = tmp_path / "not-a-ca.pem"
    path.write_text("this is not a certificate\n")
    return str(path)


@pytest.mark.parametrize("command", ["rollout", "trainer", "status"])
def test_a_missing_or_non_pem_tls_ca_is_a_bad_flag(command: str, tmp_path: Path, not_pem: str) -> None:
    extra = {"rollout": _NOWHERE, "trainer": [*_NOWHERE, "--run-dir", str(tmp_path / "run")], "status": _NOWHERE[2:]}
    base = [command, "--policy", "p", *extra[command]]
    started = time.monotonic()
    one_line_error(invoke(*base, "--tls-ca", str(tmp_path / "missing.pem")), 2, "--tls-ca", "missing.pem")
    one_line_error(invoke(*base, "--tls-ca", not_pem), 2, "--tls-ca", "not a readable PEM")
    assert time.monotonic() - started < 10  # refused before any connect attempt


@pytest.mark.parametrize("command", ["rollout", "trainer"])
def test_a_policy_that_is_not_a_subject_token_is_a_bad_flag(command: str, tmp_path: Path) -> None:
    extra = ["--run-dir", str(tmp_path / "run")] if command == "trainer" else []
    one_line_error(invoke(command, "--policy", "a.b", *_NOWHERE, *extra), 2, "--policy", "'a.b'")


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--in-flight", "1000000000", "<= 1024"),
        ("--admission-cap", "1000000000", "<= 1024"),
        ("--group-size", "1", ">= 2"),
    ],
)
def test_rollout_bounds_are_named_by_their_flag(flag: str, value: str, needle: str) -> None:
    result = invoke("rollout", "--policy", "p", *_NOWHERE, "--admission", "cap", flag, value)
    one_line_error(result, 2, flag, needle)
    assert "$." not in result.stderr


def test_a_shared_lease_too_short_is_a_bad_config_value(tmp_path: Path) -> None:
    config = tmp_path / "rollout.json"
    config.write_text(
        '{"router_url": "http://127.0.0.1:9", "nats_url": "nats://127.0.0.1:9", "policy": "p", '
        '"admission_shared": true, "admission_lease_s": 2}'
    )
    one_line_error(invoke("rollout", "--config", str(config)), 2, '"admission_lease_s" in --config', "longer than 3")


def test_a_huge_in_flight_ends_at_once_in_a_real_process() -> None:
    """It used to pass validation and wedge the process, which then ignored SIGTERM."""
    done = subprocess.run(
        [sys.executable, "-m", "weightbus", "rollout", "--policy", "p", *_NOWHERE, "--in-flight", "1000000000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--in-flight" in done.stderr and "Traceback" not in done.stderr, done


@pytest.mark.nats
def test_a_permission_denial_has_its_own_exit_code_and_the_subject_as_spelled(tmp_path: Path) -> None:
    """77 (denied), not 5 (unreachable): the server answered, and said no."""
    import os

    from tests.roles import PASSWORDS, roles_server

    env = {**os.environ, "WEIGHTBUS_USER": "monitor", "WEIGHTBUS_PASSWORD": PASSWORDS["monitor"]}
    with roles_server(tmp_path / "js") as server:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "weightbus",
                "publish",
                "--policy",
                "Mixed-Case",
                "--no-engines",
                "--nats",
                server.url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert done.returncode == 77, done
    assert len(lines) == 1 and lines[0].startswith("error: permission denied"), done.stderr
    assert "'weightbus.Mixed-Case.weights'" in lines[0], lines[0]
