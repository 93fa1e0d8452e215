"""``bus.rpc``: chunked request/reply over core NATS, on the wire as ``weightbus.rl.batches`` always spoke it."""

from __future__ import annotations

import asyncio

import pytest

from weightbus.bus import connect, rpc

pytestmark = pytest.mark.nats


async def test_an_answer_is_chunked_numbered_and_reassembled(nats_url: str) -> None:
    server = await connect(nats_url)
    client = await connect(nats_url)
    subject = "weightbus-rpc.rpc-test.echo"
    answer = bytes(range(256)) * (3 * server.client.max_payload // 256)
    arrivals: list[float] = []

    async def handler(data: bytes, arrived: float) -> bytes:
        arrivals.append(arrived)
        return data + answer

    served = await rpc.serve(server, subject, handler)
    try:
        for _ in range(5):
            # A "no responders" right after the subscription is flushed is seen rarely (see tests/rl/test_batches.py).
            reply = await rpc.request(client, subject, b"hi", timeout=10)
            if not isinstance(reply, rpc.NoResponders):
                break
            await asyncio.sleep(0.05)
        assert reply == b"hi" + answer
        # The raw wire: what a trainer of an older version reads.
        inbox = client.client.new_inbox()
        headers: list[str] = []
        got = asyncio.Event()

        async def on_chunk(msg: object) -> None:
            headers.append(msg.headers[rpc.CHUNK_HEADER])  # type: ignore[attr-defined]
            if len(headers) == int(headers[0].partition("/")[2]):
                got.set()

        raw = await client.client.subscribe(inbox, cb=on_chunk)
        await client.client.publish(subject, b"raw", reply=inbox)
        await asyncio.wait_for(got.wait(), 10)
        await raw.unsubscribe()
        assert len(headers) >= 4 and headers == [f"{i}/{len(headers)}" for i in range(len(headers))]
        assert len(arrivals) == 2
    finally:
        await served.unsubscribe()
        await server.aclose()
        await client.aclose()


async def test_nobody_serving_is_no_responders_and_a_failed_handler_is_reported(nats_url: str) -> None:
    bus = await connect(nats_url)
    subject = "weightbus-rpc.rpc-test.failing"
    failures: list[BaseException] = []
    try:
        unanswered = await rpc.request(bus, subject, b"", timeout=5)
        assert unanswered == rpc.NoResponders(subject, "503")

        async def handler(data: bytes, arrived: float) -> bytes:
            raise RuntimeError("boom")

        served = await rpc.serve(bus, subject, handler, on_error=failures.append)
        with pytest.raises(TimeoutError):  # no answer: the asker times out
            for _ in range(5):  # (past a rare early "no responders", as above)
                assert isinstance(await rpc.request(bus, subject, b"", timeout=0.5), rpc.NoResponders)
                await asyncio.sleep(0.05)
        await served.unsubscribe()
    finally:
        await bus.aclose()
    assert [str(e) for e in failures] == ["boom"]
