"""Batches over NATS request/reply: chunked to the server's max_payload and reassembled; no rollout is an error."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tests._builders import wait_until
from weightbus.bus import connect
from weightbus.errors import NoRolloutError
from weightbus.rl.batches import BatchReply, BatchRequest, chunk_payload, request_batch, serve_batches
from weightbus.schemas.rollouts import Group, Sample

pytestmark = pytest.mark.nats


def test_chunks_respect_the_limit_and_rejoin() -> None:
    data = bytes(range(256)) * 40
    chunks = chunk_payload(data, 1024)
    assert len(chunks) > 1 and all(len(c) <= 1024 for c in chunks)
    assert b"".join(chunks) == data
    assert chunk_payload(b"", 1024) == [b""]


def test_a_reply_from_an_older_rollout_decodes_without_the_new_fields() -> None:
    old = b'{"groups": [], "kept": 2, "tokens_generated": 40, "tokens_not_trained": 4, "error": null}'
    reply = msgspec.json.decode(old, type=BatchReply)
    assert (reply.kept, reply.tokens_generated, reply.rollout_id) == (2, 40, "")
    assert msgspec.json.decode(msgspec.json.encode(BatchReply(rollout_id="r:1")), type=BatchReply).rollout_id == "r:1"


async def test_a_batch_larger_than_max_payload_arrives_whole(nats_url: str, policy: str) -> None:
    server = await connect(nats_url)
    client = await connect(nats_url)
    limit = server.client.max_payload
    # Groups whose encoding is several times the server's max_payload.
    groups = [
        Group(prompt_index=i, samples=[Sample(index=i * 8 + j, tokens=list(range(20_000))) for j in range(8)])
        for i in range(4)
    ]
    seen: list[BatchRequest] = []

    async def handler(request: BatchRequest) -> BatchReply:
        seen.append(request)
        return BatchReply(groups=groups[: request.size], judged_at=7, kept=request.size)

    sub = await serve_batches(server, policy, handler)
    try:
        for attempt in range(5):
            # Observed about once in ten runs: a "no responders" for a request published after the responder's
            # subscription was flushed. The trainer retries such answers; so does this test, boundedly.
            try:
                reply = await request_batch(client, policy, BatchRequest(size=4, min_version=7), timeout=10)
                break
            except NoRolloutError:
                assert attempt < 4
                await asyncio.sleep(0.05)
    finally:
        await sub.unsubscribe()
        await server.aclose()
        await client.aclose()
    assert len(seen) == 1 and seen[0].min_version == 7
    assert reply.judged_at == 7 and reply.kept == 4
    assert [g.samples[3].tokens[-1] for g in reply.groups] == [19_999] * 4
    assert len(msgspec.json.encode(reply)) > 3 * limit


async def test_no_rollout_is_a_typed_error_not_a_hang(nats_url: str, policy: str) -> None:
    client = await connect(nats_url)
    try:
        with pytest.raises(NoRolloutError):
            await request_batch(client, policy, BatchRequest(size=1), timeout=5)
    finally:
        await client.aclose()


async def test_the_handler_gets_what_is_left_of_the_patience_and_a_request_that_queued_past_it_an_error(
    nats_url: str, policy: str
) -> None:
    server = await connect(nats_url)
    client = await connect(nats_url)
    seen: list[float | None] = []

    async def handler(request: BatchRequest) -> BatchReply:
        seen.append(request.patience_s)
        await asyncio.sleep(0.6)  # the lock is held: the next request waits its turn
        return BatchReply(kept=request.size)

    sub = await serve_batches(server, policy, handler)
    try:
        first = asyncio.create_task(request_batch(client, policy, BatchRequest(size=1, patience_s=2.0), timeout=5))
        await wait_until(lambda: len(seen) == 1, 5, "the first request to reach the handler")
        second = await request_batch(client, policy, BatchRequest(size=1, patience_s=0.5), timeout=5)
        reply = await first
    finally:
        await sub.unsubscribe()
        await server.aclose()
        await client.aclose()
    assert reply.error is None and len(seen) == 1  # the second never reached the handler
    assert seen[0] is not None and seen[0] <= 2.0 - 0.4  # a margin kept for the answer's way back
    assert second.error is not None and "patience" in second.error
