"""Builders shared by the whole suite: one way to make a weight update, a rollout group, and to wait.

Each builder takes keyword arguments with defaults, so a test names only what it is about. ``wait_until``
is the suite's one readiness wait: a test waits for the condition it needs, never for a fixed time
(``has_waiters`` is the condition "a task reached its wait").
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from weightbus.schemas.rollouts import Group, Sample, SampleStatus, TokenSpan
from weightbus.schemas.weights import LoraAdapter, WeightArtifact, WeightUpdated

__all__ = ["N_SAMPLES", "has_waiters", "make_group", "updated", "wait_until"]

N_SAMPLES = 2


def updated(
    version: int,
    *,
    policy: str = "p",
    epoch: int = 1,
    trainer: str = "t",
    at: float | None = None,
    lora: LoraAdapter | None = None,
    engines: tuple[str, ...] = (),
    incarnation: str = "",
    reserves_next: bool = False,
    artifact: WeightArtifact | None = None,
) -> WeightUpdated:
    """A ``WeightUpdated`` of ``policy`` at ``version``, published ``at`` (now when None)."""
    return WeightUpdated(
        policy=policy,
        version=version,
        epoch=epoch,
        trainer_id=trainer,
        published_at=time.time() if at is None else at,
        lora=lora,
        engines=engines,
        incarnation=incarnation,
        reserves_next=reserves_next,
        artifact=artifact,
    )


def make_group(
    group_index: int,
    versions: list[str] | list[list[str]] | None = None,
    *,
    status: SampleStatus = SampleStatus.COMPLETED,
    n: int = N_SAMPLES,
    spans: list[TokenSpan] | None = None,
    tokens: list[int] | None = None,
) -> Group:
    """``n`` samples with ``index = group_index * 10 + i``; ``versions`` for every sample, or one list each.

    Every sample and the group have ``status``; each sample has the response ``"r"`` (length 1) and
    ``tokens`` (``[1, 2]`` by default).
    """
    nested = versions is not None and len(versions) > 0 and isinstance(versions[0], list)
    per_sample = cast("list[list[str]]", versions) if nested else [cast("list[str]", versions or [])] * n
    samples = [
        Sample(
            index=group_index * 10 + i,
            weight_versions=list(per_sample[i]),
            status=status,
            weight_version_spans=list(spans or []),
            response="r",
            tokens=list(tokens if tokens is not None else [1, 2]),
            response_length=1,
        )
        for i in range(n)
    ]
    return Group(prompt_index=group_index, samples=samples, status=status)


async def wait_until(
    predicate: Callable[[], object | Awaitable[object]],
    timeout: float = 5.0,
    what: str = "the condition",
    *,
    interval: float = 0.01,
) -> float:
    """Wait until ``predicate()`` is truthy (it may be a coroutine function); return the seconds it took.

    It is checked at once and then every ``interval`` seconds.

    Raises:
        AssertionError: it did not hold within ``timeout`` (``what`` says what was awaited).
    """
    started = time.monotonic()
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)


def has_waiters(primitive: asyncio.Event | asyncio.Condition | asyncio.Queue[Any]) -> bool:
    """Some task waits on ``primitive`` now: the condition for "it reached its wait", for ``wait_until``.

    asyncio keeps the futures of an event's and a condition's waiters in ``_waiters`` and of a queue's
    readers in ``_getters``; a done one is a waiter already woken.
    """
    waiters = getattr(primitive, "_getters" if isinstance(primitive, asyncio.Queue) else "_waiters")
    return any(not w.done() for w in waiters or ())
