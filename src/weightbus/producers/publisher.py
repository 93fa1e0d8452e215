"""``VersionPublisher``: what a trainer holds to publish weight versions: ``start()``, ``update()``, ``publish_lora()``.

It composes a ``FencedCounter``, an ``EngineFleet`` and ``VersionUpdate``; the counter's steps are not reachable from
it, so nothing announces without the take, the stamp and the quarantine. The update order: docs/design.md.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry

from weightbus.bus.identity import process_identity
from weightbus.bus.protocol import Bus
from weightbus.engines.sglang import PauseMode
from weightbus.errors import EngineError, FencedError
from weightbus.producers.counter import FencedCounter
from weightbus.producers.coverage import Push
from weightbus.producers.fleet import EngineFleet
from weightbus.producers.metrics import PublisherMetrics
from weightbus.producers.update import UpdateTurn, VersionUpdate
from weightbus.schemas import MAX_VERSION, ClaimStanding, LoraAdapter, WeightArtifact, WeightUpdated, parse_version

__all__ = ["MARK_DELAY", "PublisherState", "VersionPublisher"]

log = logging.getLogger("weightbus.producers")

_CLAIM_ATTEMPTS: Final = 5
#: Seconds the counter's mark after an announcement waits (``VersionPublisher(mark_delay=...)``): far past the
#: announcement's delivery to every tracker (at 64 subscriber processes on 2 cores, p99 6 ms and max 46 ms on a
#: quiet machine, bench/results/propagation.md; p99 46 ms and max 136 ms on a loaded one, propagation-loaded/).
MARK_DELAY: Final = 0.5
_UNLOAD_TIMEOUT: Final = 30.0  # seconds an unload after a failed LoRA update may take


@dataclass(frozen=True, slots=True)
class PublisherState:
    """A snapshot of a ``VersionPublisher``: its identity and what it knows (``VersionPublisher.state``).

    Attributes:
        policy: the policy id.
        trainer_id: this publisher's readable identity on the bus.
        incarnation: this instance's unique id on the bus (on every event it publishes).
        epoch: the epoch this publisher claimed (None before ``start()``).
        version: the current announced version (None for a policy that never announced one).
        issued: the highest number this counter ever issued (reserved or announced); 0 for none.
        next_version: the number the next ``update()`` will carry: the one our last announcement
            reserved, else a new one.
        started: whether ``start()`` claimed the counter.
        fenced: the ``FencedError`` once another publisher took over (every later update raises it).
        active: whether an ``update()`` of this publisher is in progress (updates are sequential).
        last_event: the last ``WeightUpdated`` this publisher had acknowledged.
    """

    policy: str
    trainer_id: str
    incarnation: str
    epoch: int | None
    version: int | None
    issued: int
    next_version: int
    started: bool
    fenced: FencedError | None
    active: bool
    last_event: WeightUpdated | None


class VersionPublisher:
    """Publishes ``WeightUpdated`` for one policy, fenced against every other publisher of it.

    Args:
        bus: the bus (borrowed; not closed here).
        policy: the policy id.
        trainer_id: this publisher's readable identity on the bus (default ``<hostname>:<pid>``).
        fleet: engines to pause, stamp, verify, quarantine and resume around each update (borrowed);
            without a fleet the trainer stamps its engines itself and ``update()`` reserves and
            announces only.
        pause: pause mode for the fleet on entering ``update()`` (``retract``, ``in_place``, ``abort``),
            or None to stamp without pausing.
        claim_attempts: how often ``start()`` re-reads and retries when another publisher claims at
            the same moment.
        incarnation: this instance's unique id on the bus (random by default; tests may fix it).
        reserve_next: every announcement also reserves the next number (``reserves_next``), so the
            next update takes it with a read instead of a ``VersionReserved`` and followers get one
            event per update. A publisher that takes over skips the number its predecessor reserved
            this way; pass False for a one-shot publisher (the CLI's ``publish``), whose successor
            should not skip one.
        floor: the version of the trainer's own checkpoint (as AReaL and verl derive theirs from
            the checkpointed step): ``start()`` resumes above it even when the bus has lost every
            trace of it; None to rely on the bus and the engines alone.
        metrics: shared metric families (one per registry): each update's phases and this
            counter's state (docs/operations.md#metrics); built on ``registry`` when None.
        registry: where to register the metrics when ``metrics`` is None (a private one when both
            are None).
        mark_delay: seconds the counter's mark after an announcement waits before it is written
            (default 0.5), so that it never competes with the announcement's delivery; the next
            ``update()``, ``settle()`` and ``aclose()`` write it sooner. 0 writes it at once, beside the
            resume (docs/design.md#the-counter-one-owner-fenced-by-the-bus, "The high-water mark").

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        ValueError: ``pause`` without a fleet; ``floor`` is not a version (0 to ``MAX_VERSION``).
    """

    def __init__(
        self,
        bus: Bus,
        policy: str,
        *,
        trainer_id: str | None = None,
        fleet: EngineFleet | None = None,
        pause: PauseMode | None = None,
        claim_attempts: int = _CLAIM_ATTEMPTS,
        incarnation: str | None = None,
        reserve_next: bool = True,
        floor: int | None = None,
        metrics: PublisherMetrics | None = None,
        registry: CollectorRegistry | None = None,
        mark_delay: float = MARK_DELAY,
    ) -> None:
        if not mark_delay >= 0:
            raise ValueError(f"mark_delay must be a number of seconds >= 0, got {mark_delay!r}")
        if pause is not None and fleet is None:
            raise ValueError("pause needs an engine fleet")
        if floor is not None and (type(floor) is not int or not 0 <= floor <= MAX_VERSION):
            raise ValueError(f"floor must be a version from 0 to {MAX_VERSION}, got {floor!r}")
        self._bus = bus
        self._counter = FencedCounter(
            bus,
            policy,
            trainer_id=trainer_id or process_identity(),
            incarnation=incarnation or uuid.uuid4().hex[:16],
            claim_attempts=claim_attempts,
            reserve_next=reserve_next,
            mark_delay=mark_delay,
        )
        self._fleet = fleet
        self._pause: PauseMode | None = pause
        self._turn = UpdateTurn()
        self._floor = floor
        self._metrics = metrics if metrics is not None else PublisherMetrics(registry)
        self._metrics.watch(self._counter)

    # -- identity and state (read-only) ------------------------------------------------------------

    @property
    def state(self) -> PublisherState:
        """This publisher's identity and what it knows now, as one frozen snapshot (read it again for later values)."""
        counter = self._counter.state
        return PublisherState(
            policy=counter.policy,
            trainer_id=counter.trainer_id,
            incarnation=counter.incarnation,
            epoch=counter.epoch,
            version=counter.version,
            issued=counter.issued,
            next_version=counter.next_version,
            started=counter.claimed,
            fenced=counter.fenced,
            active=self._turn.active,
            last_event=counter.last_event,
        )

    # -- claiming ----------------------------------------------------------------------------------

    async def start(self, *, standing: ClaimStanding | None = None, outrank: bool = False) -> VersionPublisher:
        """Resume the counter and claim it, fencing any previous owner.

        The counter resumes above the highest of: what the weights history shows as issued, the
        counter's high-water mark (``weightbus.<policy>.counter``), the engines' labels, and ``floor``.

        Args:
            standing: where the host's failover order puts this publisher (a miles cell's place in
                its group), recorded on the claim; None for a host without one.
            outrank: claim only over an owner whose standing ``standing`` outranks
                (``rules.standing``): a host's replica claiming again after it was fenced.

        Returns:
            ``self``.

        Raises:
            FencedError: ``outrank`` and ``standing`` does not outrank the owner's (nothing published).
            PublishError: the claim could not be stored, or other publishers kept claiming
                ``claim_attempts`` times in a row.
            BusError: the history could not be read.
        """
        if self._counter.state.claimed:
            return self
        engines = self._fleet.urls if self._fleet is not None else ()
        await self._counter.claim(
            engine_high=await self._engine_high(),
            engines=engines,
            floor=self._floor,
            standing=standing,
            outrank=outrank,
        )
        return self

    async def _engine_high(self) -> int | None:
        if self._fleet is None:
            return None
        high: int | None = None
        for url, label in (await self._fleet.read_versions()).items():
            if isinstance(label, EngineError):
                log.warning("could not read an engine's label at start", extra={"engine": url, "error": str(label)})
                continue
            value = parse_version(label)
            if value is not None and (high is None or value > high):
                high = value
        return high

    async def check_owner(self) -> None:
        """One read of the weights subject: raise ``FencedError`` if another publisher owns the counter now.

        ``update()`` finds out at its take, which runs beside the pause; a host that must not touch
        the engines at all once it lost the counter (a zombie trainer after a failover) calls this
        first.

        Raises:
            FencedError: another publisher claimed the counter.
            BusError: the subject could not be read.
            RuntimeError: before ``start()``.
        """
        if not self._counter.state.claimed:
            raise RuntimeError("call VersionPublisher.start() before check_owner()")
        await self._counter.check_owner()

    async def check_outranks(self, standing: ClaimStanding | None) -> None:
        """Raise ``FencedError`` unless ``standing`` outranks the standing the owner claimed with (reads only).

        What ``start(standing=..., outrank=True)`` of a new publisher would check, asked beforehand
        by one that is fenced (``rules.standing``), so that a refusal touches neither the engines
        nor the counter.

        Raises:
            FencedError: the owner's standing is not below ``standing`` (or unknown).
            BusError: the bus did not answer.
        """
        await self._counter.check_outranks(standing)

    async def __aenter__(self) -> VersionPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def settle(self) -> None:
        """Write now what the publisher deferred: the counter's mark after its last announcement.

        For a caller that reads the mark next, or stops. Nothing is lost without it: each update
        covers its own number before any engine may carry it. A bus failure is logged, not raised.
        """
        await self._counter.settle()

    async def aclose(self) -> None:
        """Stop: write the deferred mark (``settle``); the bus and the fleet stay the caller's. Idempotent."""
        await self.settle()

    # -- updates -----------------------------------------------------------------------------------

    def update(
        self,
        *,
        lora: LoraAdapter | None = None,
        push: Push | None = None,
        labels: bool = False,
        artifact: WeightArtifact | None = None,
    ) -> VersionUpdate:
        """One weight update, as an async context manager yielding the version to push (``int``).

        On entering, the number is reserved on the bus (then the fleet, if any, is paused, and,
        unless the push labels the engines itself, relabelled ``pending:<v>``). Inside the block the
        trainer pushes weights (and, without a fleet, stamps its engines). On normal exit the
        engines the push covers are stamped and verified, the others quarantined and alerted,
        ``WeightUpdated`` is announced with the stamped engines, then the fleet is resumed. On any
        failure nothing is announced, the number stays used up, and the fleet is relabelled with a
        quarantine label before it serves again (see ``VersionUpdate``).

        Args:
            lora: the LoRA adapter this push loads (recorded on the events); None for a push without one.
            push: ``full``: the block pushes the whole model to every engine (NCCL broadcast, a
                checkpoint from disk; the default without ``lora``); ``delta``: only the difference
                from the last announced version (a disk delta; a LoRA load, the default with
                ``lora``). A delta covers only the engines known to hold what it is the difference
                from; the others are in the update's ``missing`` after entering.
            labels: the push carries ``weight_version=str(v)`` to every engine (SGLang's
                ``update_weights_from_*`` accept it), so the update skips the ``pending:<v>``
                relabel; an engine the push did not label is then not stamped.
            artifact: where the trainer wrote the version's weights, for replicas that were not pushed to
                (``WeightUpdated.artifact``); or set the update's ``artifact`` inside the block, once the
                version is known. Never implied by ``lora``: a LoRA push's artifact, when given, is a delta.

        Entering raises ``CounterExhaustedError`` (nothing paused, reserved or pushed) once the
        counter has issued ``MAX_VERSION``, ``FencedError`` once another publisher owns it, and
        ``PublishError`` when the number could not be taken.

        Raises:
            ValueError: ``lora`` with ``push="full"`` or with a full ``artifact``, or an unknown ``push``.
        """
        return VersionUpdate(
            self._counter,
            self._bus,
            self._fleet,
            self._pause,
            self._turn,
            lora,
            push=push,
            labels=labels,
            metrics=self._metrics,
            artifact=artifact,
        )

    async def publish_lora(
        self,
        adapter: LoraAdapter,
        *,
        pinned: bool = False,
        replace: bool = False,
        base: str | None = None,
        artifact: WeightArtifact | None = None,
    ) -> int:
        """Load ``adapter`` on every engine of the fleet, stamp the next version, and announce it.

        SGLang's adapter load carries no version; this is the stamp that makes LoRA samples
        comparable with full-weight ones (both share this counter). A load refused by some engine
        is undone on the others, and the fleet is quarantined like any failed update; an update that
        fails after the load (its coverage check, the stamp, the announcement) unloads the adapter
        again, so a plain retry works (unless fenced: the engines are then its successor's).

        The load is a delta push: it brings an engine to the new version only if the engine holds
        the base the previous version names (it carried that version, or, in a run that never
        announced anything but adapters since the engines booted, it carries its boot label). An
        engine that does not (restarted after a full push, quarantined) gets ``base`` loaded from
        disk first when given, else it is quarantined and left out of the announcement.

        Args:
            adapter: name and path of the adapter.
            pinned: SGLang's ``pinned`` flag.
            replace: unload an adapter of the same name first (re-pushing new adapter weights under
                one name; SGLang refuses to load a name twice).
            base: where the engines can load the base weights the previous version names (the last
                full push's checkpoint, or the boot model in a LoRA-only run); loaded, without a
                version, only on the engines the adapter alone would not cover.
            artifact: the adapter as a replica would load it (a ``delta`` on the version its base
                weights are; see ``update``), announced with it; None: the announcement carries none.

        Returns:
            The announced version.

        Raises:
            ValueError: no fleet, ``adapter.path`` is None, or ``artifact`` is full.
            EngineError: an engine refused the load (nothing announced).
            PushCoverageError: no engine holds the base and ``base`` was not given (nothing announced).
            EngineOutOfSyncError, FencedError, PublishError: as ``update()``.
        """
        if self._fleet is None:
            raise ValueError("publish_lora needs an engine fleet")
        if adapter.path is None:
            raise ValueError(f"LoRA adapter {adapter.name!r} has no path to load")
        fleet = self._fleet
        update = self.update(lora=adapter, artifact=artifact)
        loaded = False
        try:
            async with update as version:
                if base is not None and update.missing:
                    await fleet.load_base(base, engines=update.missing)
                    update.pushed_missing(*update.missing)
                if replace:
                    await fleet.unload_lora_adapter(adapter.name, missing_ok=True)
                await fleet.load_lora_adapter(adapter.name, adapter.path, pinned=pinned)
                loaded = True
        except BaseException as failure:
            # Nothing was announced (the coverage check, the stamp or the announcement failed): undo the
            # load, so a plain retry is not refused as "already exists". A fenced publisher touches the
            # engines no more: they may carry its successor's adapter of the same name by now.
            if loaded and not isinstance(failure, FencedError):
                await self._unload_after_failure(adapter.name, failure)
            raise
        return version

    async def _unload_after_failure(self, name: str, failure: BaseException) -> None:
        assert self._fleet is not None
        try:
            async with asyncio.timeout(_UNLOAD_TIMEOUT):
                await self._fleet.unload_lora_adapter(name, missing_ok=True)
        except (EngineError, TimeoutError) as exc:
            log.error(
                "could not unload the adapter of a failed LoRA update; unload it before retrying",
                extra={"policy": self._counter.state.policy, "adapter": name, "error": repr(exc)},
            )
            failure.add_note(f"the adapter {name!r} could not be unloaded after the failure: {exc!r}")
        else:
            log.warning(
                "unloaded the adapter of a failed LoRA update (nothing was announced)",
                extra={"policy": self._counter.state.policy, "adapter": name, "error": repr(failure)},
            )
