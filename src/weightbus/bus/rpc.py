"""Request/reply over core NATS, behind the bus: ``serve`` answers a subject's requests, ``request`` asks once.

Payloads are bytes; what they encode is the caller's (``weightbus.rl.batches``: a batch request and its reply).

Invariants:

* an answer is cut into chunks of at most the server's ``max_payload`` less a margin for headers, numbered in
  the ``Weightbus-Chunk`` header (``i/n``) and followed by a flush; the asker reassembles them in order, and a
  missing chunk is a timeout, never a truncated answer;
* the server's "no responders" status comes back as ``NoResponders``, never as an answer;
* a request without a reply subject is not answered; each request is handled in a task of its own, stamped
  with its arrival (``time.monotonic``), so one slow answer does not delay the next one's clock;
* the subscription is registered on the server (two round trips) before ``serve`` returns, and the server's
  refusal of it, or of a request's publish, raises ``PermissionDeniedError`` at once (``NatsBus.guard``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from weightbus.errors import PermissionDeniedError

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from weightbus.bus.nats import NatsBus

__all__ = ["CHUNK_HEADER", "Handler", "NoResponders", "Served", "chunk_payload", "request", "serve"]

log = logging.getLogger("weightbus.bus")

#: The header numbering an answer's chunks: ``i/n``.
CHUNK_HEADER: Final = "Weightbus-Chunk"
# Room for the headers and protocol framing of each chunk.
_MARGIN: Final = 512

#: Answers one request: its payload and its arrival (``time.monotonic()``) to the answer's payload.
Handler = Callable[[bytes, float], Awaitable[bytes]]


class Served(Protocol):
    """A subscription ``serve`` made: unsubscribe to stop answering."""

    async def unsubscribe(self, limit: int = 0) -> None:
        """Stop answering (pending requests are dropped)."""
        ...


@dataclass(frozen=True, slots=True)
class NoResponders:
    """The server's answer to a request nobody serves: its ``Status`` header (``503``, or ``?`` without one)."""

    subject: str
    status: str


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


def _log_failure(subject: str) -> Callable[[BaseException], None]:
    return lambda exc: log.error("a request failed", extra={"subject": subject, "error": repr(exc)})


async def serve(
    bus: NatsBus, subject: str, handler: Handler, *, on_error: Callable[[BaseException], None] | None = None
) -> Served:
    """Answer every request on ``subject`` with ``handler``'s payload, chunked; returns once the server has
    registered the subscription.

    Args:
        bus: a connected ``NatsBus`` (its client serves the subject; its ``guard`` sees refusals).
        subject: a core NATS subject, outside the stream's ``weightbus.>`` (the stream would store and ack it).
        handler: the answer to one request (see ``Handler``); several may run at once, in tasks of their own.
        on_error: called with what a handler or an answer's publish raised (default: logged at ERROR); the
            request is then not answered, and the asker times out.

    Raises:
        PermissionDeniedError: this user may not subscribe to ``subject``.
    """
    nc = bus.client
    failed = on_error if on_error is not None else _log_failure(subject)
    running: set[asyncio.Task[None]] = set()

    async def on_message(msg: Msg) -> None:
        # nats-py awaits one callback per subscription at a time: a task each, so a request's arrival is its own.
        task = asyncio.create_task(answer(msg, time.monotonic()))
        running.add(task)
        task.add_done_callback(answered)

    def answered(task: asyncio.Task[None]) -> None:
        running.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            failed(exc)

    async def answer(msg: Msg, arrived: float) -> None:
        if not msg.reply:
            return
        data = await handler(msg.data, arrived)
        chunks = chunk_payload(data, nc.max_payload)
        for i, chunk in enumerate(chunks):
            await nc.publish(msg.reply, chunk, headers={CHUNK_HEADER: f"{i}/{len(chunks)}"})
        await nc.flush()

    async def subscribe() -> Served:
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


async def request(bus: NatsBus, subject: str, payload: bytes, *, timeout: float) -> bytes | NoResponders:
    """Publish ``payload`` on ``subject`` with a private reply inbox and reassemble the chunked answer.

    Returns:
        The answer's payload, or ``NoResponders`` when nobody serves ``subject``.

    Raises:
        TimeoutError: no complete answer within ``timeout`` seconds.
        PermissionDeniedError: this user may not publish to ``subject``.
    """
    return await bus.guard(_publish_to(subject), _request(bus, subject, payload, timeout), subject=subject)


async def _request(bus: NatsBus, subject: str, payload: bytes, timeout: float) -> bytes | NoResponders:
    nc = bus.client
    inbox = nc.new_inbox()
    chunks: dict[int, bytes] = {}
    total: list[int] = []
    done = asyncio.Event()
    unanswered: list[NoResponders] = []

    async def on_chunk(msg: Msg) -> None:
        headers = msg.headers or {}
        if CHUNK_HEADER not in headers:
            # The server's "no responders" status (503, empty body): nobody serves the subject right now.
            unanswered.append(NoResponders(subject, headers.get("Status", "?")))
            done.set()
            return
        index, _, count = headers[CHUNK_HEADER].partition("/")
        chunks[int(index)] = msg.data
        total[:] = [int(count)]
        if len(chunks) == total[0]:
            done.set()

    sub = await nc.subscribe(inbox, cb=on_chunk)
    try:
        await nc.publish(subject, payload, reply=inbox)
        async with asyncio.timeout(timeout):
            await done.wait()
    finally:
        await sub.unsubscribe()
    if unanswered:
        return unanswered[0]
    return b"".join(chunks[i] for i in range(total[0]))
