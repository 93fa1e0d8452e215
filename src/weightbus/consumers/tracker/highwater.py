"""The tracker's check against the counter's high-water mark: a version held below it is a counter reset.

The owner writes ``CounterHighWater`` on ``weightbus.<policy>.counter`` after each announcement; its
``announced`` is a version that was announced and acknowledged. The weights subject keeps 256
events, so enough writes there (a rogue's, a replayed trace) evict the real history and a tracker
that starts afterwards would adopt whatever is left, silently. Invariants:

* the mark is read once per subscription, before the weights subject's boundary is read, so every
  announcement it names was stored before the history the tracker replays;
* once the tracker is ready, holding a version below the mark's ``announced`` (or no version at all)
  is reported as a counter reset: counted (``weightbus_events_rejected_total{reason="counter_reset"}``),
  logged at ERROR and alerted as ``VersionRejected(reason="counter_reset", event_type="CounterHighWater")``,
  once per held version; the alert's id derives from the mark and the held version, so a fleet of
  trackers stores one, and a restarted tracker does not publish it again while it is retained;
* a mark that cannot be read is logged and the tracker follows without it: never deaf for it.
"""

from __future__ import annotations

import logging

from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.marks import read_high_water
from weightbus.bus.protocol import Bus
from weightbus.consumers.tracker.metrics import PolicyTrackerMetrics
from weightbus.errors import BusError
from weightbus.schemas.alerts import VersionRejected
from weightbus.schemas.common import now
from weightbus.schemas.weights import CounterHighWater

__all__ = ["HighWaterWatch"]

log = logging.getLogger("weightbus.consumers")


class HighWaterWatch:
    """Reads a policy's counter mark and reports a held version below it; see the module docstring."""

    def __init__(self, bus: Bus, policy: str, observer: str, metrics: PolicyTrackerMetrics) -> None:
        self._bus = bus
        self._policy = policy
        self._observer = observer
        self._m = metrics
        self._floor: int | None = None  # the mark's ``announced``: no ready tracker may hold less
        self._mark: CounterHighWater | None = None
        self._seq: int | None = None
        self._reported: set[int | None] = set()
        self._retained: set[tuple[int | None, int | None]] | None = None

    @property
    def issued(self) -> int | None:
        """The highest number the mark says was issued (reserved or announced); None without a mark."""
        mark = self._mark
        return None if mark is None else mark.version

    @property
    def mark(self) -> CounterHighWater | None:
        """The mark read at the last subscription (None: none stored, or unreadable)."""
        return self._mark

    async def load(self) -> None:
        """One last-message read of the counter subject; a failure is logged, never raised."""
        try:
            stored = await read_high_water(self._bus, self._policy)
        except BusError as exc:
            log.warning(
                "could not read the counter's high-water mark; following without it",
                extra={"policy": self._policy, "error": repr(exc)},
            )
            return
        if stored.mark is not None:
            self._mark, self._seq, self._floor = stored.mark, stored.seq, stored.mark.announced

    def below(self, version: int | None) -> bool:
        """Whether holding ``version`` contradicts the mark and was not reported yet (cheap; per event)."""
        floor = self._floor
        return floor is not None and (version is None or version < floor) and version not in self._reported

    async def report(self, version: int | None, epoch: int | None, publisher: str | None) -> None:
        """Count, log and (once per held version and mark) alert the counter reset."""
        mark = self._mark
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
                "mark_seq": self._seq,
                "owner_epoch": epoch,
                "owner": publisher,
            },
        )
        if await self._already_alerted(version):
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
            event_seq=self._seq,
        )
        msg_id = f"{self._policy}:alert:counter_reset:{self._seq}:{version}"
        try:
            await self._bus.publish(subjects.alerts(self._policy), alert, msg_id=msg_id)
        except BusError as exc:
            log.error("could not publish the counter-reset alert", extra={"policy": self._policy, "error": repr(exc)})
            return
        if self._retained is not None:
            self._retained.add((self._seq, version))

    async def _already_alerted(self, version: int | None) -> bool:
        if self._retained is None:
            try:
                history = await read_subject_history(self._bus, subjects.alerts(self._policy))
            except BusError as exc:
                log.warning("could not read retained alerts; alerting anyway", extra={"error": repr(exc)})
                return False
            self._retained = {
                (e.event.event_seq, e.event.current)
                for e in history.events
                if isinstance(e.event, VersionRejected)
                and e.event.reason == "counter_reset"
                and e.event.event_type == "CounterHighWater"
            }
        return (self._seq, version) in self._retained
