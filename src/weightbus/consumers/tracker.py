"""``VersionTracker``: a rollout-side follower of one policy's current weight version, held in memory.

The tracker subscribes to ``weightbus.<policy>.weights`` replaying the subject's retained history
(``Deliver.ALL``; the stream keeps the last 64 events per subject), so a tracker that starts or
restarts learns the current version from the stream at once, without waiting for the next update,
and a lower version stored after a higher one (a publisher that bypassed the counter) is caught as a
regression even by a tracker that was not running when it was published. Each event goes through
the pure rule ``tracker_state.decide``.

Invariants:

* ``current`` is None only while the policy has never published a version (staleness unknown, so the
  filter is off); it never becomes None again once known.
* A lower version is never taken silently: it is logged, counted
  (``weightbus_version_regressions_total``), published as ``VersionRegressed`` on the policy's alerts
  subject (msg id derived from the facts, so a retry stores one alert) and handled by the mode:
  ``hold``, ``follow`` or ``raise``. ``raise`` is terminal: the follow loop stops, and ``current``,
  the waiters and the iterators raise ``VersionRegressionError``.
* The follow loop survives its subscription: an invalid payload is skipped by the bus; a
  ``SlowConsumerError``, a lost connection or any other failure of the subscription is logged,
  counted (``weightbus_tracker_resubscribes_total``) and followed by a new subscription after a
  backoff, which re-learns the current version. Events at or below the stream sequence already
  handled before the failure are skipped, so a replayed history is never handled twice.
* Propagation lag (``published_at`` → receipt) is observed for live updates only. The event replayed
  at (re)subscription was published before this subscription existed; its age measures how long the
  version has been current (or how long the tracker was away), not how fast updates propagate, and
  would swamp the histogram with minutes or hours. Replayed means: stream sequence at or below the
  subject's last sequence read right after subscribing. Lag uses two clocks (the trainer's and
  ours); a negative value from clock skew is recorded as 0.

``VersionChange`` and the bounded queues behind ``changes()`` live in ``tracker_changes``;
``VersionChange`` is re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType

from prometheus_client import CollectorRegistry

from weightbus.bus import subjects
from weightbus.bus.protocol import Bus, Deliver, Envelope
from weightbus.consumers.tracker_changes import _END, VersionChange, _Listener
from weightbus.consumers.tracker_metrics import TrackerMetrics
from weightbus.consumers.tracker_state import RegressionMode, TrackerAction, TrackerDecision, TrackerState, decide
from weightbus.errors import BusError, InvalidEventError, SlowConsumerError, VersionRegressionError
from weightbus.schemas.alerts import VersionRegressed
from weightbus.schemas.common import now
from weightbus.schemas.weights import PublisherClaimed, WeightUpdated

__all__ = ["VersionChange", "VersionTracker", "default_observer"]

log = logging.getLogger("weightbus.consumers")


def default_observer() -> str:
    """``<hostname>:<pid>``: names this process in the alerts it publishes."""
    return f"{socket.gethostname()}:{os.getpid()}"


class VersionTracker:
    """Follows the current weight version of one policy.

    Use it as ``async with VersionTracker(bus, policy) as tracker:`` (the follow loop runs as a task),
    or call ``start()``/``stop()``, or await ``run()`` in a task of your own.

    Args:
        bus: the bus to follow.
        policy: the policy id.
        regression: ``hold`` (default), ``follow`` or ``raise``; see ``RegressionMode``.
        metrics: shared metric families (one per registry); built on ``registry`` when None.
        registry: where to register the metrics when ``metrics`` is None (a private one when both are None).
        observer: names this tracker in ``VersionRegressed`` alerts (``<hostname>:<pid>`` by default).
        retry_delay: first backoff before resubscribing after a failure, in seconds (doubles up to
            ``max_retry_delay``).
        max_retry_delay: the longest backoff, in seconds.
        max_pending_changes: bound of each ``changes()`` iterator's queue.

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        ValueError: ``regression`` is not a mode, or both ``metrics`` and ``registry`` were given.
    """

    def __init__(
        self,
        bus: Bus,
        policy: str,
        *,
        regression: RegressionMode | str = RegressionMode.HOLD,
        metrics: TrackerMetrics | None = None,
        registry: CollectorRegistry | None = None,
        observer: str | None = None,
        retry_delay: float = 0.5,
        max_retry_delay: float = 5.0,
        max_pending_changes: int = 1024,
    ) -> None:
        if metrics is not None and registry is not None:
            raise ValueError("pass metrics or registry, not both (metrics already has a registry)")
        self.policy = subjects.validate_policy(policy)
        self.mode = RegressionMode(regression)
        self.metrics = metrics if metrics is not None else TrackerMetrics(registry)
        self.observer = observer or default_observer()
        self._bus = bus
        self._subject = subjects.weights(policy)
        self._m = self.metrics.for_policy(self.policy)
        self._retry_delay = retry_delay
        self._max_retry_delay = max_retry_delay
        self._max_pending = max_pending_changes
        self._state = TrackerState()
        self._ready = False
        self._error: VersionRegressionError | None = None
        self._running = False
        self._stopped = False
        self._task: asyncio.Task[None] | None = None
        self._waker = asyncio.Event()
        self._listeners: list[_Listener] = []
        self._last_change: VersionChange | None = None
        self._last_handled: tuple[int, bytes] | None = None
        self._boundary: int | None = None
        self._subscribed_at = 0.0

    # -- state -----------------------------------------------------------------------------------

    @property
    def current(self) -> int | None:
        """The current version, or None while the policy has never published one.

        Raises:
            VersionRegressionError: the tracker is in ``raise`` mode and saw a regression.
        """
        if self._error is not None:
            raise self._error
        return self._state.version

    @property
    def state(self) -> TrackerState:
        """Everything known: version, epoch, publisher, time of the last update (no raising)."""
        return self._state

    @property
    def epoch(self) -> int | None:
        """The epoch of the latest accepted event."""
        return self._state.epoch

    @property
    def publisher(self) -> str | None:
        """The trainer id of the latest accepted event."""
        return self._state.publisher

    @property
    def ready(self) -> bool:
        """Whether the stored state was replayed (``current`` is then the bus's current version)."""
        return self._ready

    @property
    def error(self) -> VersionRegressionError | None:
        """The regression that stopped a ``raise``-mode tracker, else None."""
        return self._error

    @property
    def seconds_since_update(self) -> float | None:
        """Seconds since the last accepted update was published (None before one); two clocks, see module doc."""
        updated_at = self._state.updated_at
        return None if updated_at is None else max(0.0, time.time() - updated_at)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> VersionTracker:
        """Run the follow loop as a task (idempotent)."""
        if self._stopped:
            raise RuntimeError(f"the tracker of {self.policy!r} was stopped; create a new one")
        if self._task is None and not self._running:
            self._task = asyncio.create_task(self.run(), name=f"weightbus-tracker-{self.policy}")
            self._task.add_done_callback(_retrieve)
        return self

    async def stop(self) -> None:
        """Stop the follow loop; iterators end and waiters raise ``RuntimeError``."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
        self._finish()

    async def __aenter__(self) -> VersionTracker:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def run(self) -> None:
        """Follow the policy until cancelled or the bus closes.

        Raises:
            VersionRegressionError: ``raise`` mode saw a lower version (also delivered to waiters).
        """
        self._running = True
        delay = self._retry_delay
        try:
            while True:
                try:
                    async with self._bus.subscribe(self._subject, deliver=Deliver.ALL) as sub:
                        self._subscribed_at = time.time()
                        self._boundary = await self._stored_seq()
                        if self._boundary == 0:
                            self._set_ready()
                        async for env in sub:
                            await self._handle(env)
                            delay = self._retry_delay
                    log.info("weights subscription ended", extra={"policy": self.policy})
                    return
                except VersionRegressionError:
                    raise
                except Exception as exc:
                    # Deliberate fault tolerance: a dead follower would freeze ``current`` silently, which is
                    # the failure this class exists to prevent; a fresh subscription re-learns the version.
                    self._m.count_resubscribe()
                    log.warning(
                        "weights subscription failed; resubscribing",
                        extra={
                            "policy": self.policy,
                            "error": repr(exc),
                            "slow_consumer": isinstance(exc, SlowConsumerError),
                            "retry_in": delay,
                        },
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._max_retry_delay)
        except VersionRegressionError as exc:
            self._error = exc
            for listener in self._listeners:
                listener.push(exc)
            raise
        finally:
            self._running = False
            self._finish()

    def _finish(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for listener in self._listeners:
            listener.push(_END)
        self._wake()

    # -- waiting and iterating -------------------------------------------------------------------

    async def wait_ready(self, timeout: float | None = None) -> int | None:
        """Wait until the stored state was replayed; return ``current`` (None: never published).

        Raises:
            TimeoutError: not ready within ``timeout`` seconds.
            VersionRegressionError: ``raise`` mode saw a regression.
            RuntimeError: the tracker was stopped.
        """
        await self._wait_until(lambda: self._ready, timeout)
        return self._state.version

    async def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Wait until ``current >= version``; return ``current``.

        Raises:
            TimeoutError: not reached within ``timeout`` seconds.
            VersionRegressionError: ``raise`` mode saw a regression.
            RuntimeError: the tracker was stopped.
        """
        await self._wait_until(lambda: self._state.version is not None and self._state.version >= version, timeout)
        assert self._state.version is not None
        return self._state.version

    async def _wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> None:
        async with asyncio.timeout(timeout):
            while True:
                if self._error is not None:
                    raise self._error
                if predicate():
                    return
                if self._stopped:
                    raise RuntimeError(f"the tracker of {self.policy!r} is stopped")
                await self._waker.wait()

    def _wake(self) -> None:
        self._waker.set()
        self._waker = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[VersionChange]:
        return self.changes()

    async def changes(self, *, include_regressions: bool = False) -> AsyncIterator[VersionChange]:
        """Iterate over version changes: the change that set the current version first (if known), then each one.

        Args:
            include_regressions: also yield regressions the tracker held (``action == "held"``, version unchanged).

        Raises:
            VersionRegressionError: ``raise`` mode saw a regression.
            SlowConsumerError: this iterator fell more than ``max_pending_changes`` behind.
        """
        listener = _Listener(include_regressions, self._max_pending)
        if self._last_change is not None:
            listener.push(self._last_change)
        if self._error is not None:
            listener.push(self._error)
        elif self._stopped:
            listener.push(_END)
        self._listeners.append(listener)
        try:
            while (change := await listener.next(self._subject)) is not None:
                yield change
        finally:
            self._listeners.remove(listener)

    # -- the follow loop -------------------------------------------------------------------------

    async def _stored_seq(self) -> int | None:
        """The subject's last stream sequence: 0 if nothing is stored, None if the bus has no sequences."""
        try:
            env = await self._bus.last(self._subject)
        except InvalidEventError as exc:
            # The stored payload is skipped by the subscription too: nothing valid will be replayed.
            log.warning(
                "the latest stored weights event is invalid; the version is learned at the next update",
                extra={"policy": self.policy, "reason": exc.reason, "detail": exc.detail},
            )
            return 0
        if env is None:
            return 0
        return env.seq

    def _set_ready(self) -> None:
        if not self._ready:
            self._ready = True
            log.info("tracker ready", extra={"policy": self.policy, "version": self._state.version})
            self._wake()

    def _is_replay(self, env: Envelope, published_at: float) -> bool:
        if env.seq is not None and self._boundary is not None:
            return env.seq <= self._boundary
        return published_at < self._subscribed_at

    async def _handle(self, env: Envelope) -> None:
        event = env.event
        if not isinstance(event, WeightUpdated | PublisherClaimed):
            log.warning("unexpected event on the weights subject", extra={"subject": env.subject, "type": type(event)})
            return
        if event.policy != self.policy:
            log.warning(
                "weights event names another policy; skipped",
                extra={"subject": env.subject, "policy": self.policy, "event_policy": event.policy},
            )
            self._after(env)
            return
        if env.seq is not None and self._last_handled is not None and env.seq <= self._last_handled[0]:
            self._after(env)  # history already handled before a resubscribe
            return
        replayed = self._is_replay(env, event.published_at)
        decision = decide(self._state, event, self.mode)
        if env.seq is not None:
            self._last_handled = (env.seq, env.data)
        self._state = decision.state
        lag: float | None = None
        if decision.is_update and not replayed:
            lag = max(0.0, env.received_at - event.published_at)
            self._m.observe_lag(lag)
        self._m.set_state(self._state.version, self._state.epoch, self._state.updated_at)
        change = VersionChange(
            policy=self.policy,
            action=decision.action,
            previous=decision.previous.version,
            version=decision.state.version,
            incoming=decision.incoming,
            epoch=event.epoch,
            publisher=event.trainer_id,
            published_at=event.published_at,
            received_at=env.received_at,
            lag=lag,
            replayed=replayed,
        )
        if decision.is_regression:
            await self._on_regression(decision, event)
        elif decision.claim_behind:
            log.warning(
                "takeover claim names a lower version than the one held; the next update may regress",
                extra={"policy": self.policy, "current": decision.previous.version, "claimed": decision.incoming},
            )
        if decision.changed:
            self._last_change = change
            log.info(
                "weight version changed",
                extra={
                    "policy": self.policy,
                    "action": str(decision.action),
                    "previous": decision.previous.version,
                    "version": decision.state.version,
                    "epoch": event.epoch,
                    "publisher": event.trainer_id,
                    "lag": lag,
                    "replayed": replayed,
                },
            )
        if decision.changed or decision.action is TrackerAction.HELD:
            for listener in self._listeners:
                if decision.changed or listener.include_regressions:
                    listener.push(change)
        self._after(env)
        if decision.action is TrackerAction.RAISED:
            assert decision.previous.version is not None and decision.incoming is not None
            raise VersionRegressionError(self.policy, decision.previous.version, decision.incoming, event.trainer_id)

    def _after(self, env: Envelope) -> None:
        if not self._ready and (self._boundary is None or env.seq is None or env.seq >= self._boundary):
            self._set_ready()
        self._wake()

    async def _on_regression(self, decision: TrackerDecision, event: WeightUpdated | PublisherClaimed) -> None:
        assert isinstance(event, WeightUpdated) and decision.previous.version is not None
        current, incoming = decision.previous.version, event.version
        self._m.count_regression()
        facts = {
            "policy": self.policy,
            "current": current,
            "incoming": incoming,
            "incoming_epoch": event.epoch,
            "publisher": event.trainer_id,
            "mode": str(self.mode),
            "observer": self.observer,
        }
        log.error("weight version went backwards", extra=facts)
        alert = VersionRegressed(
            policy=self.policy,
            current=current,
            incoming=incoming,
            incoming_epoch=event.epoch,
            publisher=event.trainer_id,
            action=self.mode.value,
            observer=self.observer,
            published_at=now(),
        )
        msg_id = f"{self.policy}:regressed:{current}:{incoming}:{event.epoch}:{self.observer}"
        try:
            await self._bus.publish(subjects.alerts(self.policy), alert, msg_id=msg_id)
        except BusError as exc:
            log.error("could not publish the regression alert", extra={**facts, "error": repr(exc)})


def _retrieve(task: asyncio.Task[None]) -> None:
    # The error of a raise-mode tracker reaches users through ``current``, the waiters and the
    # iterators; reading it here keeps asyncio from reporting it as never retrieved.
    if not task.cancelled():
        task.exception()
