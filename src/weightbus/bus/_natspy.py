"""Every reach into nats-py's private state, each a small named function: nothing else in weightbus touches one.

``tests/bus/test_natspy_shape.py`` asserts each shape on the installed nats-py (``CHECKED_ON``: the versions checked).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

import nats.aio.client
from nats.aio.client import Client as NatsClient

__all__ = [
    "CHECKED_ON",
    "buffered_bytes",
    "client_tasks",
    "consumed",
    "delivery_queue",
    "direct_get_supported",
    "drop_buffered_writes",
    "end_tasks",
    "is_encrypted",
    "refuse_plaintext",
    "reopen_for_close",
    "subscription_tasks",
]

log = logging.getLogger("weightbus.bus")

CHECKED_ON: Final = ("2.14.0", "2.16.0")
"""The nats-py versions whose private shapes this module was checked against."""

_CLIENT_TASKS: Final = ("_reading_task", "_ping_interval_task", "_flusher_task", "_reconnection_task")
_JS_SUB_TASKS: Final = ("_hbtask", "_fctask")
_ROUND: Final = 0.05


def buffered_bytes(client: NatsClient) -> int:
    """Bytes of commands nats-py holds for a reconnection (written on reconnect, or by ``close()``)."""
    return int(client._pending_data_size)


def drop_buffered_writes(client: NatsClient) -> int:
    """Forget the commands nats-py buffered while disconnected; return how many bytes they were.

    nats-py keeps no other handle on them. A JetStream publish among them is not lost silently: it never
    reached the server, so its caller, waiting for the acknowledgement, gets an error or its timeout.
    """
    dropped = buffered_bytes(client)
    client._pending = []
    client._pending_data_size = 0
    return dropped


def reopen_for_close(client: NatsClient) -> None:
    """Mark a client whose ``close()`` failed half-way as connected, so that the next ``close()`` runs again.

    nats-py sets CLOSED first thing in ``close()``; a second call then returns at once and skips the cleanup the
    first one did not reach (subscription tasks, the socket, the closed callback).
    """
    client._status = NatsClient.CONNECTED


def delivery_queue(js_sub: Any) -> asyncio.Queue[Any]:
    """The queue nats-py puts a callback-less JetStream subscription's messages on (after its ordered checks)."""
    queue: asyncio.Queue[Any] = js_sub._sub._pending_queue
    return queue


def consumed(js_sub: Any, nbytes: int) -> None:
    """Account a message taken off ``delivery_queue`` as nats-py's own callback task would (its pending bytes)."""
    js_sub._sub._pending_size -= nbytes


def subscription_tasks(js_sub: Any) -> list[asyncio.Task[Any]]:
    """The heartbeat and flow-control tasks of a JetStream push subscription (nats-py's ``close()`` leaves them)."""
    jsi = getattr(js_sub._sub, "_jsi", None)
    found = [getattr(jsi, name, None) for name in _JS_SUB_TASKS] if jsi is not None else []
    return [t for t in found if isinstance(t, asyncio.Task)]


def client_tasks(client: NatsClient) -> list[asyncio.Task[Any]]:
    """Every task ``client`` holds now: its own four and each subscription's message and JetStream tasks."""
    found: list[Any] = [getattr(client, name) for name in _CLIENT_TASKS]
    for sub in list(client._subs.values()):
        found.append(sub._wait_for_msgs_task)
        jsi = getattr(sub, "_jsi", None)
        if jsi is not None:
            found.extend(getattr(jsi, name, None) for name in _JS_SUB_TASKS)
    return [t for t in found if isinstance(t, asyncio.Task)]


async def end_tasks(tasks: list[asyncio.Task[Any]], bound: float) -> list[asyncio.Task[Any]]:
    """Cancel ``tasks`` until each has ended, within ``bound`` seconds; return those still running after it.

    One cancel is not enough: a task may swallow it (nats-py's reconnection task does, when the cancel lands as a
    refused connection returns from ``asyncio.wait_for`` on CPython 3.11) and go on to its next ``await``, where a
    second cancel takes.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    current = asyncio.current_task()
    left = [t for t in tasks if t is not current and not t.done()]
    while left:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        for task in left:
            task.cancel()
        await asyncio.wait(left, timeout=min(remaining, _ROUND))
        left = [t for t in left if not t.done()]
    return left


def direct_get_supported() -> bool:
    """Whether nats-py can read a direct get's reply (it cannot with ``fast_mail_parser``: list-valued headers)."""
    return getattr(nats.aio.client, "parse_email", None) is None


def is_encrypted(client: NatsClient) -> bool:
    """Whether ``client``'s current connection runs over TLS (its transport's stream has an SSL object)."""
    transport = client._transport
    writer = getattr(transport, "_io_writer", None)
    if writer is not None:
        return writer.get_extra_info("ssl_object") is not None
    return bool(getattr(transport, "_using_tls", False))  # nats-py's websocket transport


def refuse_plaintext(client: NatsClient, refusal: Callable[[str], Exception]) -> None:
    """Make ``client`` raise ``refusal(server)`` instead of sending CONNECT over an unencrypted connection.

    nats-py upgrades to TLS only when the server's INFO asks for it, and then writes CONNECT (user, password,
    token, signed nonce) at once; this check runs in between, on the first connect and on every reconnect.
    ``refusal`` should return a ``nats.errors.Error`` so that nats-py's connect loop reports it to the error
    callback and moves on (to the next server, or to its next attempt), as it does for a failed handshake.
    """
    build = client._connect_command

    def checked() -> bytes:
        if not is_encrypted(client):
            current = client._current_server
            server = current.uri.geturl() if current is not None else "?"
            raise refusal(server)
        return build()

    client._connect_command = checked  # type: ignore[method-assign]
