"""``VersionPublisher``: the one owner of a policy's weight-version counter, fenced over JetStream.

Invariants:

* The counter lives on the bus, not in the trainer: ``start()`` resumes from the highest version
  retained on ``weights(policy)`` (normally the last event), so a restarted or failed-over trainer
  continues at 58 after 57, even if a publisher that bypassed the counter stored a lower version
  last. A new policy's first version is 1.
* ``start()`` claims the counter: it publishes ``PublisherClaimed`` with ``epoch = last epoch + 1``
  (0 for a new policy), conditional on the subject's last sequence. Every later event is conditional
  on the sequence of this publisher's own previous event, so once another publisher has claimed,
  this one's next publish is refused with ``FencedError`` naming the new owner, and nothing is stored.
* Message ids are deterministic (``{policy}:{epoch}:{version}``), so the bus's retries after a
  timeout never store a second event; a publish whose outcome is unknown is resolved against the
  bus before the next update, never guessed.
* A version is used up only when its ``WeightUpdated`` is acknowledged. An exception inside
  ``update()`` publishes nothing, and the next update gets the same number.
* With an engine fleet, ``update()`` runs: pause, (the trainer pushes), stamp, verify, publish,
  resume. Engines emit samples stamped ``v`` only after resuming, which happens after the publish
  of ``v`` is acknowledged, so no sample stamped ``v`` can reach a drain before ``v`` is on the bus.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from types import TracebackType
from typing import Final

from weightbus.bus import subjects
from weightbus.bus.protocol import Bus, Deliver, Envelope
from weightbus.engines.sglang import PauseMode
from weightbus.errors import EngineError, FencedError, PublishError, SequenceConflictError
from weightbus.producers.stamping import EngineFleet, EngineStamp, stamp_and_verify
from weightbus.schemas import LoraAdapter, PublisherClaimed, WeightUpdated, now

__all__ = ["VersionPublisher", "VersionUpdate", "default_trainer_id"]

log = logging.getLogger("weightbus.producers")

_CLAIM_ATTEMPTS: Final = 5


def default_trainer_id() -> str:
    """``<hostname>:<pid>``: unique among live processes, readable in a ``FencedError``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class VersionPublisher:
    """Publishes ``WeightUpdated`` for one policy, fenced against every other publisher of it.

    Args:
        bus: the bus (borrowed; not closed here).
        policy: the policy id.
        trainer_id: this publisher's identity on the bus (default ``<hostname>:<pid>``).
        fleet: engines to pause, stamp, verify and resume around each update (borrowed); without a
            fleet the trainer stamps its engines itself and ``update()`` only publishes.
        pause: pause mode for the fleet on entering ``update()`` (``retract``, ``in_place``, ``abort``),
            or None to stamp without pausing.
        claim_attempts: how often ``start()`` re-reads and retries when another publisher claims at
            the same moment.

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
    ) -> None:
        self._subject = subjects.weights(policy)
        if pause is not None and fleet is None:
            raise ValueError("pause needs an engine fleet")
        self._bus = bus
        self._policy = policy
        self._trainer_id = trainer_id or default_trainer_id()
        self.fleet = fleet
        self._pause: PauseMode | None = pause
        self._claim_attempts = max(1, claim_attempts)
        self._epoch: int | None = None
        self._version: int | None = None
        self._seq: int | None = None
        self._fenced: FencedError | None = None
        # msg_id and version of a publish whose outcome is unknown (PublishError after the bus's retries).
        self._in_doubt: tuple[str, int] | None = None
        self._active = False
        self.last_event: WeightUpdated | None = None
        """The last ``WeightUpdated`` this publisher had acknowledged."""

    @property
    def policy(self) -> str:
        """The policy id."""
        return self._policy

    @property
    def trainer_id(self) -> str:
        """This publisher's identity on the bus."""
        return self._trainer_id

    @property
    def epoch(self) -> int | None:
        """The epoch this publisher claimed (None before ``start()``)."""
        return self._epoch

    @property
    def version(self) -> int | None:
        """The current published version (None for a policy that never published one)."""
        return self._version

    @property
    def next_version(self) -> int:
        """The version the next ``update()`` will publish."""
        return (self._version or 0) + 1

    @property
    def started(self) -> bool:
        """Whether ``start()`` claimed the counter."""
        return self._epoch is not None

    @property
    def fenced(self) -> FencedError | None:
        """The ``FencedError`` once another publisher took over (every later update raises it)."""
        return self._fenced

    async def start(self) -> VersionPublisher:
        """Resume the counter from the bus and claim it, fencing any previous publisher.

        Returns:
            ``self``.

        Raises:
            PublishError: the claim could not be stored, or other publishers kept claiming
                ``claim_attempts`` times in a row.
            InvalidEventError: the last stored event on the weights subject is not a valid event.
        """
        if self.started:
            return self
        for attempt in range(1, self._claim_attempts + 1):
            last = await self._bus.last(self._subject)
            epoch, version, previous, seq = 0, None, None, 0
            if last is not None:
                event = last.event
                if not isinstance(event, WeightUpdated | PublisherClaimed):
                    raise PublishError(self._subject, f"unexpected {type(event).__name__} on the weights subject")
                epoch, version, previous, seq = event.epoch + 1, event.version, event.trainer_id, last.seq or 0
                high_version, high_epoch = await self._retained_high(last)
                epoch = max(epoch, high_epoch + 1)
                if high_version is not None and (version is None or high_version > version):
                    log.warning(
                        "the latest stored version is below the highest retained one; resuming above the highest",
                        extra={"policy": self._policy, "latest": version, "highest": high_version, "by": previous},
                    )
                    version = high_version
            claim = PublisherClaimed(
                policy=self._policy,
                epoch=epoch,
                trainer_id=self._trainer_id,
                published_at=now(),
                version=version,
                previous_trainer_id=previous,
            )
            try:
                ack = await self._bus.publish(
                    self._subject,
                    claim,
                    msg_id=f"{self._policy}:claim:{epoch}:{self._trainer_id}",
                    expected_last_seq=seq,
                )
            except SequenceConflictError:
                log.info(
                    "another publisher claimed at the same time; re-reading",
                    extra={"policy": self._policy, "epoch": epoch, "attempt": attempt},
                )
                continue
            if ack.duplicate:
                # A retried claim of ours that landed; anything else holding the id is not ours.
                mine = await self._bus.last(self._subject)
                if mine is None or mine.seq != ack.seq or not self._is_mine(mine, epoch):
                    continue
            self._epoch, self._version, self._seq = epoch, version, ack.seq
            log.info(
                "claimed the version counter",
                extra={
                    "policy": self._policy,
                    "trainer_id": self._trainer_id,
                    "epoch": epoch,
                    "version": version,
                    "previous_trainer_id": previous,
                },
            )
            return self
        raise PublishError(self._subject, f"could not claim the counter in {self._claim_attempts} attempts")

    async def _retained_high(self, last: Envelope, timeout: float = 10.0) -> tuple[int | None, int]:
        """The highest version and epoch among the retained events up to ``last`` on the weights subject."""
        high_version: int | None = None
        high_epoch = -1
        async with asyncio.timeout(timeout), self._bus.subscribe(self._subject, deliver=Deliver.ALL) as sub:
            async for env in sub:
                event = env.event
                if isinstance(event, WeightUpdated | PublisherClaimed) and event.policy == self._policy:
                    if event.version is not None and (high_version is None or event.version > high_version):
                        high_version = event.version
                    high_epoch = max(high_epoch, event.epoch)
                if env.seq is None or last.seq is None or env.seq >= last.seq:
                    break
        return high_version, high_epoch

    async def __aenter__(self) -> VersionPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        return None

    def update(self, *, lora: LoraAdapter | None = None) -> VersionUpdate:
        """One weight update, as an async context manager yielding the version to stamp (``int``).

        Inside the block the trainer pushes weights (and, without a fleet, stamps its engines with
        the version). On normal exit the fleet (if any) is stamped and verified, ``WeightUpdated`` is
        published and acknowledged, then the fleet is resumed. On an exception nothing is published,
        a paused fleet is resumed, and the version is not used up.

        Args:
            lora: the LoRA adapter this push loads (recorded on the event); None for a full-weight push.
        """
        return VersionUpdate(self, lora)

    async def publish_lora(self, adapter: LoraAdapter, *, pinned: bool = False) -> int:
        """Load ``adapter`` on every engine of the fleet, stamp the next version, and publish it.

        SGLang's adapter load carries no version; this is the stamp that makes LoRA samples
        comparable with full-weight ones (both share this counter).

        Returns:
            The published version.

        Raises:
            ValueError: no fleet, or ``adapter.path`` is None.
            EngineError: an engine refused the load (nothing stamped or published).
            EngineOutOfSyncError, FencedError, PublishError: as ``update()``.
        """
        if self.fleet is None:
            raise ValueError("publish_lora needs an engine fleet")
        if adapter.path is None:
            raise ValueError(f"LoRA adapter {adapter.name!r} has no path to load")
        async with self.update(lora=adapter) as version:
            await self.fleet.load_lora_adapter(adapter.name, adapter.path, pinned=pinned)
        return version

    def _is_mine(self, env: Envelope, epoch: int) -> bool:
        event = env.event
        return (
            isinstance(event, WeightUpdated | PublisherClaimed)
            and event.epoch == epoch
            and event.trainer_id == self._trainer_id
        )

    def _fence(self, last: Envelope | None) -> FencedError:
        if last is not None and isinstance(last.event, WeightUpdated | PublisherClaimed):
            err = FencedError(self._policy, last.event.trainer_id, last.event.epoch, last.event.version)
        else:
            err = FencedError(self._policy, "<nobody: the weights subject was emptied>", -1, None)
        self._fenced = err
        log.error(
            "fenced: another publisher owns the counter",
            extra={"policy": self._policy, "trainer_id": self._trainer_id, "owner": err.owner, "epoch": err.epoch},
        )
        return err

    async def _ensure_owner(self) -> None:
        """Check that the subject still ends with our event; resolve a publish left in doubt."""
        if self._fenced is not None:
            raise self._fenced
        last = await self._bus.last(self._subject)
        if last is not None and last.seq == self._seq:
            self._in_doubt = None
            return
        if self._in_doubt is not None and last is not None and self._epoch is not None:
            msg_id, version = self._in_doubt
            if last.headers.get("Nats-Msg-Id") == msg_id and self._is_mine(last, self._epoch):
                # The publish whose ack was lost did land: the version is used up.
                self._in_doubt = None
                self._adopt(last, version)
                log.warning(
                    "a publish reported as failed had landed",
                    extra={"policy": self._policy, "version": version, "seq": last.seq},
                )
                return
        raise self._fence(last)

    def _adopt(self, env: Envelope, version: int) -> None:
        self._seq = env.seq
        self._version = version
        if isinstance(env.event, WeightUpdated):
            self.last_event = env.event

    async def _publish(self, version: int, lora: LoraAdapter | None) -> WeightUpdated:
        assert self._epoch is not None and self._seq is not None
        event = WeightUpdated(
            policy=self._policy,
            version=version,
            epoch=self._epoch,
            trainer_id=self._trainer_id,
            published_at=now(),
            lora=lora,
            engines=self.fleet.urls if self.fleet is not None else (),
        )
        msg_id = f"{self._policy}:{self._epoch}:{version}"
        try:
            ack = await self._bus.publish(self._subject, event, msg_id=msg_id, expected_last_seq=self._seq)
        except SequenceConflictError:
            raise self._fence(await self._bus.last(self._subject)) from None
        except PublishError:
            self._in_doubt = (msg_id, version)
            raise
        self._seq, self._version, self.last_event = ack.seq, version, event
        log.info(
            "published weight version",
            extra={"policy": self._policy, "version": version, "epoch": self._epoch, "seq": ack.seq},
        )
        return event


