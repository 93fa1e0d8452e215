"""``Cell``: rank 0's publisher for one host weight updater, and its fleet over the engines the host connected.

One publisher per claim of the policy's counter. Every path checks ownership (``check_owner``) before
it touches anything shared; a cell that was fenced claims again only if the host picked it again (its
standing outranks the owner's, ``Runtime.standing``), else the ``FencedError`` stands and it never
touches the owner's engines. Taking a number (``enter``) and the ownership read are retried while the
bus does not answer, for at most ``WEIGHTBUS_UPDATE_TIMEOUT`` seconds; nothing is paused or pushed meanwhile.
With ``WEIGHTBUS_TRAINER_METRICS_PORT`` set, a cell's connections count on the process' registry, served there
(``integrations.host.metrics``) until ``close``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from weightbus.backoff import Backoff, retry_sync
from weightbus.bus.identity import process_identity
from weightbus.bus.protocol import Bus
from weightbus.errors import (
    BusError,
    FencedError,
)
from weightbus.integrations.host.engines import HandleFleet
from weightbus.integrations.host.identity import Host
from weightbus.integrations.host.metrics import MetricsLease, process_metrics, serve
from weightbus.integrations.host.plan import Plan
from weightbus.integrations.host.proxies import real_handle
from weightbus.integrations.host.runtime import Runtime
from weightbus.integrations.host.settings import DropInSettings
from weightbus.producers.sync import SyncUpdate, SyncVersionPublisher

__all__ = ["Cell", "FleetHolder"]

_T = TypeVar("_T")


class FleetHolder:
    """A cell's fleet, built on the publisher's loop from the handles the host connected."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.fleet: HandleFleet | None = None
        self.handles: list[Any] = []
        self.ray_get: Callable[[Any], Any] | None = None

    async def build(self) -> HandleFleet:
        assert self.ray_get is not None
        self.fleet = await HandleFleet.build(self.handles, self.ray_get, reach=self.host.reach, host=self.host.name)
        return self.fleet


