"""The ``WEIGHTBUS`` JetStream stream: what weightbus relies on, the check a client makes, and the admin upgrade.

A client creates it only when missing and never changes it (``StreamConfigError`` lists every mismatch); only
``create_or_upgrade`` writes it. The requirements: docs/operations.md#the-stream-belongs-to-the-operator.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig, StreamInfo

from weightbus.bus.subjects import PREFIX
from weightbus.errors import BusConnectError, StreamConfigError, StreamNotFoundError

__all__ = [
    "DEFAULT_DUPLICATE_WINDOW",
    "DEFAULT_HISTORY",
    "MAX_CONSUMERS",
    "StreamRequirements",
    "check",
    "create_or_upgrade",
    "describe",
    "ensure_stream",
    "mismatches",
    "stream_config",
]

log = logging.getLogger("weightbus.bus")

DEFAULT_HISTORY: Final = 256
DEFAULT_DUPLICATE_WINDOW: Final = 120.0
#: The consumers the stream allows: each tracker, drain, ``watch`` or ``follow`` holds one (an ordered consumer).
#: nats-server 2.15 gives a stream that sets none (or -1) 1,000, so the 1,001st tracker could never subscribe.
MAX_CONSUMERS: Final = 10_000
_ALL: Final = f"{PREFIX}.>"
_STREAM_NOT_FOUND: Final = 10059
_NO_JETSTREAM: Final = "JetStream is not enabled on this server (start it with -js)"


@dataclasses.dataclass(frozen=True)
class StreamRequirements:
    """What a weightbus client needs from the stream.

    Attributes:
        history: minimum events kept per subject.
        duplicate_window: minimum seconds a ``Nats-Msg-Id`` is remembered.
    """

    history: int = DEFAULT_HISTORY
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW


def stream_config(
    name: str,
    req: StreamRequirements,
    *,
    replicas: int = 1,
    deny_delete: bool = False,
    deny_purge: bool = False,
) -> StreamConfig:
    """The configuration weightbus creates a missing stream with."""
    return StreamConfig(
        name=name,
        subjects=[_ALL],
        storage=StorageType.FILE,
        max_msgs_per_subject=req.history,
        discard=DiscardPolicy.OLD,
        duplicate_window=req.duplicate_window,
        num_replicas=replicas,
        deny_delete=deny_delete,
        deny_purge=deny_purge,
        # Reads of a subject's last message (the fence's and the tracker's health checks) are answered by
        # any replica, without a round through the stream leader.
        allow_direct=True,
        max_consumers=MAX_CONSUMERS,
    )


def _covers(subjects: list[str]) -> bool:
    return any(s in (">", _ALL) for s in subjects)


def mismatches(config: StreamConfig, req: StreamRequirements) -> list[str]:
    """Every way ``config`` fails what weightbus relies on; empty when it fits."""
    problems: list[str] = []
    subjects = list(config.subjects or [])
    if not _covers(subjects):
        problems.append(f"subjects {subjects} do not cover {_ALL}")
    if config.subject_transform is not None:
        problems.append("a subject transform rewrites the subjects (an event could be forged on another subject)")
    if config.republish is not None:
        problems.append("a republish rule re-sends stored events on other subjects")
    if config.storage != StorageType.FILE:
        storage = getattr(config.storage, "value", config.storage)
        problems.append(f"storage is {storage}, needs file (the version counter must survive a restart)")
    history = config.max_msgs_per_subject
    if history is not None and 0 < history < req.history:
        problems.append(f"max_msgs_per_subject is {history}, needs at least {req.history}")
    window = config.duplicate_window or 0
    if window < req.duplicate_window:
        problems.append(f"duplicate_window is {window:g}s, needs at least {req.duplicate_window:g}s")
    if config.discard == DiscardPolicy.NEW:
        problems.append("discard is new, needs old (a full subject would refuse new versions)")
    if config.sealed:
        problems.append("the stream is sealed (it refuses every publish)")
    if config.mirror is not None:
        problems.append("the stream is a mirror (it refuses every publish)")
    return problems


def describe(info: StreamInfo) -> str:
    """The stream's configuration as weightbus sees it, in one line (and its cluster leader, if any)."""
    config = info.config
    leader = info.cluster.leader if info.cluster is not None else None
    parts = [
        f"stream {config.name}",
        f"subjects {','.join(config.subjects or [])}",
        f"replicas {config.num_replicas or 1}",
        f"history {config.max_msgs_per_subject}",
        f"duplicate_window {config.duplicate_window:g}s",
        f"deny_delete {str(bool(config.deny_delete)).lower()}",
        f"deny_purge {str(bool(config.deny_purge)).lower()}",
        # Every tracker, drain, watch and follow holds one: how close the stream is to refusing the next.
        f"consumers {info.state.consumer_count} of {_consumer_limit(config.max_consumers)}",
    ]
    if leader:
        parts.append(f"leader {leader}")
    return ", ".join(parts)


