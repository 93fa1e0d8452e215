"""``VersionUpdate``: one weight update of a ``VersionPublisher`` as an async context manager.

It drives a ``FencedCounter`` and an ``EngineFleet`` and knows nothing of the publisher (no import cycle): take and
pause, relabel, push, stamp, announce, resume; on a failure, quarantine first. The update order: docs/design.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TypeVar

from weightbus.bus import subjects
from weightbus.bus.protocol import Bus
from weightbus.engines.sglang import PauseMode
from weightbus.errors import BusError, EngineError, FencedError, PublishError, PushCoverageError
from weightbus.producers.counter import FencedCounter
from weightbus.producers.coverage import Push, cover, pending_label
from weightbus.producers.fleet import EngineFleet, EngineStamp
from weightbus.producers.metrics import Outcome, PublisherMetrics
from weightbus.producers.stamping import (
    alert_uncovered,
    alert_unexpected_labels,
    publish_applied,
    stamp_and_verify,
)
from weightbus.schemas import (
    QUARANTINE_PREFIX,
    FleetQuarantined,
    LoraAdapter,
    WeightArtifact,
    WeightUpdated,
    encode,
    now,
)

__all__ = ["UpdateTurn", "VersionUpdate", "quarantine_label"]

log = logging.getLogger("weightbus.producers")

_T = TypeVar("_T")

#: Seconds an engine may take to take its quarantine label: a hung engine must not hold up the rest.
_CLEANUP_TIMEOUT = 5.0


def quarantine_label(version: int) -> str:
    """The non-numeric label engines carry after update ``version`` failed: ``quarantine:<version>``."""
    return f"{QUARANTINE_PREFIX}{version}"


class UpdateTurn:
    """The one update a publisher may run at a time: ``active`` while an update holds it."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = False


