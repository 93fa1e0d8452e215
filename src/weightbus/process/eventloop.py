"""The event loop weightbus's own processes run on: uvloop where it is installed, else asyncio's.

Library code never picks a loop; ``WEIGHTBUS_EVENT_LOOP`` (``asyncio``, ``uvloop``, ``auto``) decides here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from weightbus.errors import EventLoopError

__all__ = ["EVENT_LOOP_ENV", "loop_factory", "loop_name", "run"]

EVENT_LOOP_ENV = "WEIGHTBUS_EVENT_LOOP"
_CHOICES = ("auto", "uvloop", "asyncio")

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]

log = logging.getLogger("weightbus.process.eventloop")


def _choice() -> str:
    value = os.environ.get(EVENT_LOOP_ENV, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise EventLoopError(f"{EVENT_LOOP_ENV}={value!r}: expected one of {', '.join(_CHOICES)}")
    return value


def loop_factory() -> LoopFactory | None:
    """The factory of the loop to run on (``None``: asyncio's default), as ``WEIGHTBUS_EVENT_LOOP`` says.

    Raises:
        EventLoopError: an unknown value, or ``uvloop`` asked for and not importable.
    """
    choice = _choice()
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise EventLoopError(f"{EVENT_LOOP_ENV}=uvloop but uvloop does not import: {exc}") from None
        log.debug("uvloop not importable, running on asyncio's loop", extra={"error": str(exc)})
        return None
    factory: LoopFactory = uvloop.new_event_loop
    return factory


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop :func:`run` would use now (benchmarks record it)."""
    return "asyncio" if loop_factory() is None else "uvloop"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new loop of :func:`loop_factory`'s kind, as :func:`asyncio.run` does.

    Raises:
        EventLoopError: as :func:`loop_factory`; ``coro`` is closed unstarted.
    """
    try:
        factory = loop_factory()
    except EventLoopError:
        coro.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
