"""The rollout half of the miles integration: a drop-in fully-async data buffer (``WeightbusDataBuffer``).

miles' contract, weightbus' staleness control: the version from a ``VersionTracker`` (miles' is only a lower bound),
the strict rule, miles' metric names, the drain engine. docs/integrations/miles.md#the-rollout-half. Its bus, tracker,
drain reporter and admission gate are ``integrations.host.rollout``'s ``RolloutSetup``, the same as slime's; with
``WEIGHTBUS_METRICS_PORT`` set, its tracker, drain, admission and bus metrics are served on the process' registry
(``integrations.host.metrics``) until ``aclose``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from weightbus.bus.protocol import Bus
from weightbus.consumers.admission import AcceptedGroups
from weightbus.consumers.drain.metrics import DrainMetrics
from weightbus.consumers.tracker.tracker import VersionTracker
from weightbus.errors import TrackerNotReadyError
from weightbus.integrations.host.drain import staleness_stage
from weightbus.integrations.host.groups import group_key, to_weightbus_group
from weightbus.integrations.host.groups import group_versions_of as miles_group_versions
from weightbus.integrations.host.rollout import RolloutSetup
from weightbus.integrations.host.settings import setting as _setting
from weightbus.integrations.miles.admission import MilesAdmission, register_buffer
from weightbus.rules.source import read_version
from weightbus.schemas.rollouts import Group

__all__ = ["WeightbusDataBuffer", "miles_group_versions", "to_weightbus_group"]

log = logging.getLogger("weightbus.integrations.miles")

_ENTRY: Final = "miles_entry"  # a converted group's metadata key for miles' DataBufferInput
_UNSET: Final = object()


class WeightbusDataBuffer:
    """miles' ``DataBuffer`` contract backed by weightbus' version tracker and drain engine; see the module.

    Args:
        input: miles' ``DataBufferConstructorInput`` (``args`` and ``unused_handler_fn``; older miles
            versions call the handler ``on_evict``).
        bus: a connected bus to use instead of connecting to ``WEIGHTBUS_NATS`` (tests, shared connections).
        metrics: the policy's drain metrics (``StalenessMetrics(registry).for_policy(policy)``), or None;
            they include ``weightbus_host_version_regressions_total``. None with a metrics port set: the
            process registry's (the port serves them).
        dynamic_filter: a miles dynamic filter ``(args, group) -> output with .keep and .reason``; by default
            loaded from ``args.dynamic_sampling_filter_path`` through miles when that is set.
        ready_timeout: seconds the first ``put``/``get``, and then each ``get_metrics`` window's first
            ``get``, wait for a tracker that is not ready; by default ``args.weightbus_ready_timeout``
            or ``WEIGHTBUS_READY_TIMEOUT``, else 10.

    Raises:
        ValueError: no policy (``args.weightbus_policy`` / ``WEIGHTBUS_POLICY``), a bad
            ``WEIGHTBUS_UNKNOWN``, ready timeout or ``WEIGHTBUS_METRICS_PORT``, or ``args`` without
            ``rollout_batch_size``.
    """

    def __init__(
        self,
        input: Any,
        *,
        bus: Bus | None = None,
        dynamic_filter: Callable[[Any, list[Any]], Any] | None = None,
        ready_timeout: float | None = None,
        metrics: DrainMetrics | None = None,
    ) -> None:
        args = input.args
        self._args = args
        handler = getattr(input, "unused_handler_fn", None) or getattr(input, "on_evict", None)
        if handler is None:
            raise ValueError("the constructor input has no unused_handler_fn")
        self._unused_handler: Callable[[list[Any]], None] = handler
        policy = _setting(args, "weightbus_policy", "WEIGHTBUS_POLICY")
        if not policy:
            raise ValueError(
                "set the policy to follow: args.weightbus_policy or the WEIGHTBUS_POLICY environment variable"
            )
        self.policy = policy
        batch = getattr(args, "rollout_batch_size", None)
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"args.rollout_batch_size must be a positive int, not {batch!r}")
        factor = float(getattr(args, "async_data_buffer_capacity_factor", 2.0) or 2.0)
        self.capacity = max(1, int(factor * batch))
        self.max_staleness: int | None = getattr(args, "max_weight_staleness", None)
        recycles = getattr(args, "async_unused_samples_handler", "drop") == "retry"
        # The connect settings (URL, credentials, TLS) are read when the bus connects, args first.
        self._setup = RolloutSetup(args, host="miles", policy=policy, bus=bus)
        # Registered only when served: without a port the buffer counts nothing it would not show.
        if metrics is None and self._setup.metrics is not None:
            metrics = self._setup.metrics.drain.for_policy(policy)
        # miles' handler drops or retries by itself; the stage only decides how the window counts them.
        self.stage = staleness_stage(
            args, max_staleness=self.max_staleness, on_stale="recycle" if recycles else "drop", metrics=metrics
        )
        # The slots of admitted groups, settled by the drain engine as it keeps or routes each one.
        self._accepted = AcceptedGroups()
        self._window = self.stage.window(on_unused=self._unused, slots=self._accepted)
        self.consumer = self._setup.consumer
        if ready_timeout is None:
            raw = _setting(args, "weightbus_ready_timeout", "WEIGHTBUS_READY_TIMEOUT", "10")
            try:
                ready_timeout = float(raw)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise ValueError(f"WEIGHTBUS_READY_TIMEOUT must be a number of seconds, not {raw!r}") from None
        if ready_timeout < 0:
            raise ValueError(f"the ready timeout must be >= 0 seconds, not {ready_timeout}")
        self._ready_timeout = ready_timeout
        self._dynamic_filter = dynamic_filter
        self._filter_path = getattr(args, "dynamic_sampling_filter_path", None)
        self._start_lock: asyncio.Lock | None = None
        self._cond: asyncio.Condition | None = None
        self._buffer: deque[Group] = deque()
        self._passed: int | None = None  # the highest version miles has passed (get or put)
        self._last: int | None = None  # the latest version miles has passed
        self.regressions = 0
        """Times miles' own version went backwards (its failover restarts at 1); each is logged once."""
        self._waited = False  # this window already waited for a tracker that is not ready
        self._admission: MilesAdmission | None | object = _UNSET  # made by the first generate call
        self._wake: asyncio.Task[None] | None = None
        self._setup.serve()
        register_buffer(self)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> WeightbusDataBuffer:
        """Connect (unless a bus was given) and start following the policy; ``put``/``get`` call it."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
            self._cond = asyncio.Condition()
        async with self._start_lock:
            if self._setup.tracker is not None:
                return self
            # Judge nothing before the stored version is known: a tracker still replaying would
            # report "never published" and turn the filter off.
            await self._setup.start(
                self._window,
                drain_metrics=self.stage.metrics,
                ready_timeout=self._ready_timeout,
                not_ready=(
                    "the policy's version is not known yet; get() waits for it, then judges against miles' version"
                ),
            )
            if self._dynamic_filter is None and self._filter_path:
                self._dynamic_filter = _load_miles_dynamic_filter(self._filter_path)
        return self

    async def aclose(self) -> None:
        """Stop pacing, then the setup's teardown (``RolloutSetup.aclose``): return the shared budget's slots, publish
        pending drain reports, stop the tracker, close the bus if this buffer connected it, and let go of the
        metrics server (the last buffer or cell of its port closes it)."""
        self._admission = _UNSET
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.cancel()
            await asyncio.gather(wake, return_exceptions=True)
        await self._setup.aclose()

    @property
    def tracker(self) -> VersionTracker | None:
        """The version tracker, once started."""
        return self._setup.tracker

    async def admission(self) -> MilesAdmission | None:
        """The admission slots of this buffer's groups (None when ``WEIGHTBUS_ADMISSION=off``), made on first use.

        Raises:
            ValueError: bad admission settings, or miles' semaphore too small for it (``check_semaphore``).
        """
        await self.start()
        if self._admission is _UNSET:
            assert self._start_lock is not None
            async with self._start_lock:  # every sample of the first groups asks at once: one gate, one budget
                if self._admission is _UNSET:
                    made = await MilesAdmission.started(self._setup, self._args, version=self._version_now)
                    if made is not None:
                        tracker = self._setup.tracker
                        assert tracker is not None
                        self._wake = asyncio.create_task(made.gate.follow(tracker.latest_changes))
                    self._admission = made
        return self._admission  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._buffer)

    def buffered(self) -> list[Any]:
        """miles' ``DataBufferInput`` of every group waiting, in order (a snapshot)."""
        return [group.metadata[_ENTRY] for group in self._buffer]

    # -- miles' DataBuffer contract --------------------------------------------------------------

    async def put(self, input: Any) -> None:
        """Accept a finished group: aborted ones go to the unused handler, filtered ones are dropped."""
        await self.start()
        assert self._cond is not None
        self._pass(getattr(input, "weight_version", None))  # older miles: the engine version at finish
        group = to_weightbus_group(input.group, {_ENTRY: input})
        admission = self._admission if isinstance(self._admission, MilesAdmission) else None
        slot, started = admission.finished(group_key(input.group)) if admission is not None else (None, None)
        if slot is not None:
            # Stamped like weightbus rollout's groups: the drain splits their staleness into in flight and in queue.
            group.started_at, group.generated_at = started, time.time()
            group.generated_version = self._version_or_none()
        if not self._window.admit(group):
            if slot is not None:
                slot.release("aborted")
            return
        if self._dynamic_filter is not None:
            verdict = self._dynamic_filter(self._args, input.group)
            if not getattr(verdict, "keep", True):
                # Counted under its reason; miles emits no drop_<reason> key for a reason-less drop.
                self._window.filtered(str(getattr(verdict, "reason", None) or ""), group)
                if slot is not None:
                    slot.release("finished")
                return
        try:
            async with self._cond:
                while len(self._buffer) >= self.capacity:
                    await self._cond.wait()
                self._buffer.append(group)
                if slot is not None:
                    self._accepted.accept(slot, group)
                self._cond.notify_all()
        except BaseException:
            if slot is not None and slot.open:
                slot.release("aborted")  # cancelled while the buffer was full: the group never entered
            raise

    async def get(self, current_version: int | None = None, **context: Any) -> Any:
        """Return the next group fresh enough to train on, waiting for one; unused groups go to the handler.

        Args:
            current_version: the version miles knows (a lower bound: the tracker's is used when higher).
            context: further context miles passes; unused.

        Raises:
            TrackerNotReadyError: the tracker is not ready and miles never passed a version; nothing
                was taken from the buffer.
        """
        await self.start()
        assert self._cond is not None
        self._pass(current_version)
        current, version_state = await self._read_version()  # before anything is taken
        w = self._window
        buffer = self._buffer
        async with self._cond:
            t = w.begin(current, version_state)
            try:
                while True:
                    while not buffer:
                        await self._cond.wait()
                    group = buffer.popleft()
                    self._cond.notify_all()
                    try:
                        kept = w.take(t, group)
                    except BaseException:
                        buffer.appendleft(group)
                        raise
                    if kept:
                        w.close(t)
                        return group.metadata[_ENTRY]
            except BaseException:
                buffer.extendleft(reversed(w.abandon(t)))
                raise

    def get_metrics(self) -> dict[str, float]:
        """miles' metric names plus ``weightbus/*`` for the window since the last call; publishes a ``DrainReport``."""
        self._waited = False
        state = "given"  # a window without a get: what a get would have said now
        tracker = self._setup.tracker
        if tracker is not None and tracker.ready:
            if tracker.state.version is not None:
                state = "current"
            elif self._passed is None:
                state = "never_published"
        metrics = self._window.finish(self._buffer, version_state=state).metrics
        metrics["weightbus/version_regressions"] = float(self.regressions)
        return metrics

    # -- internals -------------------------------------------------------------------------------

    def _pass(self, version: Any) -> None:
        if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
            if self._last is not None and version < self._last:
                self.regressions += 1
                if self.stage.metrics is not None:
                    self.stage.metrics.version_regressed()
                log.error(
                    "miles' version went backwards (%d -> %d): without a version on the bus this buffer cannot"
                    " tell the new numbering's groups from the old one's; judging against miles' current version,"
                    " the old numbering's higher labels as stale. Install the trainer half to fix the numbering.",
                    self._last,
                    version,
                    extra={"policy": self.policy, "version": version, "previous": self._last},
                )
            self._last = version
            if self._passed is None or version > self._passed:
                self._passed = version
                if isinstance(self._admission, MilesAdmission):
                    self._admission.gate.notify()  # the window may have moved

    async def _read_version(self) -> tuple[int | None, str]:
        """The version to judge a ``get`` against, and where it came from (``DrainStats.version_state``)."""
        tracker = self._setup.tracker
        assert tracker is not None
        if not tracker.ready and not self._waited:
            try:
                await tracker.wait_ready(self._ready_timeout)
            except TimeoutError:
                self._waited = True  # once per window: a drain of n gets does not wait n times
        try:
            current, state = self._judged_at()
        except TrackerNotReadyError as exc:
            raise TrackerNotReadyError(
                self.policy, exc.status, "miles passed no version either; every group is still buffered"
            ) from exc
        if state == "given" and not tracker.ready:
            log.warning(
                "the version tracker is not ready (%s); judging against the highest version miles passed, %d",
                tracker.status.value,
                current,
                extra={"policy": self.policy, "status": tracker.status.value, "version": current},
            )
        return current, state

    def _judged_at(self) -> tuple[int | None, str]:
        """The version a ``get`` judges against now and its ``version_state``; admission reads the same.

        Raises:
            TrackerNotReadyError: the tracker cannot say and miles never passed a version.
        """
        tracker = self._setup.tracker
        if tracker is None:
            raise TrackerNotReadyError(self.policy, "starting")
        try:
            tracked = read_version(tracker)
        except TrackerNotReadyError:
            if self._passed is None:
                raise
            return self._given()  # a lower bound: judges no group fresher than it is
        passed = self._passed
        if tracked is None:
            return (None, "never_published") if passed is None else self._given()
        return (tracked if passed is None else max(tracked, passed)), "current"

    def _given(self) -> tuple[int | None, str]:
        """Without a bus version: the highest version miles passed, unless miles' own version went backwards
        since (its failover): then miles' current, ``regressed`` (the drain engine judges the old numbering's
        higher labels stale rather than raising the version to them, which would stall every drain)."""
        last, passed = self._last, self._passed
        if last is not None and passed is not None and last < passed:
            return last, "regressed"
        return passed, "given"

    def _version_now(self) -> int | None:
        return self._judged_at()[0]

    def _version_or_none(self) -> int | None:
        try:
            return self._judged_at()[0]
        except TrackerNotReadyError:
            return None  # no split for this group rather than a guess

    def _unused(self, group: Group) -> None:
        self._unused_handler(group.metadata[_ENTRY].prompt_group)


def _load_miles_dynamic_filter(path: str) -> Callable[[Any, list[Any]], Any]:
    """miles' dynamic filter at ``path``, called through miles' own wrapper (miles must be installed)."""
    from miles.rollout.filter_hub.base_types import call_dynamic_filter  # type: ignore[import-not-found]
    from miles.utils.misc import load_function  # type: ignore[import-not-found]

    fn = load_function(path)
    return lambda args, group: call_dynamic_filter(fn, args, group)
