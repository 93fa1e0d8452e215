"""What every host's rollout half stands on: its bus, its tracker, its drain reporter, its admission, in one order.

A rollout half (miles' data buffer, slime's rollout session) judges its host's groups with the drain engine and
paces them with the ``Admission`` gate; ``RolloutSetup`` owns what surrounds both, so that a host module only
translates its host's contract. ``start`` connects the bus (unless one was given), starts a ``VersionTracker``
named by the half's consumer id on the process' metrics, and hands a ``DrainReporter`` to the drain window;
``admission`` makes the gate and the shared budget the settings ask for; ``aclose`` undoes it all in the reverse
order.

Invariants:

* the connect settings (URL, credentials, TLS, timeout) are ``ConnectSettings``: ``args.weightbus_<name>``, else
  the variable, the same for every host; they are read when the bus connects;
* ``tracker`` is None until the tracker is started (and, when the host waits for it, ready or timed out), and
  again after ``aclose``;
* a bus that was given is the caller's and is never closed here; one connected here is closed by ``aclose``;
* teardown order: the shared budget's slots are returned while the bus is up, the window's reporter is detached
  before its pending reports are published (no window finished meanwhile is reported to a closed one), the
  tracker stops, then the bus closes, then the metrics port is let go, off the loop (a server stops within its
  poll interval); ``aclose`` is idempotent, and the setup can be started again after it (miles' buffer is, at its
  next ``put`` or ``get``);
* the metrics port is served only once the host calls ``serve`` (last in its constructor: a setting refused
  before holds no port).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightbus.bus.identity import process_identity
from weightbus.consumers.admission import Admission, SharedBudget
from weightbus.consumers.drain.reports import DrainReporter
from weightbus.consumers.tracker.tracker import VersionTracker
from weightbus.integrations.host.admission import admission_from_settings
from weightbus.integrations.host.metrics import IntegrationMetrics, MetricsLease, process_metrics, serve
from weightbus.integrations.host.settings import ConnectSettings, metrics_address

if TYPE_CHECKING:
    from weightbus.bus.protocol import Bus
    from weightbus.consumers.drain.metrics import DrainMetrics
    from weightbus.consumers.drain.window import DrainWindow

__all__ = ["RolloutSetup"]


class RolloutSetup:
    """One rollout half's bus, tracker, drain reporter and admission, and their ordered teardown (see the module).

    Args:
        args: the host's namespace: ``weightbus_*`` attributes, else the ``WEIGHTBUS_*`` variables (the metrics
            port, the connect settings, the admission settings).
        host: the host's name (``miles``, ``slime``): the connection's name, the consumer id's default, the logger.
        policy: the policy the half follows.
        bus: a connected bus to use instead of connecting (tests, shared connections); never closed here.

    Attributes:
        consumer: the half's name on the bus (``WEIGHTBUS_CONSUMER``, else the process' identity, and a boot id: a
            restarted process' reports are not deduplicated against the last run's).
        metrics: the process' metrics when a metrics port is set, else None (nothing counted that is not shown).
        bus: the bus, once connected (or the one given).
        tracker: the version tracker, once started.
        gate, budget: the admission gate and its shared budget, once made (None: off, or this process alone).

    Raises:
        ValueError: a metrics port that is not a port.
    """

    def __init__(self, args: Any, *, host: str, policy: str, bus: Bus | None = None) -> None:
        self._args = args
        self._host = host
        self._log = logging.getLogger(f"weightbus.integrations.{host}")
        self.policy = policy
        self._address = metrics_address(args, "weightbus_metrics_port", "WEIGHTBUS_METRICS_PORT")
        self.metrics: IntegrationMetrics | None = process_metrics() if self._address is not None else None
        consumer = os.environ.get("WEIGHTBUS_CONSUMER") or process_identity(host)
        self.consumer = f"{consumer}:{uuid.uuid4().hex[:8]}"
        self.bus = bus
        self._owns_bus = bus is None
        self.tracker: VersionTracker | None = None
        self.gate: Admission | None = None
        self.budget: SharedBudget | None = None
        self._reporter: DrainReporter | None = None
        self._window: DrainWindow | None = None
        self._served: MetricsLease | None = None

    def serve(self) -> None:
        """Serve the process' metrics on the port the settings ask for (none: nothing); idempotent."""
        if self._address is not None and self._served is None:
            self._served = serve(self._address, "rollout")

    async def start(
        self,
        window: DrainWindow,
        *,
        drain_metrics: DrainMetrics | None,
        ready_timeout: float | None = None,
        not_ready: str = "the policy's version is not known yet",
    ) -> VersionTracker:
        """Connect (unless a bus was given), start the tracker, and hand ``window`` its reporter; idempotent.

        Args:
            window: the half's drain window: its finished windows are published as ``DrainReport``s.
            drain_metrics: the reporter's metrics (the window's stage's).
            ready_timeout: seconds to wait for the tracker to know the stored version before it is handed out
                (a warning, ``not_ready``, when it does not); None: not waited for.
            not_ready: the warning's text: what the half does meanwhile.

        Raises:
            ValueError, BusConfigError: bad connect settings (``ConnectSettings.from_args``).
            BusConnectError: the bus cannot be reached within the connect timeout.
        """
        if self.tracker is not None:
            return self.tracker
        if self.bus is None:
            from weightbus.bus.nats import connect

            settings = ConnectSettings.from_args(self._args)
            self.bus = await connect(
                settings.nats,
                name=f"weightbus-{self._host}-{self.policy}",
                connect_timeout=settings.connect_timeout,
                options=settings.options,
                metrics=self.metrics.bus if self.metrics is not None else None,
            )
        tracker = VersionTracker(
            self.bus,
            self.policy,
            observer=self.consumer,
            metrics=self.metrics.tracker if self.metrics is not None else None,
        )
        await tracker.start()
        if ready_timeout is not None:
            try:
                await tracker.wait_ready(timeout=ready_timeout)
            except TimeoutError:
                self._log.warning(
                    not_ready,
                    extra={"policy": self.policy, "timeout": ready_timeout, "status": tracker.status.value},
                )
            except BaseException:
                await tracker.aclose()  # cancelled while waiting: nothing left running that no one holds
                raise
        self._reporter = DrainReporter(self.bus, self.policy, self.consumer, metrics=drain_metrics)
        window.reporter = self._reporter
        self._window = window
        self.tracker = tracker
        return tracker

    async def admission(
        self,
        *,
        version: Callable[[], int | None],
        default_cap: Callable[[], int],
        max_staleness: int | None,
        check: Callable[[], None] | None = None,
    ) -> Admission | None:
        """Make the gate the admission settings ask for, and start its shared budget; None when admission is off.

        Made once: while a gate is held (until ``aclose``), a second call returns it.

        Args:
            version: the version source the gate reads at each check (it raises when it cannot say: nothing is
                admitted).
            default_cap: the host's own in-flight limit, in groups (the ``cap`` mode's default).
            max_staleness: the drain's bound (None: unlimited).
            check: the host's refusal of its own configuration, called before anything starts.

        Raises:
            ValueError: bad admission settings (``admission_from_settings``), or ``check``'s refusal.
            RuntimeError: called before ``start``.
        """
        if self.bus is None:
            raise RuntimeError("the rollout half's admission is made once it is started")
        if self.gate is not None:
            return self.gate  # a second budget would hold slots no one returns
        gate, budget = admission_from_settings(
            self._args,
            version=version,
            bus=self.bus,
            policy=self.policy,
            name=self.consumer,
            default_cap=default_cap,
            max_staleness=max_staleness,
            metrics=self.metrics.admission if self.metrics is not None else None,
        )
        if gate.mode == "off":
            return None
        if check is not None:
            check()
        if budget is not None:
            await budget.start()
        self.gate, self.budget = gate, budget
        return gate

    async def aclose(self) -> None:
        """Return the shared budget's slots, publish pending drain reports, stop the tracker, close the bus if it
        was connected here, and let go of the metrics port (the last holder of a port closes its server)."""
        budget, self.budget, self.gate = self.budget, None, None
        if budget is not None:
            await budget.aclose()
        reporter, self._reporter = self._reporter, None
        if self._window is not None:
            self._window.reporter = None
        if reporter is not None:
            await reporter.aclose()
        tracker, self.tracker = self.tracker, None
        if tracker is not None:
            await tracker.aclose()
        if self._owns_bus and self.bus is not None:
            await self.bus.aclose()
            self.bus = None
        served, self._served = self._served, None
        if served is not None:
            await asyncio.to_thread(served.release)
