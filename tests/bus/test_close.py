"""``NatsBus.aclose()`` never raises and never hangs, also when the connection dies under it, and leaves no task.

The server-stays-dead cases (nats-py reconnecting, commands buffered; 50 timed closes at the first reconnection
attempt) are in ``tests/chaos/test_server_kill.py``; here are the moments no timing of a real kill hits
reliably: the socket dying during nats-py's own final flush, and the close landing as the refused reconnection
returns.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import nats_py_tasks
from weightbus.bus import connect
from weightbus.embedded.server import EmbeddedNats

pytestmark = pytest.mark.nats


async def test_close_survives_a_socket_that_dies_during_the_final_flush(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="weightbus.bus")
    bus = await connect(nats_url, name="close-test", ensure_stream=False)
    client = bus.client
    transport = client._transport
    drains = 0

    async def dying_drain() -> None:
        nonlocal drains
        drains += 1
        raise ConnectionResetError("Connection lost")

    transport.drain = dying_drain
    # Something left to flush when close() starts: nats-py writes it and drains the socket, which fails.
    client._pending.append(b"PING\r\n")
    client._pending_data_size += 6

    await bus.aclose()

    assert drains == 1
    assert client.is_closed
    messages = [r.getMessage() for r in caplog.records]
    assert "NATS connection lost while closing; closed without flushing" in messages
    # nats-py's cleanup ran to its end the second time: the closed callback fired and the socket is closed.
    assert "NATS connection closed" in messages
    assert transport._io_writer.is_closing()
    await bus.aclose()  # idempotent


async def test_close_ends_the_reconnection_task_when_its_cancel_is_swallowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose()`` lands exactly while nats-py's reconnection attempt gets its ``ConnectionRefusedError``.

    On CPython 3.11 ``asyncio.wait_for`` (inside nats-py's ``TcpTransport.connect``) then returns the error and
    swallows the cancel that ``aclose()`` sent; nats-py's reconnection task used to retry every
    ``reconnect_time_wait`` for ever on the CLOSED client, so a host's ``asyncio.run()`` never returned. The
    refused connection is real (the server was killed); only the moment of the close is pinned, by starting it
    from inside the refused ``open_connection`` so that it runs before ``wait_for`` resumes.
    """
    server = EmbeddedNats(store_dir=tmp_path / "js").start()
    bus = await connect(server.url, name="close-race", ensure_stream=False)
    port = server.port
    real_open = asyncio.open_connection
    closing: list[asyncio.Task[None]] = []

    async def refused_then_close(*args: Any, **kwargs: Any) -> Any:
        try:
            return await real_open(*args, **kwargs)
        except ConnectionRefusedError:
            if kwargs.get("port") == port and not closing:
                closing.append(asyncio.get_running_loop().create_task(bus.aclose()))
            raise

    monkeypatch.setattr(asyncio, "open_connection", refused_then_close)
    try:
        server.kill()
        async with asyncio.timeout(10):
            while not closing:
                await asyncio.sleep(0.01)
            await closing[0]
        assert bus.client.is_closed
        assert nats_py_tasks() == [], "nats-py tasks left running after close()"
    finally:
        monkeypatch.undo()
        for task in nats_py_tasks():
            task.cancel()
        server.stop()
