"""The tracker's check against the counter's high-water mark: marks judged by the shared rule, resets reported.

Marks are read once per subscription, before the boundary; an unexplained one is alerted once, never credited; a
held version below the credited ``announced`` is a counter reset; marks that cannot be read never make it deaf.
"""

from __future__ import annotations

import logging

from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.protocol import Bus
from weightbus.consumers.tracker.metrics import PolicyTrackerMetrics
from weightbus.errors import BusError
from weightbus.rules.chain import TrackerState
from weightbus.rules.marks import MarkJudge, UnexplainedMark, unexplained_mark_alert, unexplained_mark_alert_id
from weightbus.schemas.alerts import VersionRejected
from weightbus.schemas.common import now
from weightbus.schemas.weights import CounterHighWater

__all__ = ["HighWaterWatch"]

log = logging.getLogger("weightbus.consumers")


class HighWaterWatch:
    """Judges a policy's counter marks and reports unexplained marks and counter resets; see the module docstring."""

    def __init__(self, bus: Bus, policy: str, observer: str, metrics: PolicyTrackerMetrics) -> None:
        self._bus = bus
        self._policy = policy
        self._observer = observer
        self._m = metrics
        self._judge = MarkJudge(policy)
        self._reported_marks = 0  # how many of the judge's refusals were reported
        self._reported: set[int | None] = set()
        self._retained: set[tuple[str, int | None, int | None]] | None = None

    @property
    def issued(self) -> int | None:
        """The highest number the credited mark says was issued (reserved or announced); None without one."""
        return self._judge.issued

    @property
    def mark(self) -> CounterHighWater | None:
        """The credited mark (None: none stored, none explained, or unreadable)."""
        return self._judge.mark

    @property
    def unreported(self) -> bool:
        """Whether unexplained marks wait to be reported."""
        return len(self._judge.unexplained) > self._reported_marks

    async def load(self) -> None:
        """Read the counter subject's retained marks; a failure is logged, never raised."""
        try:
            stored = await read_subject_history(self._bus, subjects.counter(self._policy))
        except BusError as exc:
            # Not raised: marks that cannot be read never make the tracker deaf. Loud instead: the gauge stays 1
            # until a read succeeds (the next subscribe), since a counter reset goes unreported until then.
            self._m.set_marks_unread(True)
            log.warning(
                "could not read the counter's high-water marks; following with those judged before",
                extra={"policy": self._policy, "error": repr(exc)},
            )
            return
        self._m.set_marks_unread(False)
        self._judge.load(self._policy, stored.events)

    def before(self, seq: int | None, state: TrackerState) -> None:
        """Judge the marks stored before the event at ``seq`` against ``state`` (cheap when none wait)."""
        if self._judge.pending:
            self._judge.before(seq, state)

    def settle(self, state: TrackerState) -> None:
        """The replay is over: judge the marks stored after the last event against ``state``."""
        if self._judge.pending:
            self._judge.settle(state)

    def below(self, version: int | None) -> bool:
        """Whether holding ``version`` contradicts the credited mark and was not reported yet (cheap; per event)."""
        if self._judge.pending:
            return False  # judged once the replay reaches them
        floor = self._judge.announced
        return floor is not None and (version is None or version < floor) and version not in self._reported

    async def report_unexplained(self) -> None:
        """Count, log and (once per mark, fleet-wide) alert each unexplained mark not reported yet."""
        refused = self._judge.unexplained
        while self._reported_marks < len(refused):
            item = refused[self._reported_marks]
            self._reported_marks += 1
            await self._report_one(item)

    async def _report_one(self, item: UnexplainedMark) -> None:
        mark = item.mark
        self._m.count_rejected("unexplained_mark")
        log.error(
            "the counter's high-water mark says more was issued than the weights chain explains "
            "(an unexplained mark); ignored",
            extra={
                "policy": self._policy,
                "mark": mark.version,
                "announced": mark.announced,
                "mark_seq": item.seq,
                "chain_seen": item.seen,
                "superseded": item.seen is None,
                "writer": mark.trainer_id,
            },
        )
        if await self._already_alerted("unexplained_mark", item.seq, None):
            return
        alert = unexplained_mark_alert(self._policy, item, observer=self._observer, published_at=now())
        await self._publish(alert, unexplained_mark_alert_id(self._policy, item.seq), None)

    async def report(self, version: int | None, epoch: int | None, publisher: str | None) -> None:
        """Count, log and (once per held version and mark) alert the counter reset."""
        mark = self._judge.mark
        seq = self._judge.mark_seq
        assert mark is not None and mark.announced is not None
        self._reported.add(version)
        self._m.count_rejected("counter_reset")
        log.error(
            "the tracker holds a version below what the counter's high-water mark says was announced: "
            "the weights history was lost or overwritten (counter reset)",
            extra={
                "policy": self._policy,
                "current": version,
                "announced": mark.announced,
                "mark": mark.version,
                "mark_seq": seq,
                "owner_epoch": epoch,
                "owner": publisher,
            },
        )
        if await self._already_alerted("counter_reset", seq, version):
            return
        alert = VersionRejected(
            policy=self._policy,
            reason="counter_reset",
            event_type="CounterHighWater",
            current=version,
            incoming=mark.announced,
            incoming_epoch=mark.epoch,
            publisher=mark.trainer_id,
            observer=self._observer,
            published_at=now(),
            event_seq=seq,
        )
        await self._publish(alert, f"{self._policy}:alert:counter_reset:{seq}:{version}", version)

    async def _publish(self, alert: VersionRejected, msg_id: str, version: int | None) -> None:
        try:
            await self._bus.publish(subjects.alerts(self._policy), alert, msg_id=msg_id)
        except BusError as exc:
            log.error(
                "could not publish the counter mark alert",
                extra={"policy": self._policy, "reason": alert.reason, "error": repr(exc)},
            )
            return
        if self._retained is not None:
            self._retained.add((alert.reason, alert.event_seq, version))

    async def _already_alerted(self, reason: str, seq: int | None, version: int | None) -> bool:
        if self._retained is None:
            try:
                history = await read_subject_history(self._bus, subjects.alerts(self._policy))
            except BusError as exc:
                log.warning("could not read retained alerts; alerting anyway", extra={"error": repr(exc)})
                return False
            self._retained = {
                (e.event.reason, e.event.event_seq, e.event.current if e.event.reason == "counter_reset" else None)
                for e in history.events
                if isinstance(e.event, VersionRejected)
                and e.event.reason in ("counter_reset", "unexplained_mark")
                and e.event.event_type == "CounterHighWater"
            }
        return (reason, seq, version) in self._retained
