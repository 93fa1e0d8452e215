"""A drop-in fully-async data buffer for miles, loaded with one flag:
``--custom-async-data-buffer-path weightbus.integrations.miles.WeightbusDataBuffer``.

miles (``miles/rollout/fully_async_data_buffer.py``) constructs the class with a
``DataBufferConstructorInput(args, unused_handler_fn)`` and calls ``await put(DataBufferInput)`` per finished
group, ``await get(current_version=..., **context)`` per group to train on, and ``get_metrics()`` once per
training step. This class keeps miles' contract and replaces its staleness control with weightbus':

* **The version comes from the bus.** A ``VersionTracker`` follows ``weightbus.<policy>.weights`` (policy
  from ``args.weightbus_policy`` or ``WEIGHTBUS_POLICY``; NATS from ``args.weightbus_nats`` or
  ``WEIGHTBUS_NATS``), so a restarted trainer or a failover never moves it backwards. The version miles
  passes to ``get`` (or, in older miles, puts on ``DataBufferInput.weight_version``) is only a lower
  bound: the group is judged against the highest of them and the tracker's.
* **The strict rule** (``weightbus.rules.staleness.judge``) judges the oldest label of every sample,
  turn and nested trajectory (miles' ``Sample.weight_versions``); a label that is not a version
  (``"default"``) or a group without any label is never silently fresh (``unknown_version``), unless
  ``WEIGHTBUS_UNKNOWN=ignore`` (miles' behaviour). Staleness above ``args.max_weight_staleness`` is stale.
* **Unused groups go to miles' handler** (``--async-unused-samples-handler``): aborted groups at ``put``
  (any sample with ``status`` ``aborted``), stale and unknown-version groups at ``get``, and groups the
  ``--dynamic-sampling-filter-path`` rejects are dropped, as miles does.
* **Metrics** keep miles' names (``rollout/fully_async/queue_size``, ``aborted_groups_filtered``,
  ``stale_groups_filtered``, ``avg_staleness``, ``max_staleness``, ``buffer_avg_staleness``,
  ``buffer_max_staleness``, ``rollout/dynamic_filter/drop_<reason>``) plus ``weightbus/*``; each
  ``get_metrics()`` window is published as a ``DrainReport`` on ``weightbus.<policy>.drains``.
* The capacity is miles' ``floor(async_data_buffer_capacity_factor * rollout_batch_size)`` groups; a full
  buffer blocks ``put``.

Importing this module never imports miles; the dynamic filter (only when its path is set) is loaded
through miles' own helpers. The bus connects on the first ``put``/``get`` (miles constructs the buffer
outside the event loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from weightbus.bus.protocol import Bus
from weightbus.consumers.drain.reports import DrainReporter
from weightbus.consumers.drain.stage import DrainStats
from weightbus.consumers.tracker.tracker import VersionTracker
from weightbus.rules.staleness import UNKNOWN_POLICIES, Reason, group_versions, judge
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

__all__ = ["WeightbusDataBuffer", "miles_group_versions", "to_weightbus_group"]

log = logging.getLogger("weightbus.integrations.miles")

_PREFIX: Final = "rollout/fully_async/"
_STATUSES: Final = {s.value for s in SampleStatus}


def _iter_items(group: Iterable[Any]) -> Iterator[Any]:
    for item in group:
        if isinstance(item, list):
            yield from item
        else:
            yield item


def _status(sample: Any) -> SampleStatus:
    status = getattr(sample, "status", None)
    value = getattr(status, "value", status)
    return SampleStatus(value) if isinstance(value, str) and value in _STATUSES else SampleStatus.PENDING


def _convert(sample: Any, fallback_index: int) -> Sample:
    index = getattr(sample, "index", None)
    labels = [v if isinstance(v, str) else str(v) for v in (getattr(sample, "weight_versions", None) or [])]
    return Sample(
        index=index if isinstance(index, int) else fallback_index,
        weight_versions=labels,
        status=_status(sample),
    )


def to_weightbus_group(group: list[Any]) -> Group:
    """A miles group (``list[Sample | list[Sample]]``; a nested list is one trajectory) as a weightbus ``Group``.

    Only what the staleness rule reads is carried over: each sample's ``index``, ``weight_versions``
    (one label per generate call or turn) and ``status``.
    """
    flat: list[Sample] = []
    trajectories: list[list[Sample]] = []
    n = 0
    for item in group:
        if isinstance(item, list):
            trajectory = []
            for sample in item:
                trajectory.append(_convert(sample, n))
                n += 1
            trajectories.append(trajectory)
        else:
            flat.append(_convert(item, n))
            n += 1
    first = flat[0].index if flat else trajectories[0][0].index if trajectories and trajectories[0] else 0
    return Group(prompt_index=first, samples=flat, trajectories=trajectories)


def miles_group_versions(group: list[Any]) -> Any:
    """``group_versions`` of a miles group: the oldest and newest version over every sample and turn."""
    return group_versions(to_weightbus_group(group))


@dataclass
class _Window:
    """What happened since the last ``get_metrics()``."""

    kept: int = 0
    unused: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    tracker_behind: int = 0
    unknown_label_groups: int = 0
    dynamic_filter: dict[str, int] = field(default_factory=dict)
    current: int | None = None
    tracker_current: int | None = None

    def count(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.unused += 1


def _setting(args: Any, name: str, env: str, default: str | None = None) -> str | None:
    value = getattr(args, name, None)
    if value is None or value == "":
        value = os.environ.get(env) or default
    return value


class WeightbusDataBuffer:
    """miles' ``DataBuffer`` contract backed by weightbus' version tracker and staleness rule; see the module.

    Args:
        input: miles' ``DataBufferConstructorInput`` (``args`` and ``unused_handler_fn``; older miles
            versions call the handler ``on_evict``).
        bus: a connected bus to use instead of connecting to ``WEIGHTBUS_NATS`` (tests, shared connections).
        dynamic_filter: a miles dynamic filter ``(args, group) -> output with .keep and .reason``; by default
            loaded from ``args.dynamic_sampling_filter_path`` through miles when that is set.
        ready_timeout: seconds the first ``put``/``get`` waits for the tracker to learn the stored version.

    Raises:
        ValueError: no policy (``args.weightbus_policy`` / ``WEIGHTBUS_POLICY``), a bad
            ``WEIGHTBUS_UNKNOWN``, or ``args`` without ``rollout_batch_size``.
    """

    def __init__(
        self,
        input: Any,
        *,
        bus: Bus | None = None,
        dynamic_filter: Callable[[Any, list[Any]], Any] | None = None,
        ready_timeout: float = 10.0,
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
        self._nats = _setting(args, "weightbus_nats", "WEIGHTBUS_NATS", "nats://127.0.0.1:4222")
        unknown = _setting(args, "weightbus_unknown", "WEIGHTBUS_UNKNOWN", "stale")
        if unknown not in UNKNOWN_POLICIES:
            raise ValueError(f"WEIGHTBUS_UNKNOWN must be 'stale' or 'ignore', not {unknown!r}")
        self._unknown = unknown
        batch = getattr(args, "rollout_batch_size", None)
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"args.rollout_batch_size must be a positive int, not {batch!r}")
        factor = float(getattr(args, "async_data_buffer_capacity_factor", 2.0) or 2.0)
        self.capacity = max(1, int(factor * batch))
        self.max_staleness: int | None = getattr(args, "max_weight_staleness", None)
        self._recycles = getattr(args, "async_unused_samples_handler", "drop") == "retry"
        consumer = os.environ.get("WEIGHTBUS_CONSUMER") or f"miles:{socket.gethostname()}:{os.getpid()}"
        # A boot id keeps a restarted process' report ids from being deduplicated against the last run's.
        self.consumer = f"{consumer}:{uuid.uuid4().hex[:8]}"
        self._ready_timeout = ready_timeout
        self._dynamic_filter = dynamic_filter
        self._filter_path = getattr(args, "dynamic_sampling_filter_path", None)
        self._bus = bus
        self._owns_bus = bus is None
        self._tracker: VersionTracker | None = None
        self._reporter: DrainReporter | None = None
        self._start_lock: asyncio.Lock | None = None
        self._cond: asyncio.Condition | None = None
        self._buffer: list[Any] = []
        self._window = _Window()
        self._last_current: int | None = None
        self._floor: int | None = None
        self._reports: set[asyncio.Task[bool]] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> WeightbusDataBuffer:
        """Connect (unless a bus was given) and start following the policy; ``put``/``get`` call it."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
            self._cond = asyncio.Condition()
        async with self._start_lock:
            if self._tracker is not None:
                return self
            if self._bus is None:
                from weightbus.bus.nats import connect

                self._bus = await connect(self._nats or "nats://127.0.0.1:4222", name=f"weightbus-miles-{self.policy}")
            tracker = VersionTracker(self._bus, self.policy, observer=self.consumer)
            await tracker.start()
            try:
                # Judge nothing before the stored version is known: a tracker still replaying would
                # report "never published" and turn the filter off.
                await tracker.wait_ready(timeout=self._ready_timeout)
            except TimeoutError:
                log.warning(
                    "the policy's version is not known yet; judging against miles' version meanwhile",
                    extra={"policy": self.policy, "timeout": self._ready_timeout},
                )
            self._reporter = DrainReporter(self._bus, self.policy, self.consumer)
            self._tracker = tracker
            if self._dynamic_filter is None and self._filter_path:
                self._dynamic_filter = _load_miles_dynamic_filter(self._filter_path)
        return self

    async def aclose(self) -> None:
        """Publish pending drain reports, stop the tracker, and close the bus if this buffer connected it."""
        if self._reports:
            await asyncio.gather(*self._reports, return_exceptions=True)
        if self._tracker is not None:
            await self._tracker.stop()
            self._tracker = None
        if self._owns_bus and self._bus is not None:
            await self._bus.close()
            self._bus = None

    @property
    def tracker(self) -> VersionTracker | None:
        """The version tracker, once started."""
        return self._tracker

    # -- miles' DataBuffer contract --------------------------------------------------------------

    async def put(self, input: Any) -> None:
        """Accept a finished group: aborted ones go to the unused handler, filtered ones are dropped."""
        await self.start()
        assert self._cond is not None
        reported = getattr(input, "weight_version", None)  # older miles: the engine version at finish
        if isinstance(reported, int):
            self._floor = reported if self._floor is None else max(self._floor, reported)
        if any(_status(s) is SampleStatus.ABORTED for s in _iter_items(input.group)):
            self._window.count(Reason.ABORTED)
            self._unused_handler(input.prompt_group)
            return
        if self._dynamic_filter is not None:
            verdict = self._dynamic_filter(self._args, input.group)
            if not getattr(verdict, "keep", True):
                reason = str(getattr(verdict, "reason", "") or "filtered")
                self._window.dynamic_filter[reason] = self._window.dynamic_filter.get(reason, 0) + 1
                return
        async with self._cond:
            while len(self._buffer) >= self.capacity:
                await self._cond.wait()
            self._buffer.append(input)
            self._cond.notify_all()

    async def get(self, current_version: int | None = None, **context: Any) -> Any:
        """Return the next group fresh enough to train on, waiting for one; unused groups go to the handler.

        Args:
            current_version: the version miles knows (a lower bound: the tracker's is used when higher).
            context: further context miles passes; unused.
        """
        await self.start()
        assert self._cond is not None and self._tracker is not None
        async with self._cond:
            while True:
                while not self._buffer:
                    await self._cond.wait()
                entry = self._buffer.pop(0)
                self._cond.notify_all()
                tracked = self._tracker.current
                candidates = [v for v in (tracked, current_version, self._floor) if v is not None]
                current = max(candidates) if candidates else None
                versions = miles_group_versions(entry.group)
                verdict = judge(versions, current, max_staleness=self.max_staleness, unknown=self._unknown)
                w = self._window
                w.tracker_current = tracked
                if verdict.current is not None:
                    w.current = verdict.current if w.current is None else max(w.current, verdict.current)
                    self._last_current = w.current
                w.tracker_behind += int(verdict.tracker_behind)
                w.unknown_label_groups += int(versions.unknown or not versions.labelled)
                if verdict.staleness is not None:
                    w.staleness.append(verdict.staleness)
                if verdict.keep:
                    w.kept += 1
                    return entry
                log.info(
                    "group not trained on",
                    extra={"policy": self.policy, "reason": str(verdict.reason), "staleness": verdict.staleness},
                )
                w.count(verdict.reason)
                self._unused_handler(entry.prompt_group)

    def get_metrics(self) -> dict[str, float]:
        """miles' metric names plus ``weightbus/*`` for the window since the last call; publishes a ``DrainReport``."""
        w, self._window = self._window, _Window()
        buffered = [
            self._last_current - v.oldest
            for entry in self._buffer
            if self._last_current is not None and (v := miles_group_versions(entry.group)).oldest is not None
        ]
        unused_filtered = w.unused
        stats = DrainStats(
            current=w.current,
            tracker_current=w.tracker_current,
            kept=w.kept,
            recycled=unused_filtered if self._recycles else 0,
            dropped=(0 if self._recycles else unused_filtered) + sum(w.dynamic_filter.values()),
            reasons=dict(w.reasons),
            staleness_avg=sum(w.staleness) / len(w.staleness) if w.staleness else None,
            staleness_max=max(w.staleness) if w.staleness else None,
            staleness_count=len(w.staleness),
            tracker_behind=w.tracker_behind,
            unknown_label_groups=w.unknown_label_groups,
            queue_size=len(self._buffer),
            buffer_avg_staleness=sum(buffered) / len(buffered) if buffered else None,
            buffer_max_staleness=max(buffered) if buffered else None,
            dynamic_filter=dict(w.dynamic_filter),
        )
        self._publish_report(stats)
        return stats.metrics

    # -- internals -------------------------------------------------------------------------------

    def _publish_report(self, stats: DrainStats) -> None:
        if self._reporter is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log.warning("get_metrics called outside the event loop; drain report not published")
            return
        task = loop.create_task(self._reporter.report(stats))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)


def _load_miles_dynamic_filter(path: str) -> Callable[[Any, list[Any]], Any]:
    """miles' dynamic filter at ``path``, called through miles' own wrapper (miles must be installed)."""
    from miles.rollout.filter_hub.base_types import call_dynamic_filter  # type: ignore[import-not-found]
    from miles.utils.misc import load_function  # type: ignore[import-not-found]

    fn = load_function(path)
    return lambda args, group: call_dynamic_filter(fn, args, group)