def _consumer_limit(configured: int | None) -> str:
    if configured is not None and configured > 0:
        return f"{configured}"
    return "the server's default (1,000 on nats-server 2.15; `weightbus stream create` sets 10,000)"


async def _info(js: JetStreamContext, name: str, url: str) -> StreamInfo | None:
    try:
        return await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        return None
    except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError):
        raise BusConnectError(url, _NO_JETSTREAM, "no_jetstream") from None
    except nats.js.errors.APIError as exc:
        if exc.err_code == _STREAM_NOT_FOUND:
            return None
        raise BusConnectError(url, f"cannot read stream {name}: {exc.description}", "stream") from None


async def ensure_stream(
    js: JetStreamContext, name: str, req: StreamRequirements, *, url: str, replicas: int = 1
) -> bool:
    """Create the stream when it is missing; otherwise check it and leave it unchanged.

    Returns:
        Whether the stream answers direct gets (``allow_direct``).

    Raises:
        StreamConfigError: the stream exists but does not fit (every mismatch is named).
        BusConnectError: JetStream is not enabled, or the stream could not be read or created.
    """
    info = await _info(js, name, url)
    if info is None:
        config = stream_config(name, req, replicas=replicas)
        try:
            await js.add_stream(config)
            log.info("created stream", extra={"stream": name, "replicas": replicas})
            return bool(config.allow_direct)
        except nats.js.errors.BadRequestError as exc:
            # Another client created it between our read and our create: check theirs like any other.
            info = await _info(js, name, url)
            if info is None:
                raise BusConnectError(url, f"cannot create stream {name}: {exc.description}", "stream") from None
        except nats.js.errors.APIError as exc:
            raise BusConnectError(url, f"cannot create stream {name}: {exc.description}", "stream") from None
    problems = mismatches(info.config, req)
    if problems:
        raise StreamConfigError(url, name, problems)
    return bool(info.config.allow_direct)


async def check(js: JetStreamContext, name: str, req: StreamRequirements, *, url: str) -> tuple[StreamInfo, list[str]]:
    """Read the stream without changing it: its info, and every way it fails ``req`` (empty when it fits).

    Raises:
        StreamNotFoundError: the stream does not exist.
        BusConnectError: JetStream is not enabled, or the stream could not be read.
    """
    info = await _info(js, name, url)
    if info is None:
        raise StreamNotFoundError(url, name)
    return info, mismatches(info.config, req)


async def create_or_upgrade(
    js: JetStreamContext,
    name: str,
    req: StreamRequirements,
    *,
    replicas: int,
    deny_delete: bool = True,
    deny_purge: bool = True,
    url: str = "nats",
) -> tuple[str, StreamInfo]:
    """Create the stream, or rewrite the fields weightbus relies on (plus replicas and deny flags).

    Returns ``("created" | "upgraded" | "unchanged", info)``. Settings weightbus does not rely on
    (limits, placement, description, metadata) are kept as the operator set them.

    Raises:
        BusConnectError: the server refused the create or update (its description is in the message).
    """
    info = await _info(js, name, url)
    if info is None:
        config = stream_config(name, req, replicas=replicas, deny_delete=deny_delete, deny_purge=deny_purge)
        try:
            created = await js.add_stream(config)
        except nats.js.errors.APIError as exc:
            raise BusConnectError(url, f"cannot create stream {name}: {exc.description}", "stream") from None
        return "created", created
    old = info.config
    subjects = list(old.subjects or [])
    new = dataclasses.replace(
        old,
        subjects=subjects if _covers(subjects) else [*subjects, _ALL],
        subject_transform=None,
        republish=None,
        # 0 or -1 is unlimited, which already keeps enough history.
        max_msgs_per_subject=max(old.max_msgs_per_subject, req.history)
        if (old.max_msgs_per_subject or 0) > 0
        else old.max_msgs_per_subject,
        duplicate_window=max(old.duplicate_window or 0, req.duplicate_window),
        discard=DiscardPolicy.OLD,
        num_replicas=replicas,
        deny_delete=old.deny_delete or deny_delete,
        deny_purge=old.deny_purge or deny_purge,
        allow_direct=True,
        # Unset (0 or -1) is the server's default, 1,000 on nats-server 2.15; a limit the operator set is kept.
        max_consumers=old.max_consumers if (old.max_consumers or 0) > 0 else MAX_CONSUMERS,
    )
    if new == old:
        return "unchanged", info
    try:
        updated = await js.update_stream(new)
    except nats.js.errors.APIError as exc:
        raise BusConnectError(url, f"cannot upgrade stream {name}: {exc.description}", "stream") from None
    return "upgraded", updated
