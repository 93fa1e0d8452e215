"""Drain reports: a drain's statistics as a ``DrainReport`` on ``weightbus.<policy>.drains``.

Ids are deterministic (a retry stores one event); ``submit`` never waits on the bus (a bounded queue, overflow
counted); a failed publish is in doubt and sent again after the next success; only one given up for good has failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from weightbus.bus import subjects
from weightbus.bus.protocol import Bus
from weightbus.consumers.drain.decisions import DrainStats
from weightbus.consumers.drain.metrics import DrainMetrics
from weightbus.errors import BusError
from weightbus.schemas.common import now
from weightbus.schemas.drains import DrainReport

__all__ = ["DrainReporter", "to_drain_report"]

log = logging.getLogger(__name__)


def to_drain_report(
    stats: DrainStats, *, policy: str, consumer: str, seq: int, published_at: float | None = None
) -> DrainReport:
    """Convert one drain's statistics into its wire event.

    Args:
        stats: the drain's statistics (``Drain.stats`` or ``Judgement.stats``).
        policy: the policy id.
        consumer: who drained (a rollout manager's id).
        seq: the consumer's drain counter.
        published_at: Unix time; now when None.
    """
    return DrainReport(
        policy=policy,
        consumer=consumer,
        seq=seq,
        current=stats.current,
        kept=stats.kept,
        recycled=stats.recycled,
        dropped=stats.dropped,
        published_at=now() if published_at is None else published_at,
        reasons=dict(stats.reasons),
        staleness_avg=stats.staleness_avg,
        staleness_max=stats.staleness_max,
        tracker_behind=stats.tracker_behind,
        queue_size=stats.queue_size,
        version_state=stats.version_state,
        tokens_generated=stats.tokens_generated,
        tokens_trained=stats.tokens_trained,
        tokens_not_trained=dict(stats.tokens_not_trained),
        early_aborts=stats.early_aborts,
        tokens_saved=stats.tokens_saved,
        in_flight_versions_avg=stats.in_flight_versions_avg,
        in_queue_versions_avg=stats.in_queue_versions_avg,
        in_flight_s_avg=stats.in_flight_s_avg,
        in_queue_s_avg=stats.in_queue_s_avg,
        by_length={outcome: dict(buckets) for outcome, buckets in stats.by_length.items()},
        by_reward={outcome: dict(buckets) for outcome, buckets in stats.by_reward.items()},
    )


class DrainReporter:
    """Publishes one ``DrainReport`` per drain through an injected ``Bus``.

    Args:
        bus: the bus (``NatsBus`` or ``MemoryBus``).
        policy: the policy id (validated here).
        consumer: this rollout manager's id; include something unique per process start (a boot id)
            if ``start_seq`` is not restored, or the bus may drop a restarted consumer's reports as
            duplicates of the previous run's.
        metrics: counts failed publishes in ``weightbus_drain_report_failures_total``.
        timeout: seconds a publish may take before it is given up (and counted as failed).
        start_seq: the last ``seq`` already published (the first report gets ``start_seq + 1``).
        max_queued: reports ``submit`` may hold while the bus is slow or away.

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
    """

    def __init__(
        self,
        bus: Bus,
        policy: str,
        consumer: str,
        *,
        metrics: DrainMetrics | None = None,
        timeout: float = 2.0,
        start_seq: int = 0,
        max_queued: int = 256,
    ) -> None:
        self.bus = bus
        self.policy = policy
        self.consumer = consumer
        self.subject = subjects.drains(policy)
        self.metrics = metrics
        self.timeout = timeout
        self.seq = start_seq
        self.failures = 0
        """Reports given up for good (see the module): not stored, as far as this reporter knows."""
        self.dropped = 0
        self.max_queued = max_queued
        self._queue: asyncio.Queue[DrainReport] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._doubtful: deque[DrainReport] = deque()  # failed background publishes, maybe stored later
        self._sending: DrainReport | None = None

    @property
    def in_doubt(self) -> int:
        """Background reports whose publish failed and that will be published again."""
        return len(self._doubtful)

    def submit(self, stats: DrainStats) -> bool:
        """Queue the report of one drain for the background publisher; never waits, never raises for the bus.

        Returns:
            False when the queue was full and the report was dropped (counted).
        """
        self.seq += 1
        event = to_drain_report(stats, policy=self.policy, consumer=self.consumer, seq=self.seq)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._drop(event, "submitted outside the event loop")
            return False
        if self._queue is None:
            self._queue = asyncio.Queue(self.max_queued)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain_queue(), name="weightbus-drain-reports")
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self._drop(event, "queue full")
            return False
        return True

    def _drop(self, event: DrainReport, why: str) -> None:
        self.dropped += 1
        if self.metrics is not None:
            self.metrics.report_dropped()
        log.warning("drain report dropped: %s", why, extra={"policy": self.policy, "seq": event.seq})

    async def _drain_queue(self) -> None:
        assert self._queue is not None
        while True:
            event = await self._queue.get()
            self._sending = event
            try:
                stored = await self._attempt(event)
                self._sending = None
                if stored:
                    await self._settle()
                else:
                    self._doubtful.append(event)
                    if len(self._doubtful) > self.max_queued:
                        self._give_up(self._doubtful.popleft())
            finally:
                self._queue.task_done()

    async def _settle(self) -> None:
        """The bus answers again: publish the reports in doubt once more, oldest first."""
        while self._doubtful:
            if not await self._attempt(self._doubtful[0]):
                return
            self._doubtful.popleft()

    def _give_up(self, event: DrainReport) -> None:
        self.failures += 1
        if self.metrics is not None:
            self.metrics.report_failed()
        log.warning("drain report %s given up", self._msg_id(event), extra={"policy": self.policy, "seq": event.seq})

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every submitted report was published or given up (bounded by ``timeout``).

        Reports still in doubt are given up here (counted in ``failures``).
        """
        if self._queue is not None and self._worker is not None and not self._worker.done():
            async with asyncio.timeout(timeout):
                await self._queue.join()
        while self._doubtful:
            self._give_up(self._doubtful.popleft())

    async def aclose(self, timeout: float = 5.0) -> None:
        """Flush what is queued (up to ``timeout`` seconds), then stop the background publisher; what is
        left is given up (counted in ``failures``)."""
        try:
            await self.flush(timeout)
        except TimeoutError:
            log.warning("drain reports still queued at close", extra={"policy": self.policy})
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
        # What is still being sent, queued or in doubt now is given up for good.
        if self._sending is not None:  # cancelled in the middle of its publish
            self._doubtful.append(self._sending)
            self._sending = None
        while self._queue is not None and not self._queue.empty():
            self._doubtful.append(self._queue.get_nowait())
            self._queue.task_done()
        while self._doubtful:
            self._give_up(self._doubtful.popleft())

    async def report(self, stats: DrainStats) -> bool:
        """Publish the report of one drain now, waiting for the bus; never raises for a bus failure.

        Returns:
            True if the bus confirmed the report (a duplicate counts as confirmed).
        """
        self.seq += 1
        event = to_drain_report(stats, policy=self.policy, consumer=self.consumer, seq=self.seq)
        if await self._attempt(event):
            return True
        self._give_up(event)  # the caller waited for the answer: nothing retries it
        return False

    def _msg_id(self, event: DrainReport) -> str:
        return f"{self.policy}:drain:{self.consumer}:{event.seq}"

    async def _attempt(self, event: DrainReport) -> bool:
        msg_id = self._msg_id(event)
        try:
            async with asyncio.timeout(self.timeout):
                await self.bus.publish(self.subject, event, msg_id=msg_id)
        except (BusError, TimeoutError) as exc:
            log.warning("drain report %s on %s not published: %s", msg_id, self.subject, exc or type(exc).__name__)
            return False
        return True
