"""A drop-in's Prometheus metrics: one registry per process, served on the port a half asks for.

One ``CollectorRegistry`` per process (never prometheus-client's global one), each family registered on it once
(``process_metrics``), every policy a label, so any number of buffers and cells share it. One server per port
(``serve``): the buffers and cells that ask for the same port share it, and it is closed when the last of them
lets go. A port that cannot be bound is an error line and the run goes on without it: metrics never stop training.
Hosts' ports and flags: docs/integrations/miles.md#metrics.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from weightbus.bus.metrics import BusMetrics, MetricsServer, serve_metrics
from weightbus.consumers.admission.metrics import AdmissionMetrics
from weightbus.consumers.drain.metrics import StalenessMetrics
from weightbus.consumers.tracker.metrics import TrackerMetrics

__all__ = ["MetricsLease", "IntegrationMetrics", "process_metrics", "serve", "serving"]

log = logging.getLogger("weightbus.integrations")


@dataclass(frozen=True, slots=True)
class IntegrationMetrics:
    """Every metric family the integration exports, on one registry (``process_metrics``).

    Attributes:
        registry: the process' registry, the one its ports serve.
        bus: invalid payloads on every connection the integration opens (both halves).
        tracker: the buffers' version trackers (``weightbus_current_version``, ``weightbus_tracker_ready``, ...).
        drain: the buffers' drains (``weightbus_groups_total``, ``weightbus_group_staleness``, ...).
        admission: the shared admission budget (``weightbus_admission_*``).
    """

    registry: CollectorRegistry
    bus: BusMetrics
    tracker: TrackerMetrics
    drain: StalenessMetrics
    admission: AdmissionMetrics

    @classmethod
    def on(cls, registry: CollectorRegistry) -> IntegrationMetrics:
        """Register every family on ``registry`` (once per registry: a second time raises ``ValueError``)."""
        return cls(
            registry=registry,
            bus=BusMetrics(registry),
            tracker=TrackerMetrics(registry),
            drain=StalenessMetrics(registry),
            admission=AdmissionMetrics(registry),
        )


@dataclass(slots=True)
class _Served:
    server: MetricsServer
    holders: set[MetricsLease] = field(default_factory=set)


_lock = threading.Lock()  # the trainer's cells live on threads, the buffers on the RolloutManager's loop
_metrics: IntegrationMetrics | None = None
_served: dict[int, _Served] = {}


def process_metrics() -> IntegrationMetrics:
    """This process' metrics, registered on its registry the first time they are asked for."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = IntegrationMetrics.on(CollectorRegistry())
        return _metrics


class MetricsLease:
    """One buffer's or cell's hold on the server of its port (``serve``); ``release()`` lets go (idempotent)."""

    __slots__ = ("_released", "port", "url")

    def __init__(self, port: int, url: str) -> None:
        self.port = port
        self.url = url
        self._released = False

    def release(self) -> None:
        """Let go of the server: the last holder of a port closes it (blocks until it has stopped, < 1 s)."""
        with _lock:
            if self._released:
                return
            self._released = True
            served = _served.get(self.port)
            if served is None:
                return
            served.holders.discard(self)
            if served.holders:
                return
            del _served[self.port]
            # Closed under the lock: a new holder of the port then binds it after it is free, not before.
            served.server.close()


def serve(address: tuple[str, int], who: str) -> MetricsLease | None:
    """Serve this process' registry on ``address`` (``(host, port)``), or join the server already on that port.

    Args:
        address: where (``config.metrics_address``).
        who: names the half in the log lines (``"rollout"``, ``"trainer"``).

    Returns:
        The lease to release when the caller closes, or None when the address cannot be bound (logged as
        an error: the run goes on without the endpoint).
    """
    host, port = address
    registry = process_metrics().registry
    with _lock:
        served = _served.get(port)
        if served is None:
            try:
                server = serve_metrics(port, registry, host)
            except (OSError, OverflowError, ValueError) as exc:
                reason = (exc.strerror or exc) if isinstance(exc, OSError) else exc
                log.error(
                    "cannot serve weightbus' %s metrics on %s:%d: %s; the run goes on without them",
                    who,
                    host,
                    port,
                    reason,
                    extra={"host": host, "port": port},
                )
                return None
            served = _served[port] = _Served(server)
            log.info("metrics served", extra={"url": server.url, "half": who})
        elif served.server.host != host:
            log.warning(
                "weightbus' %s metrics share port %d with this process' server on %s (asked for %s)",
                who,
                port,
                served.server.host,
                host,
                extra={"port": port},
            )
        lease = MetricsLease(port, served.server.url)
        served.holders.add(lease)
        return lease


def serving() -> list[str]:
    """The URLs this process serves its metrics on now, by port."""
    with _lock:
        return [_served[port].server.url for port in sorted(_served)]
