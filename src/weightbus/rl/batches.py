"""Drained batches served by a rollout process to a trainer over NATS request/reply, chunked to the server's limit.

The subject is ``weightbus-rpc.<policy>.batches``: the policy's, but outside ``weightbus.>``, because the
JetStream stream captures ``weightbus.>`` and would store every request and answer it with its own ack.

A trainer publishes a :class:`BatchRequest` with a private reply inbox; the rollout drains and answers with
one or more chunks of the encoded :class:`BatchReply`, each at most the server's ``max_payload`` (less a
margin for headers) and numbered in the ``Weightbus-Chunk`` header (``i/n``). The trainer reassembles the
chunks in order; a missing chunk is a timeout, never a truncated batch.

A process cannot work without its side of the subject: the rollout's subscription and the trainer's request are
guarded (``NatsBus.guard``), so a user whose permissions refuse them gets ``PermissionDeniedError`` at once
instead of a warning per attempt and a loop that never trains (the shipped roles, ``ops/nats/auth.conf``, allow
both, and the rollout's answers through ``allow_responses``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from weightbus.bus.subjects import validate_policy
from weightbus.errors import NoRolloutError, PermissionDeniedError
from weightbus.schemas.rollouts import Group

if TYPE_CHECKING:
    from weightbus.bus.nats import NatsBus

__all__ = [
    "BatchReply",
    "BatchRequest",
    "batch_subject",
    "chunk_payload",
    "request_batch",
    "serve_batches",
]

log = logging.getLogger("weightbus.rl")

_HEADER: Final = "Weightbus-Chunk"
# Room for the headers and protocol framing of each chunk.
_MARGIN: Final = 512
#: The share of a request's patience kept for the answer's way back (at most ``_ANSWER_S_MAX`` seconds).
_ANSWER_SHARE: Final = 0.2
_ANSWER_S_MAX: Final = 1.0


def batch_subject(policy: str) -> str:
    """``weightbus-rpc.<policy>.batches``."""
    return f"weightbus-rpc.{validate_policy(policy)}.batches"


class BatchRequest(msgspec.Struct, kw_only=True):
    """A trainer asks for ``size`` kept groups, judged against a tracker that holds at least ``min_version``.

    ``min_version`` is the version the trainer has just published: a drain judged against an older tracker
    would admit a group one version too stale by the time it is trained on.

    ``patience_s`` is how long the trainer waits for the answer. ``serve_batches`` hands the handler what is left
    of it (less a margin for the answer's transfer) when the request's turn comes, and the rollout ends a drain
    that cannot fill the batch by then, putting back what it kept: a reply nobody reads would lose its groups,
    and their slots would count against the window of a batch never trained.
    """

    size: int
    min_version: int | None = None
    trainer_id: str = ""
    patience_s: float | None = None


class BatchReply(msgspec.Struct, kw_only=True):
    """The drained groups and the drain's numbers; ``error`` is set instead when the rollout could not drain."""

    groups: list[Group] = []
    judged_at: int | None = None
    kept: int = 0
    recycled: int = 0
    dropped: int = 0
    staleness_avg: float | None = None
    staleness_max: int | None = None
    tokens_generated: int = 0
    tokens_wasted: int = 0
    lag_s: float | None = None
    """How long the rollout's tracker took to see ``min_version`` after it was published (None if replayed)."""
    wait_s: float = 0.0
    """Seconds the rollout waited for its tracker to hold ``min_version`` (weightbus's propagation, on the step)."""
    drain_s: float = 0.0
    """Seconds the drain's own code ran (judging, bookkeeping), without its waits for generated groups."""
    error: str | None = None


def chunk_payload(data: bytes, max_payload: int) -> list[bytes]:
    """``data`` cut into pieces of at most ``max_payload - margin`` bytes (at least one piece)."""
    size = max(1, max_payload - _MARGIN)
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


def _subscribe_to(subject: str) -> Callable[[str, str], bool]:
    wanted = subject.lower()
    return lambda action, refused: action == "subscribe" and refused.lower() == wanted


def _publish_to(subject: str) -> Callable[[str, str], bool]:
    wanted = subject.lower()
    return lambda action, refused: action == "publish" and refused.lower() == wanted


async def serve_batches(bus: Any, policy: str, handler: Callable[[BatchRequest], Awaitable[BatchReply]]) -> Any:
    """Answer batch requests on ``batch_subject(policy)`` with ``handler``; returns the nats subscription, once the
    server has registered it.

    Requests are handled one at a time (a drain takes groups out of the buffer; two at once would split it). A
    request with ``patience_s`` reaches the handler with what is left of it once its turn comes, less a margin
    for the answer (``BatchRequest``); one whose patience ran out while it queued is answered with an error.

    Args:
        bus: a connected ``NatsBus`` (its nats-py client serves the subject; its ``guard`` sees refusals).

    Raises:
        PermissionDeniedError: this user may not subscribe to the subject.
    """
    nc = bus.client
    subject = batch_subject(policy)
    lock = asyncio.Lock()
    running: set[asyncio.Task[None]] = set()

    async def on_message(msg: Any) -> None:
        # nats-py awaits one callback per subscription at a time: a task each, so a request's patience is counted
        # from its arrival, not from when the one before it was answered (the lock keeps them one at a time).
        task = asyncio.create_task(on_request(msg, time.monotonic()))
        running.add(task)
        task.add_done_callback(_answered)

    def _answered(task: asyncio.Task[None]) -> None:
        running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a batch request failed", extra={"policy": policy, "error": repr(task.exception())})

    async def on_request(msg: Any, arrived: float) -> None:
        if not msg.reply:
            return
        try:
            request = msgspec.json.decode(msg.data, type=BatchRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reply = BatchReply(error=f"invalid batch request: {exc}")
        else:
            async with lock:
                patience = request.patience_s
                if patience is None:
                    reply = await handler(request)
                else:
                    margin = min(_ANSWER_S_MAX, patience * _ANSWER_SHARE)
                    left = patience - margin - (time.monotonic() - arrived)
                    if left <= 0:
                        reply = BatchReply(error=f"the request waited past its patience ({patience:g} s) for its turn")
                    else:
                        reply = await handler(msgspec.structs.replace(request, patience_s=left))
        chunks = chunk_payload(msgspec.json.encode(reply), nc.max_payload)
        for i, chunk in enumerate(chunks):
            await nc.publish(msg.reply, chunk, headers={_HEADER: f"{i}/{len(chunks)}"})
        await nc.flush()

    async def subscribe() -> Any:
        sub = await nc.subscribe(subject, cb=on_message)
        # Round-trips to the server so the subscription is registered (or refused: the refusal is on the wire
        # before the second answer) before anyone is told we serve.
        await nc.flush()
        await nc.flush()
        return sub

    # The guard interrupts what it awaits on a refusal; a flush it cancelled would make nats-py's read loop fail
    # on the late PONG, so it awaits a shield and the round trips always finish.
    registered = asyncio.ensure_future(subscribe())
    try:
        return await bus.guard(_subscribe_to(subject), asyncio.shield(registered), subject=subject)
    except PermissionDeniedError:
        with contextlib.suppress(Exception):
            await registered
        raise


async def request_batch(bus: NatsBus, policy: str, request: BatchRequest, *, timeout: float) -> BatchReply:
    """Ask the rollout for a batch and reassemble its chunks.

    Args:
        bus: a connected ``NatsBus``.

    Raises:
        TimeoutError: no complete answer within ``timeout`` seconds.
        NoRolloutError: nobody serves the subject (the server answered "no responders").
        ValueError: the answer does not decode.
        PermissionDeniedError: this user may not publish to the subject.
    """
    subject = batch_subject(policy)
    return await bus.guard(_publish_to(subject), _request(bus.client, policy, request, timeout), subject=subject)


async def _request(nc: Any, policy: str, request: BatchRequest, timeout: float) -> BatchReply:
    inbox = nc.new_inbox()
    chunks: dict[int, bytes] = {}
    total: list[int] = []
    done = asyncio.Event()
    failure: list[str] = []

    async def on_chunk(msg: Any) -> None:
        headers = msg.headers or {}
        if _HEADER not in headers:
            # The server's "no responders" status (503, empty body): nobody serves this policy right now.
            failure.append(f"no rollout answers on {batch_subject(policy)} (status {headers.get('Status', '?')})")
            done.set()
            return
        index, _, count = headers[_HEADER].partition("/")
        chunks[int(index)] = msg.data
        total[:] = [int(count)]
        if len(chunks) == total[0]:
            done.set()

    sub = await nc.subscribe(inbox, cb=on_chunk)
    try:
        await nc.publish(batch_subject(policy), msgspec.json.encode(request), reply=inbox)
        async with asyncio.timeout(timeout):
            await done.wait()
    finally:
        await sub.unsubscribe()
    if failure:
        raise NoRolloutError(failure[0])
    data = b"".join(chunks[i] for i in range(total[0]))
    try:
        return msgspec.json.decode(data, type=BatchReply)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"invalid batch reply: {exc}") from None
