"""Every host's rollout half reaches the bus with the connect settings of its ``args`` first, then the variables.

A real nats-server that requires TLS (with a CA made here) and a password. Each host's rollout half (slime's rollout
session, miles' data buffer) is given both through ``args.weightbus_*`` alone, with no connect variable set, and
must follow the policy over that connection. The controls: the same ``args`` without the password, or without the
CA, are refused, so the server does require both.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations.slime.slime_standin import announce, make_args
from tests.tls import tls_files, tls_server
from weightbus.bus import ConnectOptions, connect
from weightbus.bus.options import ENV, NATS_CONTEXT_ENV, NATS_ENV, NATS_URL_ENV
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import BusConnectError

pytestmark = pytest.mark.nats

USER, SECRET = "rollout", "r0llout-s3cret"


@pytest.fixture(autouse=True)
def _no_connect_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*ENV.values(), *NATS_ENV.values(), NATS_CONTEXT_ENV, *NATS_URL_ENV, "WEIGHTBUS_CONNECT_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[EmbeddedNats, dict[str, str]]]:
    files = tls_files(tmp_path)
    with tls_server(tmp_path, files, verify=False, users={USER: SECRET}) as server:
        yield server, files


def _args(policy: str, server: EmbeddedNats, files: dict[str, str], **overrides: Any) -> Any:
    return make_args(
        weightbus_policy=policy,
        weightbus_nats=server.url,
        weightbus_user=USER,
        weightbus_password=SECRET,
        weightbus_tls_ca=files["ca"],
        weightbus_connect_timeout="3",
        weightbus_max_staleness="1",
        weightbus_early_abort="0",
        max_weight_staleness=1,
        **overrides,
    )


async def _start(host: str, args: Any) -> Any:
    """The host's rollout half, started (connected, following): slime's session or miles' buffer."""
    if host == "slime":
        from weightbus.integrations.slime.rollout import SlimeRollout

        session = SlimeRollout(args, asyncio.get_running_loop())
        try:
            await session.start(data_source=None)
        except BaseException:
            await session.aclose()
            raise
        return session
    from weightbus.integrations.miles import WeightbusDataBuffer

    buffer = WeightbusDataBuffer(SimpleNamespace(args=args, unused_handler_fn=lambda group: None), ready_timeout=5)
    try:
        await buffer.start()
    except BaseException:
        await buffer.aclose()
        raise
    return buffer


@pytest.mark.parametrize("host", ["slime", "miles"])
async def test_a_rollout_half_takes_its_credentials_and_tls_from_args(
    host: str, policy: str, secured: tuple[EmbeddedNats, dict[str, str]]
) -> None:
    server, files = secured
    half = await _start(host, _args(policy, server, files))
    trainer = await connect(server.url, options=ConnectOptions(user=USER, password=SECRET, tls_ca=files["ca"]))
    try:
        await announce(trainer, policy, 5)
        tracker = half.tracker
        assert tracker is not None
        # slime's start does not wait for the tracker (its judgement does): wait here for it to follow.
        assert await tracker.wait_for(5, 10) == 5
    finally:
        await trainer.aclose()
        await half.aclose()
    assert half.tracker is None  # closed: the connection it opened is gone with it


@pytest.mark.parametrize("host", ["slime", "miles"])
# nats-py does not close the socket of an attempt the server refused (tests/bus/test_tls_required.py); the garbage
# collector does, with a ResourceWarning: collected here, inside this test, rather than in whichever test runs next.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("missing", "cause"), [("weightbus_password", "auth"), ("weightbus_tls_ca", "tls")])
async def test_control_without_the_password_or_the_ca_the_server_refuses(
    host: str, policy: str, secured: tuple[EmbeddedNats, dict[str, str]], missing: str, cause: str
) -> None:
    server, files = secured
    args = _args(policy, server, files)
    setattr(args, missing, None)  # None: the variable is read instead, and there is none
    with pytest.raises(BusConnectError) as refused:
        await _start(host, args)
    assert refused.value.cause == cause, refused.value
    assert SECRET not in str(refused.value)
    del refused
    gc.collect()
