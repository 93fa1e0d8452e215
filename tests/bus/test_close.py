"""``NatsBus.close()`` never raises and never hangs, also when the connection dies under it.

The server-stays-dead case (nats-py reconnecting, commands buffered) is in ``tests/chaos/test_server_kill.py``;
here the socket dies during nats-py's own final flush, which no timing of a real kill hits reliably.
"""

from __future__ import annotations

import logging

import pytest

from weightbus.bus import connect

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

    await bus.close()

    assert drains == 1
    assert client.is_closed
    messages = [r.getMessage() for r in caplog.records]
    assert "NATS connection lost while closing; closed without flushing" in messages
    # nats-py's cleanup ran to its end the second time: the closed callback fired and the socket is closed.
    assert "NATS connection closed" in messages
    assert transport._io_writer.is_closing()
    await bus.close()  # idempotent
