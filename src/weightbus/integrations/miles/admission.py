"""Admission for miles' fully-async worker: a group starts generating only while it can still be trained.

The generate function waits for its group's slot (one per ``group_index``) in weightbus' ``Admission``, then calls
the real one; the buffer closes each slot; too few ``generate_fn_semaphore`` permits are refused (they would deadlock).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, Protocol

from weightbus.consumers.admission import Admission, AdmissionMetrics, SharedBudget, Slot
from weightbus.integrations.host.admission import admission_from_settings
from weightbus.integrations.host.settings import setting
from weightbus.integrations.miles.config import add_arguments

if TYPE_CHECKING:
    from weightbus.bus.protocol import Bus
    from weightbus.integrations.host.rollout import RolloutSetup

__all__ = ["MilesAdmission", "PacedBuffer", "active_buffer", "check_semaphore", "generate", "register_buffer"]

log = logging.getLogger("weightbus.integrations.miles")

#: miles' own generate function, wrapped unless ``WEIGHTBUS_GENERATE_FUNCTION`` names another.
DEFAULT_GENERATE: Final = "miles.rollout.generate_hub.single_turn.generate"


class PacedBuffer(Protocol):
    """What the generate function needs of the data buffer (``WeightbusDataBuffer``)."""

    async def admission(self) -> MilesAdmission | None:
        """The buffer's admission slots, or None when admission is off."""
        ...


_active: weakref.ref[PacedBuffer] | None = None


def register_buffer(buffer: PacedBuffer) -> None:
    """Make ``buffer`` the one this process's generate calls are paced by (the data buffer does, when made)."""
    global _active
    _active = weakref.ref(buffer)


def active_buffer() -> PacedBuffer | None:
    """The buffer registered last in this process (miles builds one per RolloutManager), if still alive."""
    return _active() if _active is not None else None


class _Entry:
    __slots__ = ("lock", "slot", "started_at")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.slot: Slot | None = None
        self.started_at: float | None = None


class MilesAdmission:
    """The slots of the groups miles is generating, on one ``Admission`` gate; owned by the data buffer.

    Args:
        gate: the gate (its version source is the buffer's).
        budget: the shared budget behind the gate (None: this process alone); ``start`` and ``aclose`` start and
            close it, unless it is a ``RolloutSetup``'s (``started``), which does.
    """

    def __init__(self, gate: Admission, budget: SharedBudget | None = None) -> None:
        self.gate = gate
        self.budget = budget
        self._entries: dict[int, _Entry] = {}

    @classmethod
    def from_settings(
        cls,
        args: Any,
        *,
        version: Callable[[], int | None],
        bus: Bus,
        policy: str,
        name: str,
        metrics: AdmissionMetrics | None = None,
    ) -> MilesAdmission:
        """The gate ``args`` and the environment ask for: ``weightbus_admission`` / ``WEIGHTBUS_ADMISSION``
        (``bounded``, ``cap``, ``off``), ``WEIGHTBUS_ADMISSION_CAP``, ``WEIGHTBUS_ADMISSION_SHARED``;
        ``metrics`` counts the shared budget's rejections and starvation.

        Raises:
            ValueError: an unknown mode, a cap that is not a positive int, no ``rollout_batch_size``.
        """
        gate, budget = admission_from_settings(
            args, version=version, bus=bus, policy=policy, name=name, metrics=metrics, **_miles_defaults(args)
        )
        return cls(gate, budget)

    @classmethod
    async def started(
        cls, setup: RolloutSetup, args: Any, *, version: Callable[[], int | None]
    ) -> MilesAdmission | None:
        """The gate ``setup`` makes from the settings (``RolloutSetup.admission``) with miles' defaults, after
        ``check_semaphore``; None when admission is off. Its shared budget is the setup's, started, and returned
        by the setup's ``aclose``.

        Raises:
            ValueError: bad admission settings, or miles' semaphore too small for it (``check_semaphore``).
        """
        gate = await setup.admission(version=version, check=lambda: check_semaphore(args), **_miles_defaults(args))
        return cls(gate, setup.budget) if gate is not None else None

    async def start(self) -> None:
        """Start the shared budget, if any."""
        if self.budget is not None:
            await self.budget.start()

    async def aclose(self) -> None:
        """Return the shared budget's slots, if any."""
        if self.budget is not None:
            await self.budget.aclose()

    @asynccontextmanager
    async def generating(self, key: int) -> AsyncIterator[Slot]:
        """Hold group ``key``'s slot while one of its samples generates; the first sample waits for it.

        A generation that raises (or is cancelled) releases the slot as ``aborted`` and forgets the group, so
        a retry of it (the same ``group_index``) waits for a new slot.
        """
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        async with entry.lock:  # a cancelled waiter takes nothing; the next sibling asks again
            if entry.slot is None:
                entry.slot = await self.gate.acquire()
                entry.started_at = time.time()  # the group's generation starts now: its time in flight
        slot = entry.slot
        try:
            yield slot
        except BaseException:
            if slot.open:
                slot.release("aborted")
            if self._entries.get(key) is entry:
                del self._entries[key]
            raise

    def finished(self, key: int | None) -> tuple[Slot | None, float | None]:
        """Group ``key`` reached the buffer: its slot if it holds an open one (to accept or release), else None,
        and when its generation started (None: never paced here)."""
        entry = self._entries.pop(key, None) if key is not None else None
        if entry is None or entry.slot is None or not entry.slot.open:
            return None, None
        return entry.slot, entry.started_at