class VersionUpdate:
    """One update, returned by ``VersionPublisher.update()``; see the module docstring.

    Driven by its phases: ``begin()`` (take, pause, mark pending) returns the version; then the caller
    pushes and ends it with ``commit()`` (stamp, announce, resume) or, after a failure, ``abort(exc)``
    (quarantine, resume). ``async with`` runs them: ``begin`` on entering, ``commit`` on a normal exit,
    ``abort`` on an exception. Begin and end it in one task (task-bound state such as a cancel scope,
    a context variable or ``asyncio.timeout`` must see both).

    Args:
        counter: the claimed counter the number is taken from and announced on.
        bus: where alerts and read-backs go (the counter's bus).
        fleet: the engines to pause, stamp, quarantine and resume, or None (the trainer stamps them).
        pause: the pause mode on entering, or None.
        turn: the publisher's one update turn (updates are sequential).
        lora: the adapter of a LoRA push, else None.
        push: what the block's push covers: ``full`` (the whole model, the default without ``lora``)
            or ``delta`` (the difference from the last announced version: a LoRA load, a disk delta;
            the default, and the only choice, with ``lora``).
        labels: the block's push carries ``weight_version=str(v)`` to every engine (so it labels
            them itself, and no ``pending:<v>`` relabel is needed); then an engine the push did not
            label is not stamped.
        metrics: where the update's phases are observed when it ends, or None.
        artifact: where the trainer wrote the version's weights (``WeightUpdated.artifact``), when known
            before entering; else set ``artifact`` inside the block, once the version is known.

    Raises:
        ValueError: ``lora`` with ``push="full"`` (an adapter load leaves the base as it was: the
            announcement of a LoRA version says so; announce a new base with a full update), or
            ``lora`` with a full ``artifact`` (an adapter is a delta on the base).

    Attributes:
        version: the reserved version this update pushes and announces (set on entering).
        lora: the adapter of a LoRA push, else None.
        push: what the push covers.
        labels: whether the push labels the engines itself.
        missing: after entering, the engines the push as declared will not bring to ``v`` (a delta
            whose base they do not hold: restarted or quarantined engines); push them the missing
            part and call ``pushed_missing``, or they are quarantined and left out of the announcement.
        stamps: the engines' read-backs after a successful exit with a fleet (the covered engines).
        event: the acknowledged ``WeightUpdated`` after a successful exit.
        artifact: what the announcement carries as ``WeightUpdated.artifact``; the block may set it. One
            whose base is not below the version, or a full one on a LoRA push (``ValueError``), or that makes
            the announcement larger than ``MAX_EVENT_BYTES`` (``UnsendableEventError``: keep per-tensor
            digests of a large model in the artifact, with ``manifest_digest`` on the event) fails the update
            before any stamp: the engines quarantined, nothing announced.
        quarantined: the ``FleetQuarantined`` alert of a failed update with a fleet, else None.
        phases: seconds each phase took, in the order they ran (``weightbus.producers.metrics.PHASES``:
            ``take`` and ``pause`` overlap; ``push`` is the block; a failed phase counts up to its
            failure, and ``quarantine`` and ``resume`` follow a failure); a failed update holds
            the phases it ran.
    """

    def __init__(
        self,
        counter: FencedCounter,
        bus: Bus,
        fleet: EngineFleet | None,
        pause: PauseMode | None,
        turn: UpdateTurn,
        lora: LoraAdapter | None,
        *,
        push: Push | None = None,
        labels: bool = False,
        metrics: PublisherMetrics | None = None,
        artifact: WeightArtifact | None = None,
    ) -> None:
        if push is None:
            push = "delta" if lora is not None else "full"
        if push not in ("full", "delta"):
            raise ValueError(f"push must be 'full' or 'delta', not {push!r}")
        if lora is not None and push == "full":
            raise ValueError("a LoRA update is a delta push (an adapter on the previous base); a full one has no lora")
        if lora is not None and artifact is not None and artifact.lineage == "full":
            raise ValueError("a LoRA update's artifact is a delta (the adapter on the previous base)")
        self.artifact = artifact
        self.push: Push = push
        self.labels = labels
        self.missing: tuple[str, ...] = ()
        self._before: dict[str, str] = {}
        self._counter = counter
        self._bus = bus
        self._fleet = fleet
        self._pause = pause
        self._turn = turn
        self.lora = lora
        self.version: int | None = None
        self.stamps: list[EngineStamp] = []
        self.event: WeightUpdated | None = None
        self.quarantined: FleetQuarantined | None = None
        self._paused = False
        self._pending = False
        self._phase = "new"  # then "beginning", "begun" (or "failed"), then "over"
        self.phases: dict[str, float] = {}
        self._metrics = metrics
        self._pushing: float | None = None  # when the block got the version
        self._observed = False

    @contextmanager
    def _timing(self, phase: str) -> Iterator[None]:
        """Add the time the block takes, raising or not, to ``phases[phase]``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - started

    async def _timed(self, phase: str, step: Awaitable[_T]) -> _T:
        """``await step`` timed as ``phase`` (for steps gathered with others)."""
        with self._timing(phase):
            return await step

    def _observe(self) -> None:
        """Report the phases once, when the update ended (announced if its ``WeightUpdated`` was acknowledged)."""
        if self._observed or self._metrics is None:
            return
        self._observed = True
        outcome: Outcome = "announced" if self.event is not None else "failed"
        self._metrics.observe_update(self._counter.state.policy, self.phases, outcome)

    def pushed_missing(self, *engines: str) -> None:
        """Say that the block pushed ``engines`` (from ``missing``) the part the declared push lacks for them.

        For a delta push that is the whole model (e.g. the base from disk, then the adapter with the
        others): they hold the weight set ``v`` names, and are stamped with the covered engines.

        Raises:
            ValueError: an engine that is not in ``missing``.
        """
        unknown = set(engines) - set(self.missing)
        if unknown:
            raise ValueError(f"not missing from this update's push: {sorted(unknown)}")
        self.missing = tuple(url for url in self.missing if url not in engines)

    async def before_push(self) -> None:
        """Call right before a push that does not start at once: check ownership, then mark the engines pending again.

        Entering did both already; a block that first computes or waits (a checkpoint to write,
        a broadcast group to form) calls this just before it sends weights, so that an owner that
        took over and finished an update in the meantime is seen here, before the push, and not
        after it: a fenced publisher raises and pushes nothing, and the engines carry ``pending:<v>``
        (not the owner's number) from here to the stamp.

        Raises:
            FencedError: another publisher owns the counter: do not push (the update then quarantines).
            EngineError: an engine refused the pending label.
            RuntimeError: outside the block.
        """
        if self.version is None or self._phase != "begun":
            raise RuntimeError("before_push() belongs inside the update's block")
        await self._counter.check_owner()
        if self._fleet is not None and not self.labels:
            await self._mark_pending(self._fleet, self.version)

    async def _mark_pending(self, fleet: EngineFleet, version: int) -> None:
        """Relabel every engine ``pending:<version>`` before the push; raise the first engine's refusal."""
        self._pending = True  # before the await: a cancellation may land some relabels
        results = await fleet.relabel(pending_label(version), timeout=_CLEANUP_TIMEOUT)
        errors = [err for err in results.values() if err is not None]
        if errors:
            first = errors[0]
            for other in errors[1:]:
                first.add_note(f"the pending relabel also failed on {other.url}: {other}")
            raise first

    async def begin(self) -> int:
        """Take the number and pause the fleet, read the labels and mark the engines pending (steps 0 to 3).

        Returns:
            the version the push carries.

        Raises:
            RuntimeError: the publisher is not started, another update is in progress, or this one was begun.
            FencedError: another publisher owns the counter (nothing was paused).
            CounterExhaustedError: the counter issued ``MAX_VERSION`` (nothing was touched).
            BusError, EngineError: the take or a relabel failed; the fleet was resumed (and quarantined
                if some engine may carry the pending label).
        """
        if self._phase != "new":
            raise RuntimeError(f"begin() belongs to a new update; this one is {self._phase}")
        counter, fleet, turn = self._counter, self._fleet, self._turn
        known = counter.state
        if not known.claimed:
            raise RuntimeError("call VersionPublisher.start() before update()")
        if turn.active:
            raise RuntimeError("another update of this publisher is in progress; updates are sequential")
        if known.fenced is not None:
            raise known.fenced  # known without a read: never pause the owner's fleet again
        counter.check_ceiling()  # before the pause: an exhausted counter touches nothing
        turn.active = True
        self._phase = "beginning"  # commit() and abort() refuse it until the take and the relabels are done
        try:
            version = known.next_version
            if fleet is not None and self._pause is not None:
                # Set before the pause is sent: a cancellation may land it without telling us, and a
                # resume of an engine that was not paused is harmless.
                self._paused = True
                # The pause first: its HTTP requests go out before the bus read, which then hides behind them.
                paused, taken = await asyncio.gather(
                    self._timed("pause", fleet.pause(self._pause)),
                    self._timed("take", counter.take(version, self.lora)),
                    return_exceptions=True,
                )
                if isinstance(taken, BaseException):
                    raise taken
                if isinstance(paused, BaseException):
                    raise paused
            else:
                with self._timing("take"):
                    await counter.take(version, self.lora)
            self.version = version
            if fleet is not None:
                with self._timing("relabel"):
                    # Before the push: a push that carries weight_version would hide a restarted engine's "default".
                    labels = await fleet.read_versions()
                    known = counter.state  # after the take
                    await alert_unexpected_labels(
                        self._bus, known.policy, known.trainer_id, version, known.version, labels
                    )
                    self._before = {url: label for url, label in labels.items() if isinstance(label, str)}
                    covered = cover(
                        self._before,
                        push=self.push,
                        lora=self.lora is not None,
                        previous=known.version,
                        lineage=known.lineage,
                    )
                    self.missing = covered.missing
                    if not self.labels:
                        await self._mark_pending(fleet, version)
        except BaseException as failure:
            turn.active = False
            self._phase = "failed"  # begin() cleaned up after itself: there is nothing to end
            try:
                if self._pending:
                    # Some engine may carry the pending label, or a failed relabel left it in doubt: quarantine.
                    await self._cleanup("update_failed", failure)
                    raise
                if self._paused:
                    # Nothing was pushed yet, so the labels still match the weights: resume, no quarantine.
                    # (A fenced publisher's pause is undone too; see the module docstring.)
                    assert fleet is not None
                    self._paused = False
                    try:
                        await self._timed("resume", asyncio.shield(fleet.resume()))
                    except EngineError as exc:
                        failure.add_note(f"resuming the engines afterwards failed too: {exc}")
                raise
            finally:
                self._observe()
        self._phase = "begun"
        self._pushing = time.perf_counter()
        log.info("update started", extra={"policy": known.policy, "version": version, "paused": self._paused})
        return version

    async def commit(self) -> None:
        """Stamp, read back, announce, resume (steps 5 to 7): the update's successful end.

        Raises:
            RuntimeError: the update was not begun, or it is over.
            FencedError, PublishError, PushCoverageError, EngineError: the update failed; the engines
                were quarantined and resumed, nothing was announced.
        """
        self._end("commit")
        counter, fleet = self._counter, self._fleet
        assert self.version is not None
        try:
            try:
                self._check_artifact(self.version)
                engines: tuple[str, ...] = ()
                if fleet is not None:
                    with self._timing("stamp"):
                        await self._leave_out_missing(fleet, self.version)
                        covered = [url for url in fleet.urls if url not in self.missing]
                        known = counter.state
                        self.stamps = await stamp_and_verify(
                            fleet,
                            self.version,
                            bus=self._bus,
                            policy=known.policy,
                            trainer_id=known.trainer_id,
                            lora=self.lora,
                            previous=known.version,
                            report_applied=False,
                            before_stamp=counter.check_owner,
                            engines=covered,
                            expect=str(self.version) if self.labels else pending_label(self.version),
                        )
                        engines = tuple(s.engine for s in self.stamps)
                # The announcement alone: the only bus round trip between the stamp and the resume.
                with self._timing("announce"):
                    self.event = await counter.announce(self.version, self.lora, engines, self.artifact)
            except BaseException as failure:
                if isinstance(failure, FencedError):
                    reason = "fenced"
                elif isinstance(failure, PublishError | asyncio.CancelledError) and self.stamps:
                    reason = "publish_failed"
                else:
                    reason = "update_failed"
                await self._cleanup(reason, failure)
                raise
            if fleet is not None:
                await self._resume_and_report()
            else:
                await counter.after_announcement()
        finally:
            self._turn.active = False
            self._observe()

    def _check_artifact(self, version: int) -> None:
        """Refuse, before any engine is stamped, an announcement the bus would not carry (the codec's own check)."""
        if self.artifact is not None:  # an artifact's per-tensor digests are what can outgrow MAX_EVENT_BYTES
            urls = self._fleet.urls if self._fleet is not None else ()
            encode(self._counter.announcement(version, self.lora, urls, self.artifact))

    async def abort(self, exc: BaseException) -> None:
        """End the update after ``exc`` (the push failed): quarantine and resume the engines, announce nothing.

        The version stays used up. ``exc`` is not raised here: the caller raises it (notes about the
        cleanup are added to it).

        Raises:
            RuntimeError: the update was not begun, or it is over.
        """
        self._end("abort")
        counter = self._counter
        try:
            log.warning(
                "update aborted; nothing announced, the version stays used up",
                extra={"policy": counter.state.policy, "version": self.version, "error": repr(exc)},
            )
            # A block that learnt it is fenced (before_push) pushed nothing more; say why it stopped.
            await self._cleanup("fenced" if isinstance(exc, FencedError) else "update_failed", exc)
        finally:
            self._turn.active = False
            self._observe()

    def _end(self, phase: str) -> None:
        if self._phase != "begun":
            raise RuntimeError(f"{phase}() belongs to a begun update; this one is {self._phase}")
        self._phase = "over"
        if self._pushing is not None:
            self.phases["push"] = time.perf_counter() - self._pushing

    async def __aenter__(self) -> int:
        return await self.begin()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.commit()
        else:
            await self.abort(exc)

    async def _leave_out_missing(self, fleet: EngineFleet, version: int) -> None:
        """Quarantine and alert the engines the push did not cover; raise if it covered none."""
        if not self.missing:
            return
        if len(self.missing) == len(fleet.urls):
            raise PushCoverageError(version, self.missing)
        counter = self._counter
        label = quarantine_label(version)
        results = await fleet.relabel(label, timeout=_CLEANUP_TIMEOUT, engines=self.missing)
        failed = [err for err in results.values() if err is not None]
        if failed:
            raise failed[0]  # an uncovered engine that keeps a number: the whole update is quarantined
        labels = {url: self._before[url] for url in self.missing}
        known = counter.state
        await alert_uncovered(self._bus, known.policy, known.trainer_id, version, labels, label)

    async def _resume_and_report(self) -> None:
        """Resume the fleet; beside it, publish the engines' ``WeightApplied`` read-backs (monitoring only) and
        the counter's mark for the number the announcement reserved ahead (``after_announcement``: written
        ``mark_delay`` later unless that is 0)."""
        counter, fleet = self._counter, self._fleet
        assert fleet is not None and self.version is not None
        known = counter.state
        applied = publish_applied(self._bus, known.policy, known.trainer_id, self.version, self.lora, self.stamps)
        marked = counter.after_announcement()
        if not self._paused:
            resumed = None
            reported, covered = await asyncio.gather(applied, marked, return_exceptions=True)
        else:
            self._paused = False
            # Shielded: the version is announced, so a cancellation here must not leave the fleet paused.
            resume = asyncio.shield(self._timed("resume", fleet.resume()))
            resumed, reported, covered = await asyncio.gather(resume, applied, marked, return_exceptions=True)
        if isinstance(covered, BaseException):
            raise covered  # after_announcement raises only what is not a bus failure (a cancellation)
        if isinstance(reported, BaseException):
            if not isinstance(reported, Exception):
                raise reported
            log.error(
                "the engines' WeightApplied read-backs were not published; the version was",
                extra={"policy": known.policy, "version": self.version, "error": repr(reported)},
            )
        if isinstance(resumed, BaseException):
            raise resumed

    async def _cleanup(self, reason: str, failure: BaseException) -> None:
        """Quarantine, alert and (maybe) resume; shielded so that a second cancellation cannot skip it."""
        task = asyncio.ensure_future(self._quarantine(reason, failure))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            failure.add_note("the update was cancelled again during its cleanup; the cleanup went on")
            raise

    async def _quarantine(self, reason: str, failure: BaseException) -> None:
        counter, fleet = self._counter, self._fleet
        assert self.version is not None
        if fleet is None:
            return
        label = quarantine_label(self.version)
        with self._timing("quarantine"):
            await self._quarantine_and_alert(fleet, label, reason, failure)
        if self._paused:
            self._paused = False
            try:
                await self._timed("resume", fleet.resume())
            except EngineError as exc:
                policy = counter.state.policy
                log.error("resume after a failed update failed", extra={"policy": policy, "error": str(exc)})
                failure.add_note(f"resuming the engines afterwards failed too: {exc}")

    async def _quarantine_and_alert(self, fleet: EngineFleet, label: str, reason: str, failure: BaseException) -> None:
        assert self.version is not None
        known = self._counter.state
        policy = known.policy
        results = await fleet.relabel(label, timeout=_CLEANUP_TIMEOUT)
        failed = tuple(url for url, err in results.items() if err is not None)
        for url, err in results.items():
            if err is not None:
                failure.add_note(f"quarantining {url} failed: {err}")
        # The alert goes out while the engines are still paused, so a watcher has it before any sample from
        # a quarantined engine can be generated; ``resumed`` says this publisher resumes them right after.
        resumes = self._paused
        alert = FleetQuarantined(
            policy=policy,
            label=label,
            reason=reason,
            version=self.version,
            trainer_id=known.trainer_id,
            published_at=now(),
            engines=tuple(url for url, err in results.items() if err is None),
            failed=failed,
            resumed=resumes,
            detail=f"{type(failure).__name__}: {failure}"[:500],
        )
        self.quarantined = alert
        log.error(
            "engines quarantined after a failed update",
            extra={"policy": policy, "version": self.version, "reason": reason, "label": label, "resumed": resumes},
        )
        try:
            msg_id = f"{policy}:quarantine:{known.incarnation}:{self.version}"
            # Bounded: a bus that is away (often why the update failed) must not hold the fleet paused.
            async with asyncio.timeout(_CLEANUP_TIMEOUT):
                await self._bus.publish(subjects.alerts(policy), alert, msg_id=msg_id)
        except (BusError, TimeoutError) as exc:
            log.error("could not publish the quarantine alert", extra={"policy": policy, "error": repr(exc)})
            failure.add_note(f"the FleetQuarantined alert was not published: {exc!r}")
