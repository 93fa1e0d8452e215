"""``VersionPublisher``: the one owner of a policy's weight-version counter, fenced over JetStream.

Every event of the counter (claim, reservation, announcement) goes on ``weights(policy)`` as a
conditional publish on the sequence of this publisher's own previous event there, so the bus, not a
read before it, decides who owns the counter. Invariants:

* **A number names at most one set of weights.** ``v`` is used up on the bus before any engine
  may carry it: by the previous announcement (``WeightUpdated(v - 1, reserves_next=True)``, the
  common case, which leaves the update one fence check, a read) or by a ``VersionReserved(v)`` of
  its own (the first update after a claim, or after a failed update). A number an update entered
  with is never issued again, whatever happens to the update (exception, failed stamp, lost or
  refused announcement, cancellation): the next update takes ``v + 1``. A reservation that was not
  confirmed touched no engine, so the next update retries it with the same number and message id
  (stored once, whatever happened).
  ``start()`` resumes above the highest number ever issued that the retained history shows, and, with a
  fleet, above the highest numeric label any engine carries, so a lost history (purge, recreated stream,
  evicted events) never reissues a number.
* **One owner, per instance.** ``start()`` claims with epoch + 1 and a random ``incarnation``; two
  processes with the same ``trainer_id`` are two claimants, and the bus lets exactly one own the
  counter. Once another publisher has claimed, this one's next conditional publish is refused and
  it raises ``FencedError``; from then on it touches neither the counter nor the fleet's numbers.
* **Doubt is resolved, never guessed, and never taken for a fence.** A conditional publish that
  conflicts is resolved by reading the subject's history: if its newest valid event is this
  instance's own (a publish that landed although its caller was cancelled or timed out, or
  garbage stored after it), the publisher adopts that position and retries; if the history is gone
  (purge, recreated stream), it re-claims with the counter it holds; only an event of another
  owner is a fence (the owner by the trackers' rule: newer events that rule rejects, such as a
  forged claim, fence nothing). Stray payloads are skipped and counted, never raised.

``VersionUpdate`` (the ``update()`` context manager, module ``update``) runs the fleet side:
reserve, pause, push, stamp, verify, announce, resume, and quarantine on failure.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Final

from weightbus.bus import subjects
from weightbus.bus.history import History, read_subject_history
from weightbus.bus.protocol import Bus, Envelope, PublishAck
from weightbus.engines.sglang import PauseMode
from weightbus.errors import EngineError, FencedError, PublishError, SequenceConflictError
from weightbus.producers.stamping import EngineFleet
from weightbus.producers.update import VersionUpdate
from weightbus.rules.chain import TrackerState
from weightbus.rules.history import fold_history
from weightbus.schemas import (
    MAX_VERSION,
    EngineOutOfSync,
    LoraAdapter,
    PublisherClaimed,
    VersionReserved,
    WeightUpdated,
    now,
    parse_version,
)

__all__ = ["VersionPublisher", "default_trainer_id"]

log = logging.getLogger("weightbus.producers")

_CLAIM_ATTEMPTS: Final = 5
_RESOLVE_ATTEMPTS: Final = 3


def default_trainer_id() -> str:
    """``<hostname>:<pid>``: readable in a ``FencedError``; uniqueness comes from the incarnation."""
    return f"{socket.gethostname()}:{os.getpid()}"


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

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        ValueError: ``pause`` without a fleet.
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
    ) -> None:
        self.subject = subjects.weights(policy)
        if pause is not None and fleet is None:
            raise ValueError("pause needs an engine fleet")
        self.bus = bus
        self._policy = policy
        self._trainer_id = trainer_id or default_trainer_id()
        self.incarnation = incarnation or uuid.uuid4().hex[:16]
        self.fleet = fleet
        self.pause_mode: PauseMode | None = pause
        self._claim_attempts = max(1, claim_attempts)
        self._epoch: int | None = None
        self._version: int | None = None
        self._issued = 0
        self._reserve_next = reserve_next
        self._pre: int | None = None  # the number our newest event reserved for our next update
        self._entered = 0  # the highest number an update of this instance entered with
        self._seq: int | None = None
        self._fenced: FencedError | None = None
        self.active = False
        """Whether an ``update()`` of this publisher is in progress (updates are sequential)."""
        self.last_event: WeightUpdated | None = None
        """The last ``WeightUpdated`` this publisher had acknowledged."""

    # -- identity and state ------------------------------------------------------------------------

    @property
    def policy(self) -> str:
        """The policy id."""
        return self._policy

    @property
    def trainer_id(self) -> str:
        """This publisher's readable identity on the bus."""
        return self._trainer_id

    @property
    def epoch(self) -> int | None:
        """The epoch this publisher claimed (None before ``start()``)."""
        return self._epoch

    @property
    def version(self) -> int | None:
        """The current announced version (None for a policy that never announced one)."""
        return self._version

    @property
    def issued(self) -> int:
        """The highest number this counter ever issued (reserved or announced); 0 for none."""
        return self._issued

    @property
    def next_version(self) -> int:
        """The number the next ``update()`` will carry: the one our last announcement reserved, else a new one."""
        return self._issued if self._holds(self._issued) else self._issued + 1

    def _holds(self, version: int) -> bool:
        """Whether ``version`` is used up on the bus by our newest event and no update entered with it yet."""
        return self._pre == version == self._issued and version > self._entered

    @property
    def started(self) -> bool:
        """Whether ``start()`` claimed the counter."""
        return self._epoch is not None

    @property
    def fenced(self) -> FencedError | None:
        """The ``FencedError`` once another publisher took over (every later update raises it)."""
        return self._fenced

    # -- claiming ----------------------------------------------------------------------------------

    async def start(self) -> VersionPublisher:
        """Resume the counter from the bus (and the engines' labels) and claim it, fencing any previous owner.

        Returns:
            ``self``.

        Raises:
            PublishError: the claim could not be stored, or other publishers kept claiming
                ``claim_attempts`` times in a row.
            BusError: the history could not be read.
        """
        if self.started:
            return self
        engine_high = await self._engine_high()
        for attempt in range(1, self._claim_attempts + 1):
            history = await read_subject_history(self.bus, self.subject)
            version, issued, high_epoch = _fold(history, self._policy)
            last = history.last_valid
            previous = last.event.trainer_id if last is not None else None  # type: ignore[union-attr]
            if engine_high is not None and engine_high > issued:
                await self._counter_behind_engines(issued, engine_high, history)
                issued = engine_high
                if version is None or engine_high > version:
                    version = engine_high
            if await self._claim(high_epoch + 1, version, issued, previous, history.last_seq):
                return self
            log.info(
                "another publisher claimed at the same time; re-reading",
                extra={"policy": self._policy, "attempt": attempt},
            )
        raise PublishError(self.subject, f"could not claim the counter in {self._claim_attempts} attempts")

    async def _claim(self, epoch: int, version: int | None, issued: int, previous: str | None, seq: int) -> bool:
        claim = PublisherClaimed(
            policy=self._policy,
            epoch=epoch,
            trainer_id=self._trainer_id,
            published_at=now(),
            version=version,
            previous_trainer_id=previous,
            incarnation=self.incarnation,
            reserved=issued or None,
        )
        try:
            ack = await self.bus.publish(
                self.subject, claim, msg_id=f"{self._policy}:claim:{epoch}:{self.incarnation}", expected_last_seq=seq
            )
        except SequenceConflictError:
            return False
        self._epoch, self._version, self._issued, self._seq = epoch, version, issued, ack.seq
        self._pre = None  # a new epoch's first update stores its own reservation
        log.info(
            "claimed the version counter",
            extra={
                "policy": self._policy,
                "trainer_id": self._trainer_id,
                "incarnation": self.incarnation,
                "epoch": epoch,
                "version": version,
                "issued": issued,
                "previous_trainer_id": previous,
            },
        )
        return True

    async def _engine_high(self) -> int | None:
        if self.fleet is None:
            return None
        high: int | None = None
        for url, label in (await self.fleet.read_versions()).items():
            if isinstance(label, EngineError):
                log.warning("could not read an engine's label at start", extra={"engine": url, "error": str(label)})
                continue
            value = parse_version(label)
            if value is not None and (high is None or value > high):
                high = value
        return high

    async def _counter_behind_engines(self, issued: int, engine_high: int, history: History) -> None:
        """The engines carry a number the bus never issued: the history was lost; say so, loudly."""
        log.error(
            "the engines carry a higher version than the bus's history: the history was lost; resuming above it",
            extra={"policy": self._policy, "bus_issued": issued, "engine_high": engine_high, "seq": history.last_seq},
        )
        assert self.fleet is not None
        alert = EngineOutOfSync(
            policy=self._policy,
            engine=",".join(self.fleet.urls),
            expected=str(issued or "none"),
            actual=str(engine_high),
            trainer_id=self._trainer_id,
            published_at=now(),
            reason="counter_behind_engines",
        )
        msg_id = f"{self._policy}:counter_behind:{issued}:{engine_high}:{self.incarnation}"
        try:
            await self.bus.publish(subjects.alerts(self._policy), alert, msg_id=msg_id)
        except PublishError as exc:
            log.error("could not publish the counter alert", extra={"policy": self._policy, "error": str(exc)})

    async def __aenter__(self) -> VersionPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        return None

    # -- updates -----------------------------------------------------------------------------------

    def update(self, *, lora: LoraAdapter | None = None) -> VersionUpdate:
        """One weight update, as an async context manager yielding the version to push (``int``).

        On entering, the number is reserved on the bus (then the fleet, if any, is paused). Inside
        the block the trainer pushes weights (and, without a fleet, stamps its engines). On normal
        exit the fleet is stamped and verified, ``WeightUpdated`` is announced, then the fleet is
        resumed. On any failure nothing is announced, the number stays used up, and the fleet is
        relabelled with a quarantine label before it serves again (see ``VersionUpdate``).

        Args:
            lora: the LoRA adapter this push loads (recorded on the events); None for a full push.
        """
        return VersionUpdate(self, lora)

    async def publish_lora(self, adapter: LoraAdapter, *, pinned: bool = False, replace: bool = False) -> int:
        """Load ``adapter`` on every engine of the fleet, stamp the next version, and announce it.

        SGLang's adapter load carries no version; this is the stamp that makes LoRA samples
        comparable with full-weight ones (both share this counter). A load refused by some engine
        is undone on the others, and the fleet is quarantined like any failed update.

        Args:
            adapter: name and path of the adapter.
            pinned: SGLang's ``pinned`` flag.
            replace: unload an adapter of the same name first (re-pushing new adapter weights under
                one name; SGLang refuses to load a name twice).

        Returns:
            The announced version.

        Raises:
            ValueError: no fleet, or ``adapter.path`` is None.
            EngineError: an engine refused the load (nothing announced).
            EngineOutOfSyncError, FencedError, PublishError: as ``update()``.
        """
        if self.fleet is None:
            raise ValueError("publish_lora needs an engine fleet")
        if adapter.path is None:
            raise ValueError(f"LoRA adapter {adapter.name!r} has no path to load")
        async with self.update(lora=adapter) as version:
            if replace:
                await self.fleet.unload_lora_adapter(adapter.name, missing_ok=True)
            await self.fleet.load_lora_adapter(adapter.name, adapter.path, pinned=pinned)
        return version

    # -- the conditional publish and its resolution --------------------------------------------------

    def is_mine(self, env: Envelope) -> bool:
        """Whether ``env`` is an event of this publisher instance."""
        event = env.event
        if not isinstance(event, WeightUpdated | PublisherClaimed | VersionReserved):
            return False
        return event.incarnation == self.incarnation and event.epoch == self._epoch

    async def conditional(self, event: WeightUpdated | VersionReserved, msg_id: str) -> PublishAck:
        """Publish ``event`` conditional on this publisher's last event; resolve a conflict or fence.

        Raises:
            FencedError: another owner's event is the newest on the subject.
            PublishError: the bus could not confirm (in doubt; resolved by the next call).
        """
        if self._fenced is not None:
            raise self._fenced
        for _ in range(_RESOLVE_ATTEMPTS):
            assert self._seq is not None
            try:
                ack = await self.bus.publish(self.subject, event, msg_id=msg_id, expected_last_seq=self._seq)
            except SequenceConflictError:
                await self.resolve()
                continue
            self._seq = ack.seq
            return ack
        raise PublishError(self.subject, f"the subject kept moving under {_RESOLVE_ATTEMPTS} resolutions")

    async def check_owner(self) -> None:
        """One read: raise ``FencedError`` if another owner has written since our last event (resolving doubt)."""
        if self._fenced is not None:
            raise self._fenced
        if await self.bus.last_seq(self.subject) != self._seq:
            await self.resolve()

    async def resolve(self) -> None:
        """The subject moved past our last known event: adopt our own later event, re-claim a lost history, or fence.

        Raises:
            FencedError: the newest valid event belongs to another owner.
        """
        history = await read_subject_history(self.bus, self.subject)
        last = history.last_valid
        # Events after our newest one that the trackers' rule rejects (a forged claim) do not fence us.
        folded = fold_history(self._policy, history.events) if last is not None and not self.is_mine(last) else None
        if folded is not None and folded.latest_rejected and self._owns(folded.state):
            last = next(e for e in reversed(history.events) if e.seq == folded.last_accepted_seq)
        if last is not None and self.is_mine(last):
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
            if await self._claim(self._epoch + 1, self._version, self._issued, None, history.last_seq):
                return
            return await self.resolve()
        raise self._fence(last)

    def _owns(self, state: TrackerState) -> bool:
        return (state.epoch, state.incarnation, state.publisher) == (self._epoch, self.incarnation, self._trainer_id)

    def _adopt_announced(self, event: WeightUpdated) -> None:
        version = event.version
        self._version = version if self._version is None else max(self._version, version)
        if event.reserves_next:
            self._issued = max(self._issued, version + 1)
            self._pre = version + 1
        else:
            self._issued = max(self._issued, version)
        self.last_event = event

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
                "incarnation": self.incarnation,
            },
        )
        return err

    async def take(self, version: int, lora: LoraAdapter | None) -> None:
        """Take ``version`` (``next_version``), fenced: a read if our last event reserved it, else a reservation.

        From here on ``version`` is never issued again, whatever follows.

        Raises:
            FencedError, PublishError: as ``conditional`` (nothing was taken; a retry takes the same number).
        """
        if self._holds(version):
            await self.check_owner()
            if not self._holds(version):  # resolving doubt moved the counter (a later event of ours)
                await self.reserve(version, lora)
        else:
            await self.reserve(version, lora)
        self._entered = max(self._entered, version)

    async def reserve(self, version: int, lora: LoraAdapter | None) -> None:
        """Store ``VersionReserved(version)``; the number is used up from here on, whatever follows.

        Raises:
            FencedError, PublishError: as ``conditional``.
        """
        assert self._epoch is not None
        event = VersionReserved(
            policy=self._policy,
            version=version,
            epoch=self._epoch,
            trainer_id=self._trainer_id,
            published_at=now(),
            incarnation=self.incarnation,
            lora=lora,
        )
        # A reservation that fails is retried by the next update with the same number and message id: if it
        # had landed, the bus deduplicates it (and resolve() adopts it), so an outage does not burn numbers.
        await self.conditional(event, f"{self._policy}:reserve:{self.incarnation}:{version}")
        self._issued = max(self._issued, version)

    async def announce(self, version: int, lora: LoraAdapter | None) -> WeightUpdated:
        """Store ``WeightUpdated(version)``: the engines serve it and trackers may take it.

        Raises:
            FencedError, PublishError: as ``conditional``.
        """
        assert self._epoch is not None
        event = WeightUpdated(
            policy=self._policy,
            version=version,
            epoch=self._epoch,
            trainer_id=self._trainer_id,
            published_at=now(),
            lora=lora,
            engines=self.fleet.urls if self.fleet is not None else (),
            incarnation=self.incarnation,
            reserves_next=self._reserve_next and version < MAX_VERSION,
        )
        ack = await self.conditional(event, f"{self._policy}:{self._epoch}:{version}:{self.incarnation}")
        self._adopt_announced(event)
        log.info(
            "published weight version",
            extra={"policy": self._policy, "version": version, "epoch": self._epoch, "seq": ack.seq},
        )
        return event


def _fold(history: History, policy: str) -> tuple[int | None, int, int]:
    """``(current version, highest number issued, highest epoch)`` over a weights history.

    The history is folded with the trackers' rule (``consumers.history.fold_history``), so a version no
    tracker accepts (a rogue's, a forged jump) never becomes the counter's.
    """
    folded = fold_history(policy, history.events)
    state = folded.state
    return state.version, max(state.reserved or 0, state.version or 0), folded.epoch_high