def _miles_defaults(args: Any) -> dict[str, Any]:
    """What the admission settings default to in miles: the cap of its worker's in-flight groups, its bound."""
    return {
        "default_cap": lambda: _max_in_flight_groups(args),
        "max_staleness": getattr(args, "max_weight_staleness", None),
    }


def _max_in_flight_groups(args: Any) -> int:
    """The groups miles' fully-async worker keeps in flight (its ``_max_in_flight_groups``)."""
    n = getattr(args, "n_samples_per_prompt", 1) or 1
    samples = getattr(args, "async_max_concurrent_samples", None)
    groups: int = max(1, samples // n) if samples else args.rollout_batch_size
    return groups


def check_semaphore(args: Any) -> None:
    """Refuse a configuration where samples waiting for a slot could hold every one of miles' permits.

    Raises:
        ValueError: miles' ``generate_fn_semaphore`` has fewer permits than the samples in flight.
    """
    try:
        permits = args.sglang_server_concurrency * args.rollout_num_gpus // args.rollout_num_gpus_per_engine
    except (AttributeError, TypeError, ZeroDivisionError):
        return  # not miles' arguments: nothing to compare
    samples = _max_in_flight_groups(args) * (getattr(args, "n_samples_per_prompt", 1) or 1)
    if permits < samples:
        raise ValueError(
            f"weightbus admission needs miles' generate_fn_semaphore ({permits} permits: "
            f"--sglang-server-concurrency x engines) to cover the {samples} samples the fully-async worker keeps "
            "in flight: samples waiting for their group's slot hold permits. Raise --sglang-server-concurrency, "
            "or set WEIGHTBUS_ADMISSION=off"
        )


_inner: dict[str, Callable[[Any], Any]] = {}


def _generate_function(args: Any) -> Callable[[Any], Any]:
    path = setting(args, "weightbus_generate_function", "WEIGHTBUS_GENERATE_FUNCTION", DEFAULT_GENERATE)
    assert path is not None
    fn = _inner.get(path)
    if fn is None:
        from miles.rollout.inference_rollout.compatibility import (  # type: ignore[import-not-found]
            load_generate_function,
        )

        fn = load_generate_function(path)
        if fn is None:
            raise ValueError(f"WEIGHTBUS_GENERATE_FUNCTION {path!r} names no function")
        _inner[path] = fn
    return fn


async def generate(input: Any) -> Any:
    """miles' generate-function contract (``GenerateFnInput`` -> ``GenerateFnOutput``), paced by admission.

    Waits for the sample's group's slot in the budget of this process's ``WeightbusDataBuffer``, then calls
    the wrapped generate function with ``input`` unchanged.

    Raises:
        RuntimeError: no ``WeightbusDataBuffer`` was constructed in this process (the buffer flag is missing).
        ValueError: a sample without ``group_index``, or miles' semaphore too small (``check_semaphore``).
    """
    buffer = active_buffer()
    if buffer is None:
        raise RuntimeError(
            "weightbus.integrations.miles.generate paces the groups of a WeightbusDataBuffer: add "
            "--custom-async-data-buffer-path weightbus.integrations.miles.WeightbusDataBuffer"
        )
    inner = _generate_function(input.args)
    admission = await buffer.admission()
    if admission is None or getattr(input, "evaluation", False):
        return await inner(input)  # admission off, or an eval sample: never trained, never paced
    key = getattr(input.sample, "group_index", None)
    if not isinstance(key, int) or isinstance(key, bool):
        raise ValueError("weightbus admission needs miles' Sample.group_index on every sample (its data source)")
    async with admission.generating(key):
        return await inner(input)


# miles adds the flags of its generate function's ``add_arguments`` to its parser: the third flag brings them.
generate.add_arguments = add_arguments  # type: ignore[attr-defined]
