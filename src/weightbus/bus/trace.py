"""Record and replay of event traces (JSON Lines), for tests, debugging and demos.

The format, and what a replay keeps and drops (message ids, ``Nats-Expected-*``, pacing): docs/trace-format.md.
Every replayed event carries ``Weightbus-Replayed: 1`` (``REPLAYED_HEADER``): its ``published_at`` is the recorded one,
so consumers must not read its age as a propagation delay. The header changes nothing else: no check trusts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Final

import msgspec

from weightbus.bus.protocol import Bus, Deliver, Envelope, PublishAck

__all__ = [
    "REPLAYED_HEADER",
    "TRACE_FORMAT_VERSION",
    "TraceRecord",
    "is_replayed",
    "read_trace",
    "record",
    "replay",
    "write_record",
]

TRACE_FORMAT_VERSION = 1

#: The header ``replay`` sets on every event it republishes (value ``"1"``).
REPLAYED_HEADER: Final = "Weightbus-Replayed"


def is_replayed(headers: Mapping[str, str]) -> bool:
    """Whether a message with ``headers`` was republished from a trace (``replay``), not published live.

    For metrics only (a replayed event's age is not a propagation delay): anyone who may publish can set
    the header, so no integrity rule may depend on it.
    """
    return headers.get(REPLAYED_HEADER) == "1"


class TraceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded event. ``event`` holds the raw wire JSON of the payload."""

    subject: str
    received_at: float
    event: msgspec.Raw
    headers: dict[str, str] = {}
    seq: int | None = None
    v: int = TRACE_FORMAT_VERSION

    @classmethod
    def from_envelope(cls, env: Envelope) -> TraceRecord:
        """The record of a received envelope."""
        return cls(
            subject=env.subject,
            received_at=env.received_at,
            event=msgspec.Raw(env.data),
            headers=dict(env.headers),
            seq=env.seq,
        )


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TraceRecord)


def write_record(out: IO[bytes], rec: TraceRecord) -> None:
    """Append one record as a line and flush, so a killed recorder loses at most one line."""
    out.write(_encoder.encode(rec) + b"\n")
    out.flush()


def read_trace(path: str | Path) -> Iterator[TraceRecord]:
    """Records of a trace file, in order; blank lines are skipped.

    Raises:
        ValueError: a line is not a trace record (with the line number).
    """
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a trace record: {exc}") from None


async def record(
    bus: Bus,
    out: IO[bytes],
    *,
    pattern: str = "weightbus.>",
    deliver: Deliver = Deliver.NEW,
    count: int | None = None,
    duration: float | None = None,
) -> int:
    """Write every valid event on ``pattern`` to ``out`` until ``count`` events or ``duration`` seconds.

    Invalid payloads are not recorded (the bus counts and logs them). Returns the number recorded.
    """
    written = 0
    sub = bus.subscribe(pattern, deliver=deliver)

    async def _loop() -> None:
        nonlocal written
        async for env in sub:
            write_record(out, TraceRecord.from_envelope(env))
            written += 1
            if count is not None and written >= count:
                return

    task = asyncio.ensure_future(_loop())
    try:
        # Reaching ``duration`` is the normal end of a timed recording, not an error.
        await asyncio.wait({task}, timeout=duration)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await sub.aclose()
    if not task.cancelled():
        task.result()  # re-raises a failure of the subscription
    return written


async def replay(
    records: Iterable[TraceRecord],
    bus: Bus,
    *,
    speed: float | None = None,
    msg_id_suffix: str | None = None,
) -> list[PublishAck]:
    """Republish ``records`` in order into ``bus``, each marked with ``REPLAYED_HEADER``.

    Args:
        records: e.g. ``read_trace(path)``.
        bus: a MemoryBus or a NatsBus.
        speed: None or 0 replays as fast as possible; X > 0 keeps the recorded gaps divided by X.
        msg_id_suffix: appended to each ``Nats-Msg-Id`` (replaying into the stream the trace came from).

    Returns:
        The acknowledgements, one per record.
    """
    acks: list[PublishAck] = []
    first_at: float | None = None
    started = time.monotonic()
    for n, rec in enumerate(records):
        if speed:
            first_at = rec.received_at if first_at is None else first_at
            due = (rec.received_at - first_at) / speed
            wait = due - (time.monotonic() - started)
            if wait > 0:
                await asyncio.sleep(wait)
        # A recorded conditional publish must not stay conditional against another stream's sequences.
        headers = {k: v for k, v in rec.headers.items() if not k.startswith("Nats-Expected")}
        headers[REPLAYED_HEADER] = "1"
        msg_id = headers.pop("Nats-Msg-Id", f"replay:{n}:{rec.subject}:{rec.received_at}")
        if msg_id_suffix:
            msg_id = f"{msg_id}{msg_id_suffix}"
        acks.append(await bus.publish_raw(rec.subject, bytes(rec.event), msg_id=msg_id, headers=headers))
    return acks
