"""``VersionTracker``: a rollout-side follower of one policy's current weight version, held in memory.

It replays the weights subject's retained history, then follows it live through ``rules.chain``; ``current`` raises
``TrackerNotReadyError`` unless ready; never deaf in silence, nothing taken silently.
States and why: docs/design.md#the-tracker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from enum import StrEnum
from types import TracebackType

from prometheus_client import CollectorRegistry

from weightbus.backoff import Backoff, retry_async
from weightbus.bus import subjects
from weightbus.bus.identity import process_identity
from weightbus.bus.protocol import Bus, Deliver, Envelope, Skipped
from weightbus.bus.trace import is_replayed
from weightbus.consumers.tracker.alerts import TrackerAlerts
from weightbus.consumers.tracker.changes import ChangeFeed, VersionChange
from weightbus.consumers.tracker.cursor import ReplayCursor
from weightbus.consumers.tracker.health import SubscriptionWatchdog
from weightbus.consumers.tracker.heap import freeze_startup_heap
from weightbus.consumers.tracker.highwater import HighWaterWatch
from weightbus.consumers.tracker.metrics import TrackerMetrics
from weightbus.errors import SlowConsumerError, TrackerNotReadyError, VersionRegressionError
from weightbus.rules.chain import RegressionMode, TrackerAction, TrackerDecision, TrackerState, decide
from weightbus.schemas.weights import PublisherClaimed, VersionReserved, WeightUpdated

__all__ = ["TrackerStatus", "VersionChange", "VersionTracker"]

log = logging.getLogger("weightbus.consumers")


def _not_regression(exc: Exception) -> bool:
    return not isinstance(exc, VersionRegressionError)


class TrackerStatus(StrEnum):
    """What a tracker knows; see the module docstring."""

    STARTING = "starting"
    CURRENT = "current"
    NEVER_PUBLISHED = "never_published"
    NO_VALID_VERSION = "no_valid_version"
    DEAF = "deaf"
    STOPPED = "stopped"


_READY = frozenset({TrackerStatus.CURRENT, TrackerStatus.NEVER_PUBLISHED})
_NO_STATE = TrackerState()


class VersionTracker:
    """Follows the current weight version of one policy.

    Use it as ``async with VersionTracker(bus, policy) as tracker:`` (the follow loop runs as a task
    and entering waits until the tracker is ready), or call ``start()``/``wait_ready()``/``aclose()``,
    or await ``run()`` in a task of your own.

    Args:
        bus: the bus to follow.
        policy: the policy id.
        regression: ``hold`` (default), ``follow`` or ``raise``; see ``RegressionMode``.
        metrics: shared metric families (one per registry); built on ``registry`` when None.
        registry: where to register the metrics when ``metrics`` is None (a private one when both are None).
        observer: names this tracker in the alerts it publishes (``<hostname>:<pid>`` by default).
        retry_delay: the ceiling of the first wait before resubscribing after a failure, in seconds (doubles
            up to ``max_retry_delay``; each wait is drawn below its ceiling, ``weightbus.backoff``).
        max_retry_delay: the longest wait, in seconds.
        max_pending_changes: bound of each ``changes()`` iterator's queue.
        ready_timeout: seconds ``async with`` waits for readiness before raising ``TrackerNotReadyError``.
        check_interval: seconds of silence after which the subscription's health is checked against
            the subject's last sequence (a stalled or reset subscription is recreated).
        on_change: called synchronously with every ``VersionChange`` (must not block).
        freeze_heap: when the tracker is first ready, move everything allocated so far into the
            collector's permanent generation (``freeze_startup_heap``: ``gc.freeze``, once per
            process), so that a long-running consumer's full collections do not stall event delivery
            (about 0.5 s per collection seen with 8 tracker processes, all of them collecting at the
            same moment). Off by default: it acts on the whole process, so the host decides.
        on_status: called synchronously with every status change (``deaf``, ``current``...).

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        ValueError: ``regression`` is not a mode, both ``metrics`` and ``registry`` were given, or a retry delay
            is negative.
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
        ready_timeout: float = 10.0,
        check_interval: float = 2.0,
        on_change: Callable[[VersionChange], None] | None = None,
        freeze_heap: bool = False,
        on_status: Callable[[TrackerStatus], None] | None = None,
    ) -> None:
        if metrics is not None and registry is not None:
            raise ValueError("pass metrics or registry, not both (metrics already has a registry)")
        self.policy = subjects.validate_policy(policy)
        self.mode = RegressionMode(regression)
        self.metrics = metrics if metrics is not None else TrackerMetrics(registry)
        self.observer = observer or process_identity()
        self.ready_timeout = ready_timeout
        self._bus = bus
        self._subject = subjects.weights(policy)
        self._m = self.metrics.for_policy(self.policy)
        self._alerts = TrackerAlerts(bus, self.policy, self.observer, self.mode)
        self._high_water = HighWaterWatch(bus, self.policy, self.observer, self._m)
        self._backoff = Backoff(first_s=retry_delay, cap_s=max_retry_delay)
        self._check_interval = check_interval
        self._on_change = on_change
        self._state = TrackerState()
        me = weakref.ref(self)  # the registry outlives trackers; it must not keep one alive
        self._m.track(lambda: tracker._state if (tracker := me()) is not None else _NO_STATE)
        self._status = TrackerStatus.STARTING
        self._was_ready = False
        self._seen_valid = False
        self._error: VersionRegressionError | None = None
        self._running = False
        self._stopped = False
        self._task: asyncio.Task[None] | None = None
        self._waker = asyncio.Event()
        self._feed = ChangeFeed(self._subject, max_pending_changes)
        self._cursor = ReplayCursor()
        self._waiters = 0
        self._freeze_heap = freeze_heap
        self._on_status = on_status
        self.deaf_reason: str | None = None
        """Why the tracker is deaf (the last subscription failure), else None."""

    # -- state -----------------------------------------------------------------------------------

    @property
    def current(self) -> int | None:
        """The current version; None only for a policy that never published one (filter off).

        Raises:
            TrackerNotReadyError: the tracker is starting, deaf, or the subject holds no valid event.
            VersionRegressionError: the tracker is in ``raise`` mode and saw a live regression.
        """
        if self._error is not None:
            raise self._error
        status = self._status
        if status in _READY or (status is TrackerStatus.STOPPED and self._was_ready):
            return self._state.version
        raise TrackerNotReadyError(self.policy, status.value, self.deaf_reason or "")

    @property
    def status(self) -> TrackerStatus:
        """What the tracker knows now (no raising)."""
        return self._status

    @property
    def state(self) -> TrackerState:
        """Everything known: version, owner, time of the last update (no raising)."""
        return self._state

    @property
    def epoch(self) -> int | None:
        """The owner's epoch."""
        return self._state.epoch

    @property
    def publisher(self) -> str | None:
        """The owner's trainer id."""
        return self._state.publisher

    @property
    def ready(self) -> bool:
        """Whether ``current`` is the bus's current state (``current`` or ``never_published``)."""
        return self._status in _READY

    @property
    def error(self) -> VersionRegressionError | None:
        """The regression that stopped a ``raise``-mode tracker, else None."""
        return self._error

    @property
    def seconds_since_update(self) -> float | None:
        """Seconds since the last accepted update was published (None before one); two clocks."""
        updated_at = self._state.updated_at
        return None if updated_at is None else max(0.0, time.time() - updated_at)

    def _set_status(self, status: TrackerStatus) -> None:
        if status is self._status:
            return
        self._status = status
        ready = status in _READY
        if ready and not self._was_ready and self._freeze_heap:
            freeze_startup_heap()
        self._was_ready = self._was_ready or ready
        self._m.set_ready(ready)
        if self._on_status is not None:
            self._on_status(status)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "tracker status", extra={"policy": self.policy, "status": status.value, "version": self._state.version}
            )
        self._wake()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> VersionTracker:
        """Run the follow loop as a task (idempotent); see ``wait_ready``."""
        if self._stopped:
            raise RuntimeError(f"the tracker of {self.policy!r} was stopped; create a new one")
        if self._task is None and not self._running:
            self._task = asyncio.create_task(self.run(), name=f"weightbus-tracker-{self.policy}")
            self._task.add_done_callback(_retrieve)
        return self

    async def aclose(self) -> None:
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
        await self.start()
        try:
            await self.wait_ready(self.ready_timeout)
        except TimeoutError:
            status, reason = self._status.value, self.deaf_reason
            await self.aclose()
            raise TrackerNotReadyError(
                self.policy, status, f"not ready within {self.ready_timeout:g}s" + (f" ({reason})" if reason else "")
            ) from None
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def run(self) -> None:
        """Follow the policy until cancelled or the bus closes.

        Raises:
            VersionRegressionError: ``raise`` mode saw a live lower version (also delivered to waiters).
        """
        self._running = True
        try:
            # Deliberate fault tolerance: a dead follower would freeze ``current`` silently, which is the failure
            # this class exists to prevent; a fresh subscription re-learns the version. Only a regression in
            # ``raise`` mode ends it. The waits grow for the tracker's life (a resubscription does not reset them).
            await retry_async(self._follow, self._backoff, retry_on=_not_regression, on_retry=self._lost)
            log.info("weights subscription ended", extra={"policy": self.policy})
        except VersionRegressionError as exc:
            self._error = exc
            self._feed.fail(exc)
            raise
        finally:
            self._running = False
            self._finish()

    def _lost(self, exc: Exception, attempt: int, wait: float) -> None:
        self.deaf_reason = repr(exc)
        self._set_status(TrackerStatus.DEAF)
        self._m.count_resubscribe()
        log.error(
            "weights subscription lost; the tracker is not ready until it is back",
            extra={
                "policy": self.policy,
                "error": repr(exc),
                "slow_consumer": isinstance(exc, SlowConsumerError),
                "retry_in": wait,
            },
        )

    async def _follow(self) -> None:
        cursor = self._cursor
        async with self._bus.subscribe(self._subject, deliver=Deliver.ALL, include_invalid=True) as sub:
            # The marks are read once the subscription holds its consumer (a read holds one too, for a while
            # after it ends: read first, a tracker retrying at the stream's consumer limit filled every free
            # slot with its own reads and never subscribed), and before the boundary: every version a mark
            # names was announced before it was read, so it is in what we replay.
            await self._high_water.load()
            subscribed_at = time.time()
            stored = await self._bus.last_seq(self._subject)
            handled = cursor.last_handled
            if cursor.subscribe(stored, subscribed_at):
                log.error(
                    "the weights stream was reset (purged or recreated); replaying it from its start",
                    extra={"policy": self.policy, "stored": stored, "handled": handled},
                )
            if cursor.empty:
                self._replayed()
                await self._check_high_water()
            if self._high_water.unreported:
                await self._high_water.report_unexplained()
            watchdog = SubscriptionWatchdog(self._bus, self._subject, cursor, self._check_interval, self._caught_up)
            # The health check runs beside the loop, so the per-event path pays no timer per event.
            watching = asyncio.create_task(watchdog.watch(sub), name=f"weightbus-tracker-watchdog-{self.policy}")
            try:
                async for item in sub:
                    cursor.arrived(item.seq)
                    if isinstance(item, Skipped):
                        self._advance(item.seq)
                    else:
                        await self._handle(item)
                    if self._high_water.unreported:
                        await self._high_water.report_unexplained()
                    if self._high_water.below(self._state.version):
                        await self._check_high_water()
            finally:
                watching.cancel()

    async def _check_high_water(self) -> None:
        """Once ready: a version held below the counter's high-water mark is a counter reset, reported once."""
        state = self._state
        if self.ready and self._high_water.below(state.version):
            await self._high_water.report(state.version, state.epoch, state.publisher)

    def _caught_up(self) -> None:
        if self._status is TrackerStatus.DEAF:
            self._replayed()

    def _finish(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._set_status(TrackerStatus.STOPPED)
        self._feed.close()
        self._wake()

    # -- waiting and iterating -------------------------------------------------------------------

    async def wait_ready(self, timeout: float | None = None) -> int | None:
        """Wait until the tracker is ready; return ``current`` (None: never published).

        Raises:
            TimeoutError: not ready within ``timeout`` seconds.
            VersionRegressionError: ``raise`` mode saw a regression.
            RuntimeError: the tracker was stopped.
        """
        await self._wait_until(lambda: self._status in _READY, timeout)
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
                self._waiters += 1
                try:
                    await self._waker.wait()
                finally:
                    self._waiters -= 1

    def _wake(self) -> None:
        if self._waiters:  # the per-event path allocates nothing when nobody waits
            self._waker.set()
            self._waker = asyncio.Event()

    def changes(self, *, include_regressions: bool = False) -> AsyncIterator[VersionChange]:
        """Iterate over version changes: the change that set the current version first (if known), then each one.

        Args:
            include_regressions: also yield events the tracker held or rejected (version unchanged).

        Raises:
            VersionRegressionError: ``raise`` mode saw a regression.
            SlowConsumerError: this iterator fell more than ``max_pending_changes`` behind.
        """
        return self._feed.follow(include_regressions)

    def latest_changes(self) -> AsyncIterator[VersionChange]:
        """Iterate over the newest state: the change that set the current version first (if known), then the newest
        change not yet read. It keeps one change, never a queue: a slow reader skips to the newest one and never
        gets ``SlowConsumerError`` (for a reader that wants the state, not every step: wake-ups, aborts, lags).

        Raises:
            VersionRegressionError: ``raise`` mode saw a regression.
        """
        return self._feed.latest()

    # -- the follow loop -------------------------------------------------------------------------

    def _replayed(self) -> None:
        """The history is replayed up to the boundary: settle the marks and the status from what was seen."""
        self._high_water.settle(self._state)
        self._alerts.summarise_replayed()
        if self._state.version is not None:
            self._set_status(TrackerStatus.CURRENT)
        elif self._seen_valid or self._cursor.empty:
            self._set_status(TrackerStatus.NEVER_PUBLISHED)
        else:
            self._set_status(TrackerStatus.NO_VALID_VERSION)
        self.deaf_reason = None if self.ready else self.deaf_reason

    def _advance(self, seq: int | None) -> None:
        if self._cursor.advance(seq) and self._status not in _READY:
            self._replayed()
        else:
            self._wake()

    async def _handle(self, env: Envelope) -> None:
        event = env.event
        seq = env.seq
        if not isinstance(event, WeightUpdated | PublisherClaimed | VersionReserved) or event.policy != self.policy:
            log.warning(
                "unexpected event on the weights subject; skipped",
                extra={"subject": env.subject, "policy": self.policy, "type": type(event).__name__},
            )
            self._advance(seq)
            return
        replayed = self._cursor.take(seq, event.published_at)
        if replayed is None:
            self._advance(seq)  # history already handled before a resubscribe
            return
        self._seen_valid = True
        cursor = self._cursor
        high_water = self._high_water
        high_water.before(seq, self._state)  # the marks stored before this event, judged by the chain so far
        decision = decide(self._state, event, self.mode, rebase=cursor.rebase, issued=high_water.issued)
        if cursor.rebase and isinstance(event, WeightUpdated) and decision.reason is None:
            cursor.rebase = False
        self._state = state = decision.state
        if decision.unverified_base:
            # Taken: refusing it would hold older weights as current (samples judged fresher than they are).
            self._m.count_unverified_base()
            assert isinstance(event, WeightUpdated) and event.artifact is not None
            log.warning(
                "delta taken whose base this tracker cannot check (it did not see that far back)",
                extra={"policy": self.policy, "version": event.version, "base": event.artifact.base, "seq": seq},
            )
        lag: float | None = None
        if not replayed:  # the history read at start is ages, not lags
            if is_replayed(env.headers):
                # Republished from a trace (weightbus replay): its published_at is the recorded one. The header
                # changes nothing but this; the chain judged the event above like any other.
                self._m.count_replayed()
            elif decision.is_update:
                lag = env.received_at - event.published_at
                if lag < 0:
                    lag = 0.0
                self._m.observe_lag(lag)
        if decision.alert:
            await self._alerts.raise_alert(decision, event, env, replayed, self._m)
        if decision.changed or decision.action in (TrackerAction.HELD, TrackerAction.REJECTED):
            self._emit(decision, event, env, lag, replayed)
        self._advance(seq)
        if self._status is TrackerStatus.NEVER_PUBLISHED and state.version is not None:
            self._set_status(TrackerStatus.CURRENT)
        elif self._status is TrackerStatus.NO_VALID_VERSION:
            self._replayed()
        if decision.action is TrackerAction.RAISED and not replayed:
            assert decision.previous.version is not None and decision.incoming is not None
            raise VersionRegressionError(self.policy, decision.previous.version, decision.incoming, event.trainer_id)

    def _emit(
        self,
        decision: TrackerDecision,
        event: WeightUpdated | PublisherClaimed | VersionReserved,
        env: Envelope,
        lag: float | None,
        replayed: bool,
    ) -> None:
        """Hand one change (or held/rejected event) to ``on_change`` and the iterators."""
        changed = decision.changed
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
            reason=decision.reason,
        )
        if changed:
            if self._on_change is not None:
                self._on_change(change)
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "weight version changed",
                    extra={"policy": self.policy, "action": decision.action.value, "version": change.version},
                )
        self._feed.push(change, changed)


def _retrieve(task: asyncio.Task[None]) -> None:
    # The error of a raise-mode tracker reaches users through ``current``, the waiters and the
    # iterators; reading it here keeps asyncio from reporting it as never retrieved.
    if not task.cancelled():
        task.exception()
