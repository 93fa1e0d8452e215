"""Permission refusals of one NATS connection, turned into ``PermissionDeniedError`` instead of timeouts.

The server's ``-ERR`` reaches ``Denials.record``, which interrupts the operation ``Denials.guard`` guards.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from weightbus.bus._cancel import honouring_cancel
from weightbus.errors import PermissionDeniedError

__all__ = ["Denials"]

T = TypeVar("T")
_PATTERN: Final = re.compile(r'permissions violation for (?P<kind>publish|subscription) to "(?P<subject>[^"]+)"', re.I)

#: Predicate over (action, subject) naming which refusals end an operation.
Match = Callable[[str, str], bool]


class _Waiter:
    """One guarded operation: what it watches for, the task running it, and the refusal if one came."""

    __slots__ = ("match", "refused", "task")

    def __init__(self, match: Match, task: asyncio.Task[object] | None) -> None:
        self.match = match
        self.task = task
        self.refused: tuple[str, str] | None = None


class Denials:
    """Refusals seen on one connection, and the operations waiting to hear about them."""

    def __init__(self) -> None:
        self._waiters: list[_Waiter] = []
        self.last_caught = False
        """Whether the last refusal recorded interrupted a guarded operation (which then reports it)."""

    def record(self, message: str) -> bool:
        """Parse a server error; interrupt the operations it refuses. True when it was a permission refusal."""
        found = _PATTERN.search(message)
        if found is None:
            return False
        action = "publish" if found.group("kind").lower() == "publish" else "subscribe"
        subject = found.group("subject")
        self.last_caught = False
        for waiter in list(self._waiters):
            if waiter.refused is None and waiter.match(action, subject):
                waiter.refused = (action, subject)
                self.last_caught = True
                if waiter.task is not None:
                    waiter.task.cancel()
        return True

    async def guard(self, match: Match, op: Awaitable[T], *, subject: str | None = None) -> T:
        """Await ``op`` in this task; if the server refuses a matching action meanwhile, interrupt it and raise.

        No task is created (the happy path costs a list append): a refusal cancels the running task, and
        that cancellation is turned into the error here. nats-py lower-cases the server's error text, so
        matching ignores case and the error names ``subject`` (the caller's spelling) when given.

        Raises:
            PermissionDeniedError: a refusal matching ``match`` arrived before ``op`` finished.
        """
        waiter = _Waiter(match, asyncio.current_task())
        self._waiters.append(waiter)
        try:
            # A cancel nats-py swallowed (its wait_for on CPython 3.11) is raised here, the refusal's own included.
            result = await honouring_cancel(op)
        except asyncio.CancelledError:
            if waiter.refused is None:
                raise
            if waiter.task is not None:
                waiter.task.uncancel()
            raise PermissionDeniedError(waiter.refused[0], subject or waiter.refused[1]) from None
        except Exception:
            if waiter.refused is None:
                raise
            raise PermissionDeniedError(waiter.refused[0], subject or waiter.refused[1]) from None
        finally:
            self._waiters.remove(waiter)
        if waiter.refused is not None:  # refused although the operation returned (a subscribe, say)
            raise PermissionDeniedError(waiter.refused[0], subject or waiter.refused[1])
        return result

    @staticmethod
    def publish_to(subject: str) -> Match:
        """Refusals of a publish to exactly ``subject``."""
        wanted = subject.lower()
        return lambda action, refused: action == "publish" and refused.lower() == wanted

    @staticmethod
    def api_or_inbox(api_prefix: str, inbox_prefix: str = "_INBOX.") -> Match:
        """Refusals of a publish under ``api_prefix`` (a JetStream API call) or of a subscription under
        ``inbox_prefix`` (where JetStream's replies and a push consumer's deliveries arrive).

        A refusal of another subscription on the same connection (another task's subject) is not this
        operation's, and must not fail it.
        """
        api, inbox = api_prefix.lower(), inbox_prefix.lower()
        return lambda action, refused: (
            refused.lower().startswith(inbox) if action == "subscribe" else refused.lower().startswith(api)
        )
