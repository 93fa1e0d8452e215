"""``FencedCounter``: the one owner of a policy's weight-version counter, fenced over JetStream.

Every event is a conditional publish on this instance's own previous event, so the bus decides who owns the counter;
a number is used up before any engine may carry it and never issued again; only another owner's event is a fence.
It knows nothing of engines. The update order: docs/design.md#the-update-protocol-step-by-step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Final

from weightbus.bus import subjects
from weightbus.bus.history import History, read_subject_history
from weightbus.bus.protocol import Bus, Envelope, PublishAck
from weightbus.errors import BusError, CounterExhaustedError, FencedError, PublishError, SequenceConflictError
from weightbus.producers.coverage import Lineage, fold_lineage
from weightbus.producers.highwater import HighWaterMark
from weightbus.rules.chain import TrackerState
from weightbus.rules.history import WeightsHistory, fold_history
from weightbus.rules.marks import unexplained_mark_alert, unexplained_mark_alert_id
from weightbus.rules.standing import outranks, owner_standing
from weightbus.schemas import (
    MAX_VERSION,
    ClaimStanding,
    EngineOutOfSync,
    LoraAdapter,
    PublisherClaimed,
    VersionRejected,
    VersionReserved,
    WeightArtifact,
    WeightUpdated,
    now,
)

__all__ = ["CounterState", "FencedCounter"]

log = logging.getLogger("weightbus.producers")

_RESOLVE_ATTEMPTS: Final = 3


@dataclass(frozen=True, slots=True)
class CounterState:
    """A snapshot of what a ``FencedCounter`` knows (``FencedCounter.state``).

    Attributes:
        policy: the policy id.
        subject: the weights subject the counter lives on.
        trainer_id: the readable identity on the bus.
        incarnation: this instance's unique id on the bus.
        epoch: the epoch claimed (None before ``claim()``).
        version: the current announced version (None for a policy that never announced one).
        issued: the highest number this counter ever issued (reserved or announced); 0 for none.
        next_version: the number the next ``take`` uses: the one our last announcement reserved, else a new one.
        claimed: whether ``claim()`` succeeded.
        fenced: the ``FencedError`` once another publisher took over (every later call raises it).
        last_event: the last ``WeightUpdated`` this counter had acknowledged.
        lineage: what the announcements since the engines booted say about the weights
            (``producers.coverage``): folded from the history ``claim()`` read (unknown unless it
            reaches the policy's first claim and the engines' labels agree with it), then kept by
            ``take`` and the announcements.
    """

    policy: str
    subject: str
    trainer_id: str
    incarnation: str
    epoch: int | None
    version: int | None
    issued: int
    next_version: int
    claimed: bool
    fenced: FencedError | None
    last_event: WeightUpdated | None
    lineage: Lineage


class FencedCounter:
    """The fenced version counter of one policy; see the module docstring.

    Args:
        bus: the bus (borrowed; not closed here).
        policy: the policy id.
        trainer_id: the readable identity on the bus.
        incarnation: this instance's unique id on the bus.
        claim_attempts: how often ``claim()`` re-reads and retries when another publisher claims at
            the same moment.
        reserve_next: every announcement also reserves the next number (``reserves_next``).
        mark_delay: seconds the mark after an announcement (``after_announcement``) waits before it is
            written, so that it never competes with the announcement's delivery to the trackers; the
            next ``take`` and ``settle`` write it sooner. 0 writes it at once.

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
    """

    def __init__(
        self,
        bus: Bus,
        policy: str,
        *,
        trainer_id: str,
        incarnation: str,
        claim_attempts: int,
        reserve_next: bool,
        mark_delay: float = 0.0,
    ) -> None:
        self._subject = subjects.weights(policy)
        self._bus = bus
        self._policy = policy
        self._trainer_id = trainer_id
        self._incarnation = incarnation
        self._claim_attempts = max(1, claim_attempts)
        self._reserve_next = reserve_next
        self._epoch: int | None = None
        self._version: int | None = None
        self._issued = 0
        self._pre: int | None = None  # the number our newest event reserved for our next take
        self._entered = 0  # the highest number a take of this instance used
        self._seq: int | None = None
        self._fenced: FencedError | None = None
        self._last_event: WeightUpdated | None = None
        self._mark = HighWaterMark(
            bus, policy, trainer_id=trainer_id, incarnation=incarnation, confirm_owner=self.check_owner
        )
        self._lineage = Lineage.UNKNOWN
        self._standing: ClaimStanding | None = None
        self._mark_delay = max(0.0, mark_delay)
        self._deferred: asyncio.Task[None] | None = None  # the mark after the last announcement, waiting
        self._deferred_writing = False  # the deferred task is past its wait: cancelling it could split a write

    # -- read-only state ---------------------------------------------------------------------------

    @property
    def state(self) -> CounterState:
        """What the counter knows now, as one frozen snapshot (read it again for later values)."""
        return CounterState(
            policy=self._policy,
            subject=self._subject,
            trainer_id=self._trainer_id,
            incarnation=self._incarnation,
            epoch=self._epoch,
            version=self._version,
            issued=self._issued,
            next_version=self._next_version(),
            claimed=self._epoch is not None,
            fenced=self._fenced,
            last_event=self._last_event,
            lineage=self._lineage,
        )

    def _next_version(self) -> int:
        """The number the next ``take`` uses: the one our last announcement reserved, else a new one."""
        return self._issued if self._holds(self._issued) else self._issued + 1

    def _holds(self, version: int) -> bool:
        """Whether ``version`` is used up on the bus by our newest event and no take used it yet."""
        return self._pre == version == self._issued and version > self._entered

    # -- claiming ----------------------------------------------------------------------------------

    async def claim(
        self,
        *,
        engine_high: int | None = None,
        engines: Sequence[str] = (),
        floor: int | None = None,
        standing: ClaimStanding | None = None,
        outrank: bool = False,
    ) -> None:
        """Resume the counter and claim it, fencing any previous owner.

        The counter resumes above the highest of: the number the retained weights history shows as
        issued, the counter's high-water mark, ``engine_high`` and ``floor``.

        Args:
            engine_high: the highest numeric label any engine carries (None: no fleet, or no label).
            engines: the engines' URLs (named in the alert when they are ahead of the bus).
            floor: a number the trainer knows was issued (its checkpoint's version), or None.
            standing: where the host's failover order puts this claimant (recorded on the claim and
                on every mark this counter writes), or None.
            outrank: claim only over an owner whose standing ``standing`` outranks
                (``rules.standing.outranks``: the host picked this claimant after the owner); the
                check reads the same history the claim is conditional on, so no claim slips in
                between. For a publisher that was fenced and is claiming again.

        Raises:
            FencedError: ``outrank`` and the owner's standing is not below ``standing`` (or unknown):
                nothing was published.
            PublishError: the claim could not be stored, or other publishers kept claiming
                ``claim_attempts`` times in a row.
            BusError: the history or the mark could not be read.
        """
        for attempt in range(1, self._claim_attempts + 1):
            marks, history = await self._read_both()
            folded = fold_history(self._policy, history.events, marks=marks.events)
            if outrank:
                self._check_outranks(history, marks, folded, standing)
            version, issued, high_epoch = _fold(folded)
            await self._report_unexplained(folded)
            # Only the mark the rule credits raises the counter, and only it covers a number: a newer mark
            # it refused is superseded by this owner's first take (a write conditional on the newest one).
            mark = folded.mark
            self._mark.adopt(marks.last_seq, mark.version if mark is not None else 0)
            last = history.last_valid
            previous = last.event.trainer_id if last is not None else None  # type: ignore[union-attr]
            history_issued = issued
            if mark is not None:
                if mark.version > issued:
                    log.error(
                        "the weights history is behind the counter's high-water mark (its events were evicted, "
                        "purged or overwritten); resuming above the mark",
                        extra={"policy": self._policy, "history_issued": issued, "mark": mark.version},
                    )
                    issued = mark.version
                if mark.announced is not None and (version is None or mark.announced > version):
                    version = mark.announced
            if floor is not None and floor > issued:
                log.warning(
                    "the trainer's checkpoint is ahead of the bus's counter; resuming above it",
                    extra={"policy": self._policy, "issued": issued, "floor": floor},
                )
                issued = floor
            if engine_high is not None and engine_high > issued:
                await self._counter_behind_engines(issued, engine_high, engines, history)
                issued = engine_high
            if engine_high is not None and (version is None or engine_high > version):
                version = engine_high  # an engine carries it: it was announced, even if the mark lags
            self._standing = self._mark.standing = standing
            claim = await self._claim(high_epoch + 1, version, issued, previous, history.last_seq)
            if claim is not None:
                if self._next_version() > MAX_VERSION:
                    log.error(
                        "claimed an exhausted counter: every update will raise CounterExhaustedError",
                        extra={"policy": self._policy, "issued": issued},
                    )
                # The mark, a checkpoint or engines ahead of the history: it was lost, and with it
                # what the weights are.
                behind = issued > history_issued
                lineage = fold_lineage(e.event for e in history.events).claimed(claim, first=not history.events)
                self._lineage = Lineage.UNKNOWN if behind else lineage
                return
            log.info(
                "another publisher claimed at the same time; re-reading",
                extra={"policy": self._policy, "attempt": attempt},
            )
        raise PublishError(self._subject, f"could not claim the counter in {self._claim_attempts} attempts")

    async def _read_both(self) -> tuple[History, History]:
        """The counter subject's retained marks, then the weights history (the order ``rules.marks`` needs)."""
        # The marks before the history: every event that explains one is in the history read after it.
        marks = await read_subject_history(self._bus, subjects.counter(self._policy))
        history = await read_subject_history(self._bus, self._subject)
        return marks, history

    async def check_outranks(self, standing: ClaimStanding | None) -> None:
        """Two reads (the marks, the weights history): ``FencedError`` unless ``standing`` outranks the owner's.

        A read-only look before a claim with ``outrank=True`` (which checks again, atomically), so
        that a publisher that may not claim again learns it without touching anything else.

        Raises:
            FencedError: the owner's standing is not below ``standing``, or unknown.
            BusError: the bus did not answer.
        """
        marks, history = await self._read_both()
        folded = fold_history(self._policy, history.events, marks=marks.events)
        self._check_outranks(history, marks, folded, standing)

    def _check_outranks(
        self, history: History, marks: History, folded: WeightsHistory, standing: ClaimStanding | None
    ) -> None:
        """Raise ``FencedError`` unless ``standing`` outranks the standing the owner claimed with.

        The owner's standing is read from its claim or its credited mark (``rules.standing``), the
        marks judged by the same rule as the claim's resume (``rules.marks``).
        """
        state = folded.state
        if not state.has_owner:
            return  # nobody to outrank: the history is gone, and the claim resumes above the mark
        owner = owner_standing(self._policy, history.events, marks=marks.events)
        if outranks(standing, owner):
            log.warning(
                "claiming the counter again: the host picked this publisher after the owner",
                extra={
                    "policy": self._policy,
                    "owner": state.publisher,
                    "owner_standing": _show(owner),
                    "standing": _show(standing),
                },
            )
            return
        assert state.publisher is not None and state.epoch is not None
        err = FencedError(self._policy, state.publisher, state.epoch, state.version)
        err.add_note(
            f"not claimed again: this publisher's standing {_show(standing)} does not outrank the owner's "
            f"{_show(owner)} (the host did not pick it after the owner)"
        )
        raise err

    async def _claim(
        self, epoch: int, version: int | None, issued: int, previous: str | None, seq: int
    ) -> PublisherClaimed | None:
        claim = PublisherClaimed(
            policy=self._policy,
            epoch=epoch,
            trainer_id=self._trainer_id,
            published_at=now(),
            version=version,
            previous_trainer_id=previous,
            incarnation=self._incarnation,
            reserved=issued or None,
            standing=self._standing,
        )
        try:
            ack = await self._bus.publish(
                self._subject, claim, msg_id=f"{self._policy}:claim:{epoch}:{self._incarnation}", expected_last_seq=seq
            )
        except SequenceConflictError:
            return None
        self._epoch, self._version, self._issued, self._seq = epoch, version, issued, ack.seq
        self._pre = None  # a new epoch's first take stores its own reservation
        log.info(
            "claimed the version counter",
            extra={
                "policy": self._policy,
                "trainer_id": self._trainer_id,
                "incarnation": self._incarnation,
                "epoch": epoch,
                "version": version,
                "issued": issued,
                "previous_trainer_id": previous,
            },
        )
        return claim

    async def _report_unexplained(self, folded: WeightsHistory) -> None:
        """Log and alert (once: not when retained) each mark the rule refused: ignored, never resumed above."""
        if not folded.unexplained_marks:
            return
        try:
            alerts = await read_subject_history(self._bus, subjects.alerts(self._policy))
        except BusError as exc:
            log.warning("could not read retained alerts; alerting anyway", extra={"error": repr(exc)})
            alerted: set[int | None] = set()
        else:
            alerted = {
                e.event.event_seq
                for e in alerts.events
                if isinstance(e.event, VersionRejected) and e.event.reason == "unexplained_mark"
            }
        for refused in folded.unexplained_marks:
            mark = refused.mark
            log.error(
                "the counter's high-water mark says more was issued than the weights chain explains; "
                "ignored (an unexplained mark)",
                extra={
                    "policy": self._policy,
                    "mark": mark.version,
                    "announced": mark.announced,
                    "mark_seq": refused.seq,
                    "chain_seen": refused.seen,
                    "writer": mark.trainer_id,
                },
            )
            if refused.seq in alerted:
                continue
            alert = unexplained_mark_alert(
                self._policy, refused, observer=f"trainer:{self._trainer_id}", published_at=now()
            )
            try:
                await self._bus.publish(
                    subjects.alerts(self._policy), alert, msg_id=unexplained_mark_alert_id(self._policy, refused.seq)
                )
            except BusError as exc:
                log.error("could not publish the unexplained-mark alert", extra={"error": repr(exc)})

    async def _counter_behind_engines(
        self, issued: int, engine_high: int, engines: Sequence[str], history: History
    ) -> None:
        """The engines carry a number the bus never issued: the history was lost; say so, loudly."""
        log.error(
            "the engines carry a higher version than the bus's history: the history was lost; resuming above it",
            extra={"policy": self._policy, "bus_issued": issued, "engine_high": engine_high, "seq": history.last_seq},
        )
        alert = EngineOutOfSync(
            policy=self._policy,
            engine=",".join(engines),
            expected=str(issued or "none"),
            actual=str(engine_high),
            trainer_id=self._trainer_id,
            published_at=now(),
            reason="counter_behind_engines",
        )
        msg_id = f"{self._policy}:counter_behind:{issued}:{engine_high}:{self._incarnation}"
        try:
            await self._bus.publish(subjects.alerts(self._policy), alert, msg_id=msg_id)
        except PublishError as exc:
            log.error("could not publish the counter alert", extra={"policy": self._policy, "error": str(exc)})

    # -- the protocol steps ------------------------------------------------------------------------

    def check_ceiling(self) -> None:
        """Raise ``CounterExhaustedError`` when the next number would exceed ``MAX_VERSION``.

        Raises:
            CounterExhaustedError: ``MAX_VERSION`` was issued (a new policy id is the way on).
        """
        if self._next_version() > MAX_VERSION:
            log.error(
                "the version counter is exhausted; publish under a new policy id",
                extra={"policy": self._policy, "issued": self._issued},
            )
            raise CounterExhaustedError(self._subject, self._policy, self._issued)

    async def take(self, version: int, lora: LoraAdapter | None) -> None:
        """Take ``version`` (``next_version``), fenced: a read if our last event reserved it, else a reservation.

        From here on ``version`` is never issued again, whatever follows. A ``lora`` take is an
        adapter load and nothing else (the lineage keeps the base as it was); any other may change it.

        Raises:
            CounterExhaustedError: ``version`` is above ``MAX_VERSION`` (nothing was published).
            FencedError, PublishError: as a conditional publish (nothing was taken; a retry takes the
                same number).
        """
        if version > MAX_VERSION:
            raise CounterExhaustedError(self._subject, self._policy, self._issued)
        if self._fenced is not None:
            raise self._fenced
        await self._drop_deferred()  # this take writes the mark itself when it does not cover the number
        step = self._take_held(version, lora) if self._holds(version) else self.reserve(version, lora)
        if version > self._mark.covers:
            # Beside the fence: the mark must cover the number before any engine may carry it.
            assert self._epoch is not None
            cover = self._mark.cover(version, epoch=self._epoch, announced=self._version, issued=self._issued)
            await _both(step, cover)
        else:
            await step
        self._entered = max(self._entered, version)
        self._lineage = self._lineage.taken(version, lora_only=lora is not None)

    async def _take_held(self, version: int, lora: LoraAdapter | None) -> None:
        await self.check_owner()
        if not self._holds(version):  # resolving doubt moved the counter (a later event of ours)
            await self.reserve(version, lora)

    async def reserve(self, version: int, lora: LoraAdapter | None) -> None:
        """Store ``VersionReserved(version)``; the number is used up from here on, whatever follows.

        Raises:
            FencedError, PublishError: as a conditional publish.
        """
        assert self._epoch is not None
        event = VersionReserved(
            policy=self._policy,
            version=version,
            epoch=self._epoch,
            trainer_id=self._trainer_id,
            published_at=now(),
            incarnation=self._incarnation,
            lora=lora,
        )
        # A reservation that fails is retried by the next update with the same number and message id: if it
        # had landed, the bus deduplicates it (and resolve() adopts it), so an outage does not burn numbers.
        await self._conditional(event, f"{self._policy}:reserve:{self._incarnation}:{version}")
        self._issued = max(self._issued, version)
        # Ours to take until a take completes: a take that failed beside it (the mark) retries this number.
        self._pre = max(self._pre or 0, version)

    def announcement(
        self,
        version: int,
        lora: LoraAdapter | None,
        engines: Sequence[str] = (),
        artifact: WeightArtifact | None = None,
    ) -> WeightUpdated:
        """The ``WeightUpdated`` that ``announce`` would store now (checked by its constructor, not sent).

        Raises:
            ValueError: ``artifact`` contradicts the event (its base not below ``version``, a full one with ``lora``).
        """
        assert self._epoch is not None
        return WeightUpdated(
            policy=self._policy,
            version=version,
            epoch=self._epoch,
            trainer_id=self._trainer_id,
            published_at=now(),
            lora=lora,
            engines=tuple(engines),
            incarnation=self._incarnation,
            reserves_next=self._reserve_next and version < MAX_VERSION,
            artifact=artifact,
        )

    async def announce(
        self,
        version: int,
        lora: LoraAdapter | None,
        engines: Sequence[str] = (),
        artifact: WeightArtifact | None = None,
    ) -> WeightUpdated:
        """Store ``WeightUpdated(version)``: the engines serve it and trackers may take it.

        Args:
            version: the number taken.
            lora: the adapter the push loaded, or None.
            engines: the engines that were stamped and read back.
            artifact: where the trainer wrote the weights, when it says (``WeightUpdated.artifact``).

        Raises:
            FencedError, PublishError: as a conditional publish.
            ValueError, UnsendableEventError: as ``announcement``, or the event is over ``MAX_EVENT_BYTES``.
        """
        event = self.announcement(version, lora, engines, artifact)
        msg_id = f"{self._policy}:{self._epoch}:{version}:{self._incarnation}"
        ack = await self._conditional(event, msg_id)
        self._adopt_announced(event)
        log.info(
            "published weight version",
            extra={"policy": self._policy, "version": version, "epoch": self._epoch, "seq": ack.seq},
        )
        return event

    async def after_announcement(self) -> None:
        """The mark after an acknowledged announcement: written now (``mark_delay`` 0), else deferred.

        Deferred, it is written ``mark_delay`` seconds later in a task of its own, unless the next
        ``take`` (which then writes the mark itself, beside its read of the subject) or ``settle``
        comes first. Nothing depends on it being written: each take covers its own number before any
        engine may carry it. It records ``announced`` early, for a successor that finds the weights
        history gone, and saves the next take a write.

        Raises:
            BaseException: as ``cover_announced`` (only when written now).
        """
        if self._mark_delay <= 0:
            await self.cover_announced()
            return
        await self._drop_deferred()
        if self._uncovered() is None:
            return  # nothing to write (reserve_next=False: the take covered the number announced)
        self._deferred_writing = False
        task = asyncio.create_task(self._deferred_cover(), name=f"weightbus-mark-{self._policy}")
        task.add_done_callback(_report_deferred)
        self._deferred = task

    async def _deferred_cover(self) -> None:
        await asyncio.sleep(self._mark_delay)
        self._deferred_writing = True
        await self.cover_announced()

    async def settle(self) -> None:
        """Write the deferred mark now, if one waits (a publisher that stops, or a caller that reads it next).

        Raises:
            BaseException: anything but a ``BusError`` or ``FencedError`` (a cancellation).
        """
        if self._deferred is None:
            return
        await self._drop_deferred()
        await self.cover_announced()  # nothing to do when the write it let land covered the number

    async def _drop_deferred(self) -> None:
        """Cancel a deferred mark that still waits (its write may be in flight: then let it land)."""
        task, self._deferred = self._deferred, None
        if task is None or task.done():
            return
        if not self._deferred_writing:
            task.cancel()
        await asyncio.wait([task])  # writing: the caller reads what it stored

    async def cover_announced(self) -> None:
        """Write the mark for the number the last announcement reserved ahead, unless it already covers it.

        Called after the announcement is acknowledged (``after_announcement``): off the path from the
        push to the trackers. A write that fails is logged and not raised: the engines carry the
        announced version, which its take covered, and the next take covers the reserved number before
        any engine may carry it.

        Raises:
            BaseException: anything but a ``BusError`` or ``FencedError`` (a cancellation).
        """
        ahead = self._uncovered()
        if ahead is None:
            return
        event = self._last_event
        assert event is not None and self._epoch is not None  # _uncovered: an announcement of this epoch
        try:
            await self._mark.cover(ahead, epoch=self._epoch, announced=self._version, issued=self._issued)
        except BusError as exc:
            log.error(
                "the counter's mark was not written after the announcement; the next take writes it",
                extra={"policy": self._policy, "version": event.version, "error": repr(exc)},
            )
        except FencedError as exc:
            log.warning(
                "fenced before the counter's mark after the announcement was written; the new owner's mark stands",
                extra={"policy": self._policy, "version": event.version, "owner": exc.owner},
            )

    def _uncovered(self) -> int | None:
        """The number the last announcement reserved ahead (or announced), when no stored mark covers it yet."""
        event = self._last_event
        if event is None or self._epoch is None:
            return None
        ahead = event.version + 1 if event.reserves_next else event.version
        return ahead if ahead > self._mark.covers else None

    async def check_owner(self) -> None:
        """One read: raise ``FencedError`` if another owner has written since our last event (resolving doubt)."""
        if self._fenced is not None:
            raise self._fenced
        if await self._bus.last_seq(self._subject) != self._seq:
            await self.resolve()

    async def resolve(self) -> None:
        """The subject moved past our last known event: adopt our own later event, re-claim a lost history, or fence.

        Raises:
            FencedError: the newest valid event belongs to another owner.
        """
        history = await read_subject_history(self._bus, self._subject)
        last = history.last_valid
        # Events after our newest one that the trackers' rule rejects (a forged claim) do not fence us.
        folded = fold_history(self._policy, history.events) if last is not None and not self._is_mine(last) else None
        if folded is not None and folded.latest_rejected and self._owns(folded.state):
            last = next(e for e in reversed(history.events) if e.seq == folded.last_accepted_seq)
        if last is not None and self._is_mine(last):
            event = last.event
            if isinstance(event, WeightUpdated):
                self._adopt_announced(event)
            elif isinstance(event, VersionReserved):
                self._issued = max(self._issued, event.version)
            log.warning(
                "resolved a publish in doubt: the subject's newest valid event is ours",
                extra={"policy": self._policy, "seq": last.seq, "stored": history.last_seq, "skipped": history.invalid},
            )
            self._seq = history.last_seq
            return
        if last is None:
            log.error(
                "the weights history is gone (purged or the stream was recreated); re-claiming with the counter held",
                extra={"policy": self._policy, "version": self._version, "issued": self._issued},
            )
            assert self._epoch is not None
            if await self._claim(self._epoch + 1, self._version, self._issued, None, history.last_seq) is not None:
                return  # the lineage stays: this instance saw every update since its claim
            return await self.resolve()
        raise self._fence(last)

    # -- the conditional publish -------------------------------------------------------------------

    def _owns(self, state: TrackerState) -> bool:
        return (state.epoch, state.incarnation, state.publisher) == (self._epoch, self._incarnation, self._trainer_id)

    def _is_mine(self, env: Envelope) -> bool:
        event = env.event
        if not isinstance(event, WeightUpdated | PublisherClaimed | VersionReserved):
            return False
        return event.incarnation == self._incarnation and event.epoch == self._epoch

    async def _conditional(self, event: WeightUpdated | VersionReserved, msg_id: str) -> PublishAck:
        """Publish ``event`` conditional on our last event; resolve a conflict or fence."""
        if self._fenced is not None:
            raise self._fenced
        for _ in range(_RESOLVE_ATTEMPTS):
            assert self._seq is not None
            try:
                ack = await self._bus.publish(self._subject, event, msg_id=msg_id, expected_last_seq=self._seq)
            except SequenceConflictError:
                await self.resolve()
                continue
            self._seq = ack.seq
            return ack
        raise PublishError(self._subject, f"the subject kept moving under {_RESOLVE_ATTEMPTS} resolutions")

    def _adopt_announced(self, event: WeightUpdated) -> None:
        version = event.version
        self._version = version if self._version is None else max(self._version, version)
        if event.reserves_next:
            self._issued = max(self._issued, version + 1)
            self._pre = version + 1
        else:
            self._issued = max(self._issued, version)
        if event != self._last_event:  # resolving doubt may adopt the announcement we already hold
            lora = event.lora is not None
            self._lineage = self._lineage.announced(version, lora=lora, reserves_next=event.reserves_next)
        self._last_event = event

    def _fence(self, last: Envelope) -> FencedError:
        event = last.event
        assert isinstance(event, WeightUpdated | PublisherClaimed | VersionReserved)
        version = event.version if not isinstance(event, VersionReserved) else self._version
        err = FencedError(self._policy, event.trainer_id, event.epoch, version)
        self._fenced = err
        log.error(
            "fenced: another publisher owns the counter",
            extra={
                "policy": self._policy,
                "trainer_id": self._trainer_id,
                "owner": err.owner,
                "epoch": err.epoch,
                "incarnation": self._incarnation,
            },
        )
        return err


def _show(standing: ClaimStanding | None) -> str:
    if standing is None:
        return "(none)"
    return f"(scope {standing.scope}, term {standing.term}, rank {standing.rank})"


def _report_deferred(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("the deferred counter mark failed", extra={"error": repr(exc)})


async def _both(first: Awaitable[None], second: Awaitable[None]) -> None:
    """Await both concurrently; raise the first one's failure, else the second's."""
    results = await asyncio.gather(first, second, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _fold(folded: WeightsHistory) -> tuple[int | None, int, int]:
    """``(current version, highest number issued, highest epoch)`` over a folded weights history.

    The history is folded with the trackers' rule (``rules.history.fold_history``), so a version no
    tracker accepts (a rogue's, a forged jump) never becomes the counter's.
    """
    state = folded.state
    return state.version, max(state.reserved or 0, state.version or 0), folded.epoch_high
