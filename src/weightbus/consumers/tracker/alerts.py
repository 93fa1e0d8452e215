"""The alerts a ``VersionTracker`` publishes: once per offending event, never again on a restart.

An alert's id derives from the offending event; a replayed event is alerted only if none is retained for it.
"""

from __future__ import annotations

import logging

from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.protocol import Bus, Envelope
from weightbus.consumers.tracker.metrics import PolicyTrackerMetrics
from weightbus.errors import BusError
from weightbus.rules.chain import RegressionMode, TrackerDecision, WeightsEvent
from weightbus.schemas.alerts import VersionRegressed, VersionRejected
from weightbus.schemas.common import now

__all__ = ["TrackerAlerts"]

log = logging.getLogger("weightbus.consumers")


class TrackerAlerts:
    """Publishes a tracker's ``VersionRegressed`` and ``VersionRejected`` alerts; see the module docstring."""

    def __init__(self, bus: Bus, policy: str, observer: str, mode: RegressionMode) -> None:
        self._bus = bus
        self._policy = policy
        self._observer = observer
        self._mode = mode
        self._subject = subjects.alerts(policy)
        self._retained: set[int] | None = None
        self._known: list[int] = []

    async def raise_alert(
        self, decision: TrackerDecision, event: WeightsEvent, env: Envelope, replayed: bool, m: PolicyTrackerMetrics
    ) -> None:
        """Count, log and (once per event) publish the alert ``decision`` calls for."""
        current = decision.previous.version
        facts = {
            "policy": self._policy,
            "current": current,
            "incoming": decision.incoming,
            "incoming_epoch": event.epoch,
            "publisher": event.trainer_id,
            "seq": env.seq,
            "replayed": replayed,
        }
        alert: VersionRegressed | VersionRejected
        known = replayed and env.seq is not None and await self._already_alerted(env.seq)
        if decision.is_regression:
            m.count_regression()
            if not known:
                log.error("weight version went backwards", extra={**facts, "mode": self._mode.value})
            assert current is not None and decision.incoming is not None
            alert = VersionRegressed(
                policy=self._policy,
                current=current,
                incoming=decision.incoming,
                incoming_epoch=event.epoch,
                publisher=event.trainer_id,
                action=self._mode.value,
                observer=self._observer,
                published_at=now(),
                event_seq=env.seq,
            )
        else:
            assert decision.reason is not None
            m.count_rejected(decision.reason)
            if not known:
                log.error("weights event not accepted", extra={**facts, "reason": decision.reason})
            alert = VersionRejected(
                policy=self._policy,
                reason=decision.reason,
                event_type=type(event).__name__,
                current=current,
                incoming=decision.incoming,
                incoming_epoch=event.epoch,
                publisher=event.trainer_id,
                observer=self._observer,
                published_at=now(),
                event_seq=env.seq,
            )
        if known:
            assert env.seq is not None
            self._known.append(env.seq)
            return
        msg_id = f"{self._policy}:alert:{env.seq}:{env.headers.get('Nats-Msg-Id', '')}"
        try:
            await self._bus.publish(self._subject, alert, msg_id=msg_id)
        except BusError as exc:
            log.error("could not publish the alert", extra={**facts, "error": repr(exc)})
            return
        if self._retained is not None and env.seq is not None:
            self._retained.add(env.seq)

    def summarise_replayed(self) -> None:
        """Log, at INFO and once, the replayed incidents that were alerted already (nothing if none)."""
        if not self._known:
            return
        log.info(
            "weights events in the retained history were alerted already; not alerting them again",
            extra={"policy": self._policy, "incidents": len(self._known), "seqs": self._known[:20]},
        )
        self._known = []

    async def _already_alerted(self, seq: int) -> bool:
        if self._retained is None:
            try:
                history = await read_subject_history(self._bus, self._subject)
            except BusError as exc:
                log.warning("could not read retained alerts; alerting anyway", extra={"error": repr(exc)})
                return False
            self._retained = {
                e.event.event_seq
                for e in history.events
                if isinstance(e.event, VersionRegressed | VersionRejected) and e.event.event_seq is not None
            }
        return seq in self._retained
