"""The private nats-py shapes ``weightbus.bus._natspy`` relies on, asserted on clients of a real nats-server.

A nats-py release that renames or retypes one of them fails here, by name, instead of in a hang or a wrong
count at run time. ``_natspy.CHECKED_ON`` lists the versions this passed on; a version added to the supported
range must pass it too.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.aio.client
import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from tests._builders import wait_until
from weightbus.bus import _natspy
from weightbus.embedded.server import EmbeddedNats

pytestmark = pytest.mark.nats


@pytest_asyncio.fixture
async def client(nats_url: str) -> AsyncIterator[NatsClient]:
    nc = await nats.connect(nats_url, name="shape-test", reconnect_time_wait=0.2)
    yield nc
    await nc.close()


def test_the_dependency_range_starts_at_a_version_the_shapes_were_checked_on() -> None:
    # The shapes below are the guard for any installed version; the range must not admit one never checked.
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    (requirement,) = [r for r in project["dependencies"] if r.startswith("nats-py")]
    lower = re.search(r">=([0-9.]+)", requirement)
    assert lower is not None and lower.group(1) == min(_natspy.CHECKED_ON, key=lambda v: tuple(map(int, v.split("."))))


async def test_client_status_buffer_and_tasks(client: NatsClient) -> None:
    assert isinstance(NatsClient.CONNECTED, int) and isinstance(NatsClient.CLOSED, int)
    assert client._status == NatsClient.CONNECTED
    assert isinstance(client._pending, list) and isinstance(client._pending_data_size, int)
    for name in ("_reading_task", "_ping_interval_task", "_flusher_task"):
        assert isinstance(getattr(client, name), asyncio.Task), name
    assert client._reconnection_task is None
    assert isinstance(client._subs, dict)
    tasks = _natspy.client_tasks(client)
    assert {client._reading_task, client._ping_interval_task, client._flusher_task} <= set(tasks)

    # A command not yet flushed sits in the buffer, counted in bytes; dropping it empties both.
    await client.publish("shape.test", b"x" * 100)
    assert _natspy.buffered_bytes(client) >= 100
    assert client._pending and sum(len(c) for c in client._pending) == client._pending_data_size
    assert _natspy.drop_buffered_writes(client) >= 100
    assert client._pending == [] and _natspy.buffered_bytes(client) == 0

    # A close that failed half-way can be run again once marked connected.
    await client.close()
    assert client.is_closed
    _natspy.reopen_for_close(client)
    assert client.is_connected and not client.is_closed
    await client.close()
    assert client.is_closed
    assert all(t.done() for t in tasks)


async def test_a_callback_less_ordered_consumer_queues_on_its_subscription(client: NatsClient) -> None:
    js = client.jetstream()
    stream = "SHAPE_TEST"
    await js.add_stream(name=stream, subjects=["shape.js.>"])
    try:
        js_sub = await js.subscribe(
            "shape.js.a",
            stream=stream,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            deliver_policy=DeliverPolicy.ALL,
            pending_msgs_limit=0,
            pending_bytes_limit=0,
        )
        queue = _natspy.delivery_queue(js_sub)
        assert isinstance(queue, asyncio.Queue)
        assert isinstance(js_sub._sub._pending_size, int)
        await js.publish("shape.js.a", b"hello")
        msg = await asyncio.wait_for(queue.get(), 5)
        assert isinstance(msg, Msg) and msg.data == b"hello" and msg.reply.startswith("$JS.ACK.")
        assert js_sub._sub._pending_size == len(b"hello")
        _natspy.consumed(js_sub, len(msg.data))
        assert js_sub._sub._pending_size == 0

        own = _natspy.subscription_tasks(js_sub)
        assert len(own) == 2 and all(isinstance(t, asyncio.Task) for t in own)  # heartbeat, flow control
        assert set(own) <= set(_natspy.client_tasks(client))
        assert js_sub._sub._wait_for_msgs_task is None  # no callback, no message task
        await js_sub.unsubscribe()
        await asyncio.sleep(0)
        assert all(t.done() for t in own)
    finally:
        await js.delete_stream(stream)


async def test_the_reconnection_task_is_listed_and_ended(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "js").start()
    nc = await nats.connect(server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    try:
        server.kill()
        await wait_until(lambda: nc.is_reconnecting, 5, "nats-py to start reconnecting")
        reconnection = nc._reconnection_task
        assert isinstance(reconnection, asyncio.Task) and reconnection in _natspy.client_tasks(nc)
        await nc.publish("shape.buffered", b"y" * 10)  # buffered for the reconnection
        assert _natspy.buffered_bytes(nc) >= 10
        _natspy.drop_buffered_writes(nc)
        tasks = _natspy.client_tasks(nc)
        await nc.close()
        assert await _natspy.end_tasks(tasks, 2.0) == []
        assert reconnection.done()
    finally:
        server.stop()


def test_the_header_parser_switch_is_where_it_is_read() -> None:
    # nats-py picks fast_mail_parser's parse_email (None without it); weightbus then avoids direct gets.
    assert hasattr(nats.aio.client, "parse_email")
    assert _natspy.direct_get_supported() is (importlib.util.find_spec("fast_mail_parser") is None)


async def test_the_connect_command_is_built_between_the_tls_upgrade_and_its_write(client: NatsClient) -> None:
    # ``refuse_plaintext`` checks the transport where nats-py builds CONNECT; both must be where it looks.
    assert callable(client._connect_command) and b"CONNECT" in client._connect_command()
    assert client._transport is not None and client._transport._io_writer is not None
    assert client._current_server is not None and client._current_server.uri.port is not None
    assert _natspy.is_encrypted(client) is False  # the fixture's server speaks plaintext
    import inspect

    source = inspect.getsource(NatsClient._process_connect_init)
    upgrade, build = source.find("connect_tls"), source.find("_connect_command()")
    assert 0 <= upgrade < build, "nats-py no longer upgrades to TLS before building CONNECT"
