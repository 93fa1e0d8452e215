"""``honouring_cancel``: await a nats-py call without losing a cancel of the calling task.

CPython 3.11's ``wait_for`` may swallow a cancel that arrives with the reply (python/cpython#86296): this raises it.
See docs/events.md#what-weightbus-needs-from-nats-pys-internals.
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