class Cell:
    """Rank 0's publisher for one weight updater, and its fleet over the host's engines.

    One publisher per claim: a cell that was fenced and that the host picked again (its standing, see
    ``Runtime.standing``, outranks the owner's claim) claims again with a new publisher; one that
    the host did not pick stays fenced.
    """

    def __init__(self, host: Host, settings: DropInSettings, args: Any) -> None:
        self.host = host
        self.settings = settings
        self.args = args
        self._holder = FleetHolder(host)
        self.publisher = self._publisher(self._holder)
        address = settings.trainer_metrics
        self._served: MetricsLease | None = serve(address, "trainer") if address is not None else None

    def close(self) -> None:
        """Close the publisher (its bus connection and private loop) and let go of the metrics server."""
        try:
            self.publisher.close()
        finally:
            served, self._served = self._served, None
            if served is not None:
                served.release()

    def _publisher(self, holder: FleetHolder) -> SyncVersionPublisher:
        s = self.settings
        return SyncVersionPublisher(
            s.policy,
            nats_url=None if s.trainer_metrics is not None else s.nats,
            bus_factory=self._connect if s.trainer_metrics is not None else None,
            trainer_id=s.trainer_id or process_identity(self.host.name),
            pause=getattr(self.args, "pause_generation_mode", None) or self.host.pause,
            connect_timeout=s.connect_timeout,
            floor=s.floor,
            options=s.options,
            fleet_factory=holder.build,
        )

    async def _connect(self) -> Bus:
        """The publisher's connection, counting invalid payloads on the process' registry (a served port)."""
        from weightbus.bus.nats import connect

        s = self.settings
        return await connect(
            s.nats,
            name="weightbus-trainer",
            connect_timeout=s.connect_timeout,
            options=s.options,
            metrics=process_metrics().bus,
        )

    def _point(self, holder: FleetHolder, updater: Any, runtime: Runtime) -> None:
        handles = getattr(updater, "rollout_engines", None)
        if handles is None:
            raise RuntimeError(
                f"{type(updater).__name__}.rollout_engines is not set: {self.host.name} connects its engines "
                "(connect_rollout_engines) before update_weights"
            )
        more = getattr(updater, "distributed_rollout_engines", None) or ()
        # Inside the host's update (the disk delta enters at its pause) the updater holds our proxies.
        holder.handles = [real_handle(h) for h in (*handles, *more)]
        holder.ray_get = runtime.ray_get

    def ready(self, updater: Any, runtime: Runtime) -> SyncVersionPublisher:
        """The publisher, started (claimed) and pointed at the engines the host connected now."""
        holder = self._holder
        self._point(holder, updater, runtime)
        pub = self.publisher
        if not pub.state.started:
            pub.start(standing=runtime.standing())
        elif holder.fleet is not None:
            fleet, given, ray_get = holder.fleet, holder.handles, runtime.ray_get
            pub.call(lambda _: fleet.retarget(given, ray_get))
        return pub

    def check_owner(self, updater: Any, runtime: Runtime) -> None:
        """Own the counter or raise ``FencedError`` (``owned``: fenced, or claimed again); retried while the bus is out.

        The one check every path makes before it touches anything shared (the disk delta's before the host
        writes a file and before the first pull, ``enter``'s before the pause), so a cell the host picked
        again after another took the counter claims again wherever it first looks, and a zombie stays
        fenced wherever it first looks.

        Raises:
            FencedError: fenced, and the host did not pick this cell after the owner.
        """
        self._retrying(lambda: self.owned(updater, runtime), "reading the bus", "nothing was written or pushed")

    def _retrying(self, attempt: Callable[[], _T], doing: str, untouched: str) -> _T:
        timeout = self.settings.update_timeout if self.settings.update_timeout is not None else self.host.update_timeout

        def warn(exc: Exception, _attempt: int, wait: float) -> None:
            self.host.log.warning(
                f"the bus did not answer while {doing}; retrying (nothing is written or pushed meanwhile)",
                extra={"policy": self.settings.policy, "error": str(exc), "retry_in": wait},
            )

        try:
            # The bus only: an engine's failure fails the host's update, as it would without weightbus.
            return retry_sync(
                attempt,
                Backoff(first_s=0.2, cap_s=5.0, deadline_s=timeout),
                retry_on=_bus_retryable,
                clock=time.monotonic,
                sleep=time.sleep,
                on_retry=warn,
            )
        except BusError as exc:
            if exc.retryable:
                exc.add_note(
                    f"weightbus gave up {doing} after {timeout or 0:g}s (WEIGHTBUS_UPDATE_TIMEOUT); {untouched}"
                )
            else:
                exc.add_note(f"weightbus does not retry {doing} after a {type(exc).__name__}; {untouched}")
            raise

    def owned(self, updater: Any, runtime: Runtime) -> SyncVersionPublisher:
        """``ready``, and the counter's owner: claimed again if the host picked this cell after the owner.

        One read of the weights subject first (before anything pauses the owner's engines). A fenced
        cell claims again only through ``start(outrank=True)``: the bus's history, read by the claim
        it is conditional on, must show an owner whose standing this cell's outranks (the same Ray
        job, a later quorum or a later alive rank of the same one). Otherwise the ``FencedError``
        stands: a zombie never touches the owner's engines.

        Raises:
            FencedError: fenced, and the host did not pick this cell after the owner.
        """
        pub = self.ready(updater, runtime)
        try:
            pub.call(lambda p: p.check_owner())
        except FencedError as fenced:
            return self._claim_again(updater, runtime, fenced)
        return pub

    def _claim_again(self, updater: Any, runtime: Runtime, fenced: FencedError) -> SyncVersionPublisher:
        standing = runtime.standing()
        if standing is None:
            fenced.add_note(
                f"{self.host.name} says nothing of this cell's standing (quorum id, alive rank): it stays fenced"
            )
            raise fenced
        try:  # reads only: a cell the host did not pick learns it without touching an engine
            self.publisher.call(lambda p: p.check_outranks(standing))
        except FencedError as refused:
            refused.add_note(f"this cell stays fenced since {fenced}")
            raise refused from None
        holder = FleetHolder(self.host)
        self._point(holder, updater, runtime)
        fresh = self._publisher(holder)
        try:
            fresh.start(standing=standing, outrank=True)  # a failed start closes ``fresh``
        except FencedError as refused:
            refused.add_note(f"this cell stays fenced since {fenced}")
            raise refused from None
        old, self.publisher, self._holder = self.publisher, fresh, holder
        old.close()
        self.host.log.warning(
            f"{self.host.name} picked this cell again after another took the counter: claimed it again",
            extra={
                "policy": self.settings.policy,
                "quorum": standing.term,
                "alive_rank": standing.rank,
                "epoch": fresh.state.epoch,
                "fenced_by": fenced.owner,
            },
        )
        return fresh

    def enter(self, updater: Any, runtime: Runtime, plan: Plan) -> SyncUpdate:
        """Take the number, pause, read the labels, mark them pending: retried while the bus does not answer."""

        def attempt() -> SyncUpdate:
            # A cell that lost the counter raises here, before it pauses the owner's engines, unless
            # the host picked it again after the owner (then it claims again); the take checks again.
            pub = self.owned(updater, runtime)
            update = pub.update(lora=plan.lora, push=plan.push, labels=plan.labels)
            update.begin()  # its end (commit or abort) runs in the same task on the publisher's loop
            return update

        return self._retrying(attempt, "taking a version", "nothing was pushed")


def _bus_retryable(exc: Exception) -> bool:
    return isinstance(exc, BusError) and exc.retryable
