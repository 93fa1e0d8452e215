"""Drained batches served by a rollout process to a trainer over NATS request/reply, chunked to the server's limit.

The subject ``weightbus-rpc.<policy>.batches`` is outside the stream; a lost chunk is a timeout, never a partial batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

import msgspec

from weightbus.bus import rpc
from weightbus.bus.rpc import chunk_payload
from weightbus.bus.subjects import validate_policy
from weightbus.errors import NoRolloutError
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
    """The drained groups and the drain's numbers; ``error`` is set instead when the rollout could not drain.

    ``staleness_avg``/``staleness_max`` are over every group the drain judged (recycled and dropped ones too), not
    only the groups kept into the batch. Fields are added at the end with defaults, so older replies decode.
    """

    groups: list[Group] = []
    judged_at: int | None = None
    kept: int = 0
    recycled: int = 0
    dropped: int = 0
    staleness_avg: float | None = None
    staleness_max: int | None = None
    tokens_generated: int = 0
    tokens_not_trained: int = 0
    lag_s: float | None = None
    """How long the rollout's tracker took to see ``min_version`` after it was published (None if replayed)."""
    wait_s: float = 0.0
    """Seconds the rollout waited for its tracker to hold ``min_version`` (weightbus's propagation, on the step)."""
    drain_s: float = 0.0
    """Seconds the drain's own code ran (judging, bookkeeping), without its waits for generated groups."""
    error: str | None = None
    rollout_id: str = ""
    """The rollout process that answered, new at each start: ``tokens_generated`` and ``tokens_not_trained`` count
    from that start, so a run's totals sum each process's last counts (``weightbus.rl.report.run_tokens``)."""


async def serve_batches(
    bus: NatsBus, policy: str, handler: Callable[[BatchRequest], Awaitable[BatchReply]]
) -> rpc.Served:
    """Answer batch requests on ``batch_subject(policy)`` with ``handler`` (``bus.rpc.serve``); returns the
    subscription, once the server has registered it.

    Requests are handled one at a time (a drain takes groups out of the buffer; two at once would split it). A
    request with ``patience_s`` reaches the handler with what is left of it once its turn comes, less a margin
    for the answer (``BatchRequest``); one whose patience ran out while it queued is answered with an error.

    Args:
        bus: a connected ``NatsBus``.

    Raises:
        PermissionDeniedError: this user may not subscribe to the subject.
    """
    lock = asyncio.Lock()

    async def on_request(data: bytes, arrived: float) -> bytes:
        try:
            request = msgspec.json.decode(data, type=BatchRequest)
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
        return msgspec.json.encode(reply)

    def on_error(exc: BaseException) -> None:
        log.error("a batch request failed", extra={"policy": policy, "error": repr(exc)})

    return await rpc.serve(bus, batch_subject(policy), on_request, on_error=on_error)


async def request_batch(bus: NatsBus, policy: str, request: BatchRequest, *, timeout: float) -> BatchReply:
    """Ask the rollout for a batch and reassemble its chunks (``bus.rpc.request``).

    Args:
        bus: a connected ``NatsBus``.

    Raises:
        TimeoutError: no complete answer within ``timeout`` seconds.
        NoRolloutError: nobody serves the subject (the server answered "no responders").
        ValueError: the answer does not decode.
        PermissionDeniedError: this user may not publish to the subject.
    """
    answer = await rpc.request(bus, batch_subject(policy), msgspec.json.encode(request), timeout=timeout)
    if isinstance(answer, rpc.NoResponders):
        raise NoRolloutError(f"no rollout answers on {answer.subject} (status {answer.status})")
    try:
        return msgspec.json.decode(answer, type=BatchReply)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"invalid batch reply: {exc}") from None
