"""``ReplicaFollower``: the replica view of one policy (``rules.replicas``), fed live from the bus.

It replays the retained history of ``weights``, ``applied`` and ``alerts`` and then follows them; every event goes
through the one fold, ``rules.replicas.observe``, whose result does not depend on arrival order or duplicates, so a
resubscription simply replays again. Invariants: it is ``ready`` only once every subject's history up to its
subscription is folded (before that the view may miss a later quarantine); histograms observe only events stored
after the subscription began and not republished by ``weightbus replay``; a lost subscription is retried under a
``Backoff`` and leaves the follower not ready until it has replayed again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Final, TypeVar

from weightbus.backoff import Backoff
from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.protocol import Bus, Deliver, Skipped
from weightbus.bus.trace import is_replayed
from weightbus.consumers.replicas.metrics import PolicyConvergenceMetrics
from weightbus.errors import BusError
from weightbus.rules.replicas import ReplicaView, fold_replicas, observe

__all__ = ["ReplicaFollower", "read_replicas"]

log = logging.getLogger("weightbus.consumers")

_T = TypeVar("_T")
_RESUBSCRIBE: Final = Backoff(first_s=0.1, cap_s=5.0)


class ReplicaFollower:
    """Follow what the engines of ``policy`` serve; use as ``async with ReplicaFollower(bus, policy) as f``.

    Args:
        bus: the bus.
        policy: the policy id.
        metrics: the convergence metrics of this policy (``ConvergenceMetrics(registry).for_policy(policy)``).
        max_versions: how many versions keep their rollout in the view.
    """

    def __init__(
        self, bus: Bus, policy: str, *, metrics: PolicyConvergenceMetrics | None = None, max_versions: int = 32
    ) -> None:
        self.policy = subjects.validate_policy(policy)
        self._bus = bus
        self._metrics = metrics
        self._view = ReplicaView(max_versions=max_versions)
        self._subjects = (subjects.weights(policy), subjects.applied(policy), subjects.alerts(policy))
        self._caught_up: set[str] = set()
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def view(self) -> ReplicaView:
        """The replica view now (an immutable snapshot)."""
        return self._view

    @property
    def ready(self) -> bool:
        """Whether every subject's retained history is folded and its subscription is live."""
        return len(self._caught_up) == len(self._subjects)

    async def start(self) -> None:
        """Start following (idempotent)."""
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._follow(s), name=f"weightbus-replicas-{self.policy}-{s.rsplit('.', 1)[-1]}")
                for s in self._subjects
            ]

    async def aclose(self) -> None:
        """Stop following."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> ReplicaFollower:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def wait_until(self, found: Callable[[ReplicaView], _T | None], timeout: float | None) -> _T:
        """The first non-None ``found(view)`` of a ready view, waiting for events up to ``timeout`` seconds.

        Raises:
            TimeoutError: nothing was found in time.
        """
        async with asyncio.timeout(timeout), self._changed:
            while True:
                if self.ready:
                    result = found(self._view)
                    if result is not None:
                        return result
                await self._changed.wait()

    async def wait_ready(self, timeout: float | None = None) -> ReplicaView:
        """The view once ready (see ``ready``).

        Raises:
            TimeoutError: not ready in time.
        """
        return await self.wait_until(lambda view: view, timeout)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _follow(self, subject: str) -> None:
        attempt = 0
        while True:
            try:
                async with self._bus.subscribe(subject, deliver=Deliver.ALL, include_invalid=True) as sub:
                    boundary = await self._bus.last_seq(subject)
                    attempt = 0
                    if boundary == 0:
                        self._caught_up.add(subject)
                        await self._notify()
                    async for env in sub:
                        seq = env.seq
                        if isinstance(env, Skipped):  # counted by the bus; only its place in the stream matters
                            if seq is None or seq >= boundary:
                                self._caught_up.add(subject)
                                await self._notify()
                            continue
                        live = seq is not None and seq > boundary and not is_replayed(env.headers)
                        before = self._view
                        self._view = after = observe(before, env.event)
                        if self._metrics is not None:
                            self._metrics.update(before, after, live=live)
                        if seq is None or seq >= boundary:
                            self._caught_up.add(subject)
                        await self._notify()
            except BusError as exc:  # a slow consumer among them: the fold replays idempotently
                self._caught_up.discard(subject)
                attempt += 1
                wait = _RESUBSCRIBE.delay(attempt)
                log.warning(
                    "replica subscription lost; resubscribing",
                    extra={"policy": self.policy, "subject": subject, "error": repr(exc), "retry_in": wait},
                )
                await asyncio.sleep(wait)


async def read_replicas(bus: Bus, policy: str, *, timeout: float = 10.0, max_versions: int = 32) -> ReplicaView:
    """The replica view of ``policy`` from the retained history alone (``weightbus status``): one read, no follow.

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        BusError: the bus did not answer, or a history did not arrive within ``timeout`` seconds.
    """
    policy = subjects.validate_policy(policy)
    events: list[object] = []
    for subject in (subjects.weights(policy), subjects.applied(policy), subjects.alerts(policy)):
        history = await read_subject_history(bus, subject, timeout=timeout)
        events.extend(env.event for env in history.events)
    return fold_replicas(events, max_versions=max_versions)
