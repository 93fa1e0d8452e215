"""Permission refusals of one NATS connection, turned into ``PermissionDeniedError`` instead of timeouts.

The server answers a forbidden publish or subscribe with ``-ERR 'Permissions Violation for Publish to
"<subject>"'`` and drops the message, so the request that carried it would only time out. nats-py hands
that error to the connection's error callback; ``Denials.record`` keeps it, and ``Denials.guard`` races an
operation against a refusal of its subject, so the caller gets a typed error as soon as the server says no.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from weightbus.errors import PermissionDeniedError

__all__ = ["Denials"]

T = TypeVar("T")
_PATTERN: Final = re.compile(r'permissions violation for (?P<kind>publish|subscription) to "(?P<subject>[^"]+)"', re.I)

#: Predicate over (action, subject) naming which refusals end an operation.
Match = Callable[[str, str], bool]


class Denials:
    """Refusals seen on one connection, and the operations waiting to hear about them."""

    def __init__(self) -> None:
        self._waiters: list[tuple[Match, asyncio.Future[tuple[str, str]]]] = []

    def record(self, message: str) -> bool:
        """Parse a server error; wake the operations it refuses. True when it was a permission refusal."""
        found = _PATTERN.search(message)
        if found is None:
            return False
        action = "publish" if found.group("kind").lower() == "publish" else "subscribe"
        subject = found.group("subject")
        for match, fut in list(self._waiters):
            if not fut.done() and match(action, subject):
                fut.set_result((action, subject))
        return True

    async def guard(self, match: Match, op: Awaitable[T], *, subject: str | None = None) -> T:
        """Await ``op``; if the server refuses a matching action first, cancel it and raise.

        nats-py lower-cases the server's error text, so matching ignores case and the error names
        ``subject`` (the caller's spelling) when given.

        Raises:
            PermissionDeniedError: a refusal matching ``match`` arrived before ``op`` finished.
        """
        loop = asyncio.get_running_loop()
        refused: asyncio.Future[tuple[str, str]] = loop.create_future()
        entry = (match, refused)
        self._waiters.append(entry)
        task = asyncio.ensure_future(op)
        try:
            await asyncio.wait({task, refused}, return_when=asyncio.FIRST_COMPLETED)
            if refused.done():
                # Refused: the operation would only time out (or already failed because of it).
                action, refused_subject = refused.result()
                raise PermissionDeniedError(action, subject or refused_subject)
            return task.result()
        finally:
            self._waiters.remove(entry)
            if not task.done():
                task.cancel()

    @staticmethod
    def publish_to(subject: str) -> Match:
        """Refusals of a publish to exactly ``subject``."""
        wanted = subject.lower()
        return lambda action, refused: action == "publish" and refused.lower() == wanted

    @staticmethod
    def api_or_inbox(api_prefix: str) -> Match:
        """Refusals of a publish under ``api_prefix`` (a JetStream API call) or of any subscription."""
        prefix = api_prefix.lower()
        return lambda action, refused: action == "subscribe" or refused.lower().startswith(prefix)
