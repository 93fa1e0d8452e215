"""``honouring_cancel``: await a nats-py call without losing a cancel of the calling task.

nats-py waits for each reply with ``asyncio.wait_for``. On CPython 3.11, ``wait_for`` returns the result when a
cancel reaches it in the loop iteration where the reply arrives (python/cpython#86296, fixed in 3.12): the
cancel is swallowed, the task is left marked as cancelling, and it runs on. A ``weightbus record`` sent SIGTERM
just as its consumer was created then recorded for ever (caught in ``tests/cli/test_signals.py``, 3 runs in 6).

Invariant: when ``honouring_cancel(op)`` returns, no cancel of the task was requested while ``op`` ran; if one
was and ``op`` returned anyway, it raises ``CancelledError`` in its place, as the awaited call should have.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["honouring_cancel"]

T = TypeVar("T")


async def honouring_cancel(op: Awaitable[T]) -> T:
    """``await op``; raises ``CancelledError`` if this task was cancelled meanwhile and ``op`` swallowed it."""
    task = asyncio.current_task()
    if task is None:
        return await op
    before = task.cancelling()
    result = await op
    if task.cancelling() > before:
        raise asyncio.CancelledError
    return result