class VersionUpdate:
    """The async context manager returned by ``VersionPublisher.update()``; see there.

    Attributes:
        version: the version this update stamps and publishes (set on entering).
        stamps: the engines' read-backs after a successful exit with a fleet.
        event: the acknowledged ``WeightUpdated`` after a successful exit.
    """

    def __init__(self, publisher: VersionPublisher, lora: LoraAdapter | None) -> None:
        self._pub = publisher
        self.lora = lora
        self.version: int | None = None
        self.stamps: list[EngineStamp] = []
        self.event: WeightUpdated | None = None
        self._paused = False

    async def __aenter__(self) -> int:
        pub = self._pub
        if not pub.started:
            raise RuntimeError("call VersionPublisher.start() before update()")
        if pub._active:
            raise RuntimeError("another update of this publisher is in progress; updates are sequential")
        pub._active = True
        try:
            # A fenced trainer learns it before touching any engine.
            await pub._ensure_owner()
            self.version = pub.next_version
            if pub.fleet is not None and pub._pause is not None:
                await pub.fleet.pause(pub._pause)
                self._paused = True
        except BaseException:
            pub._active = False
            raise
        log.info("update started", extra={"policy": pub.policy, "version": self.version, "paused": self._paused})
        return self.version

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        pub = self._pub
        try:
            if exc is not None:
                log.warning(
                    "update aborted; nothing published",
                    extra={"policy": pub.policy, "version": self.version, "error": repr(exc)},
                )
                await self._resume_after_failure(exc)
                return
            assert self.version is not None
            try:
                if pub.fleet is not None:
                    self.stamps = await stamp_and_verify(
                        pub.fleet,
                        self.version,
                        bus=pub._bus,
                        policy=pub.policy,
                        trainer_id=pub.trainer_id,
                        lora=self.lora,
                    )
                self.event = await pub._publish(self.version, self.lora)
            except BaseException as failure:
                await self._resume_after_failure(failure)
                raise
            if self._paused:
                assert pub.fleet is not None
                self._paused = False
                # Runs only after the publish was acknowledged: see the module docstring.
                await pub.fleet.resume()
        finally:
            pub._active = False

    async def _resume_after_failure(self, failure: BaseException) -> None:
        if not self._paused:
            return
        assert self._pub.fleet is not None
        self._paused = False
        try:
            # A stalled fleet stops the whole run; resuming lets the new owner (or a retry) take over.
            await self._pub.fleet.resume()
        except EngineError as exc:
            log.error("resume after a failed update failed", extra={"policy": self._pub.policy, "error": str(exc)})
            failure.add_note(f"resuming the engines afterwards failed too: {exc}")
        except asyncio.CancelledError:
            failure.add_note("resuming the engines afterwards was cancelled")
            raise
