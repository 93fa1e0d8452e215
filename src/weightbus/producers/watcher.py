"""Keep a fleet caught up: poll each engine's label and catch up (``producers.catchup``) the ones behind the bus.

Invariants: each poll reads the weights history once (what trackers hold) and every engine's label; an engine is
caught up only when its label stands ``behind`` the announced version (``rules.catchup``); one whose catch-up to ``v``
failed for a reason a retry cannot fix (a bad or missing artifact) is not tried again until the bus announces another
version (the same files would fail the same way), so a bad artifact is alerted once, not once per poll; an engine
that does not answer (logged once when it stops answering), or whose catch-up failed for a retryable reason
(``CatchupEngineError``), is tried again at the next poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from weightbus.bus.protocol import Bus
from weightbus.errors import BusError, CatchupError, EngineError
from weightbus.producers.catchup import CatchupResult, catch_up
from weightbus.producers.fleet import EngineFleet
from weightbus.producers.metrics import CatchupMetrics
from weightbus.producers.status import read_weights_history
from weightbus.rules.catchup import label_standing

__all__ = ["FleetCatchup"]

log = logging.getLogger("weightbus.producers")


class FleetCatchup:
    """Catches up the engines of ``fleet`` that fall behind ``policy``'s announced version, every ``interval`` s.

    Args:
        bus: the bus (read, and where the catch-ups report).
        policy: the policy id.
        fleet: the engines (borrowed, not closed).
        interval: seconds between polls in ``run``.
        metrics: where each catch-up is counted, or None.
        observer: who catches up, recorded on the events (default: ``catch_up``'s).
        rounds: passed to each ``catch_up``.

    Raises:
        ValueError: ``interval`` is not positive.
    """

    def __init__(
        self,
        bus: Bus,
        policy: str,
        fleet: EngineFleet,
        *,
        interval: float = 5.0,
        metrics: CatchupMetrics | None = None,
        observer: str | None = None,
        rounds: int = 3,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        self.bus, self.policy, self.fleet, self.interval = bus, policy, fleet, interval
        self.metrics, self.observer, self.rounds = metrics, observer, rounds
        self.failed: dict[str, int] = {}
        """The engines whose last catch-up failed for good, and the version it was bringing them to."""
        self.unreachable: set[str] = set()
        """The engines whose label could not be read at the last poll (logged once each time one stops answering)."""

    async def poll_once(self) -> dict[str, CatchupResult | CatchupError]:
        """One poll: catch up every engine behind the announced version, concurrently; what each catch-up did.

        Raises:
            BusError: the history could not be read (or a catch-up's second read failed).
        """
        target = (await read_weights_history(self.bus, self.policy)).state.version
        if target is None:
            return {}
        labels = await self.fleet.read_versions()
        for url, label in labels.items():
            if isinstance(label, EngineError):
                if url not in self.unreachable:
                    self.unreachable.add(url)
                    log.warning(
                        "an engine's label cannot be read; it is not caught up until it answers",
                        extra={"policy": self.policy, "engine": url, "error": str(label)},
                    )
            elif url in self.unreachable:
                self.unreachable.discard(url)
                log.info("an engine answers again", extra={"policy": self.policy, "engine": url})
        behind = [
            client
            for client in self.fleet.clients
            if not isinstance(label := labels[client.url], EngineError)
            and label_standing(label, target) == "behind"
            and self.failed.get(client.url) != target
        ]
        if not behind:
            return {}
        outcomes = await asyncio.gather(
            *(
                catch_up(
                    self.bus, self.policy, client, observer=self.observer, metrics=self.metrics, rounds=self.rounds
                )
                for client in behind
            ),
            return_exceptions=True,
        )
        done: dict[str, CatchupResult | CatchupError] = {}
        for client, outcome in zip(behind, outcomes, strict=True):
            if isinstance(outcome, CatchupError):
                if not outcome.retryable:
                    self.failed[client.url] = target if outcome.version is None else outcome.version
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                self.failed.pop(client.url, None)
            done[client.url] = outcome
        return done

    async def results(self) -> AsyncIterator[dict[str, CatchupResult | CatchupError]]:
        """Poll every ``interval`` s until closed or cancelled, yielding each poll that caught up (or failed) engines.

        A bus that does not answer is logged and polled again at the next interval; a poll with nothing to do
        yields nothing.
        """
        while True:
            try:
                done = await self.poll_once()
            except BusError as exc:
                log.warning("catch-up poll failed; polling again", extra={"policy": self.policy, "error": str(exc)})
            else:
                if done:
                    yield done
            await asyncio.sleep(self.interval)

    async def run(self) -> None:
        """Poll until cancelled (``results``, its outcomes only logged and counted)."""
        async for _ in self.results():
            pass
