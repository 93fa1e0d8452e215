"""The stamp-and-verify step that precedes every publish, and what the bus hears of it.

An unexpected label is alerted before the engine is stamped; every engine gets a ``WeightApplied`` or an alert, then
``EngineOutOfSyncError`` (or ``EngineError``) is raised, so no version is announced that an engine does not serve.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

from weightbus.bus import subjects
from weightbus.bus.protocol import Bus
from weightbus.errors import EngineError, EngineOutOfSyncError, PublishError
from weightbus.producers.coverage import PENDING_PREFIX
from weightbus.producers.fleet import EngineFleet, EngineStamp, first_with_notes
from weightbus.schemas import QUARANTINE_PREFIX, EngineOutOfSync, LoraAdapter, WeightApplied, now

__all__ = ["alert_uncovered", "alert_unexpected_labels", "publish_applied", "stamp_and_verify"]

log = logging.getLogger("weightbus.producers")


async def stamp_and_verify(
    fleet: EngineFleet,
    version: int,
    *,
    bus: Bus | None = None,
    policy: str | None = None,
    trainer_id: str = "",
    lora: LoraAdapter | None = None,
    previous: int | None = None,
    report_applied: bool = True,
    before_stamp: Callable[[], Awaitable[None]] | None = None,
    engines: Collection[str] | None = None,
    expect: str | None = None,
) -> list[EngineStamp]:
    """Stamp every engine with ``version``, read it back, report to the bus, and refuse an out-of-sync fleet.

    Args:
        fleet: the engines.
        version: the version to stamp (sent as ``str(version)``).
        bus: where ``WeightApplied`` (per engine) and ``EngineOutOfSync`` alerts go; nothing is published if None.
        policy: the policy id (required with ``bus``).
        trainer_id: who stamps, recorded on alerts.
        lora: the adapter this push loaded, recorded on ``WeightApplied``.
        previous: the version announced before this one; with ``version`` and quarantine labels it
            is what an engine may carry before the stamp without an ``unexpected_label`` alert.
        report_applied: publish the ``WeightApplied`` events of a fleet that is in sync here; False
            leaves them to the caller (``publish_applied``), which sends them beside its announcement.
            A fleet out of sync always has its read-backs published before the error is raised.
        before_stamp: see ``EngineFleet.stamp`` (the publisher passes its ownership check).
        engines: the engines to stamp (default: all); see ``EngineFleet.stamp``.
        expect: the label an engine must carry to be stamped; see ``EngineFleet.stamp``.

    Returns:
        The stamps, all ``ok``.

    Raises:
        EngineOutOfSyncError: an engine answered but reports another version (alerts were published first).
        EngineError: an engine did not answer the stamp or the read-back (alerts were published first).
        PublishError: a ``WeightApplied`` could not be published.
        ValueError: ``bus`` without ``policy``.
    """
    if bus is not None and policy is None:
        raise ValueError("stamp_and_verify needs the policy to publish to the bus")
    stamps = await fleet.stamp(version, before_stamp=before_stamp, engines=engines, expect=expect)
    if bus is not None and policy is not None:
        await alert_unexpected_labels(
            bus, policy, trainer_id, version, previous, {s.engine: s.before for s in stamps if s.before is not None}
        )
        if report_applied or not all(s.ok for s in stamps):
            await publish_applied(bus, policy, trainer_id, version, lora, stamps)
    bad = [s for s in stamps if not s.ok]
    if not bad:
        log.info("engines stamped", extra={"policy": policy, "version": version, "engines": len(stamps)})
        return stamps
    errors: list[EngineError] = []
    for s in bad:
        err = s.error if s.error is not None else EngineOutOfSyncError(s.engine, s.expected, str(s.read_back))
        errors.append(err)
        log.error(
            "engine out of sync after stamp",
            extra={"policy": policy, "engine": s.engine, "expected": s.expected, "actual": s.read_back},
        )
    # A wrong read-back is the sharper diagnosis; raise it before a mere transport failure.
    errors.sort(key=lambda e: not isinstance(e, EngineOutOfSyncError))
    first = first_with_notes(errors, "stamp")
    if bus is not None and policy is not None:
        alerts = subjects.alerts(policy)

        async def _alert(s: EngineStamp) -> None:
            assert bus is not None and policy is not None
            alert = EngineOutOfSync(
                policy=policy,
                engine=s.engine,
                expected=s.expected,
                actual=s.read_back,
                trainer_id=trainer_id,
                published_at=now(),
                error=None if s.error is None else str(s.error),
            )
            try:
                msg_id = f"{policy}:out_of_sync:{trainer_id}:{s.expected}:{s.engine}:{s.read_back}:{s.error is None}"
                await bus.publish(alerts, alert, msg_id=msg_id)
            except PublishError as exc:
                # The engine fault is what the caller must act on; a lost alert is reported with it.
                log.error("could not publish the out-of-sync alert", extra={"policy": policy, "error": str(exc)})
                first.add_note(f"the EngineOutOfSync alert for {s.engine} was not published: {exc}")

        # Concurrently: a fleet that failed whole must not wait one bus round trip per engine.
        await asyncio.gather(*(_alert(s) for s in bad))
    raise first


async def publish_applied(
    bus: Bus, policy: str, trainer_id: str, version: int, lora: LoraAdapter | None, stamps: Sequence[EngineStamp]
) -> None:
    """Publish one ``WeightApplied`` per engine that answered, concurrently.

    Raises:
        PublishError: a ``WeightApplied`` could not be published.
    """
    applied = subjects.applied(policy)

    async def _one(s: EngineStamp) -> None:
        event = WeightApplied(
            policy=policy,
            version=version,
            engine=s.engine,
            read_back=str(s.read_back),
            ok=s.ok,
            published_at=now(),
            lora=lora,
        )
        # Deterministic: a retried publish of the same outcome is stored once; a different outcome is new.
        await bus.publish(applied, event, msg_id=f"{policy}:applied:{trainer_id}:{version}:{s.engine}:{s.read_back}")

    await asyncio.gather(*(_one(s) for s in stamps if s.read_back is not None))


async def alert_unexpected_labels(
    bus: Bus,
    policy: str,
    trainer_id: str,
    version: int,
    previous: int | None,
    labels: Mapping[str, str | EngineError],
) -> list[str]:
    """Alert (``EngineOutOfSync``, ``unexpected_label``) every engine whose label it should not carry.

    An engine may carry the previously announced version, ``str(version)``, a quarantine label or a
    pending label (an update's push under way, or one that died mid-push); anything else
    (``"default"`` after a restart) is alerted, once per update, engine and label.
    Before the first announcement (``previous`` None) nothing is unexpected.

    Returns:
        The engines alerted.
    """
    if previous is None:
        return []
    allowed = {str(version), str(previous)}
    flagged = [
        engine
        for engine, label in labels.items()
        if not (
            isinstance(label, EngineError) or label in allowed or label.startswith((QUARANTINE_PREFIX, PENDING_PREFIX))
        )
    ]

    async def _one(engine: str, label: str) -> None:
        log.error(
            "engine carries an unexpected label (restarted?)",
            extra={"policy": policy, "engine": engine, "label": label, "previous": previous, "version": version},
        )
        alert = EngineOutOfSync(
            policy=policy,
            engine=engine,
            expected=str(previous),
            actual=label,
            trainer_id=trainer_id,
            published_at=now(),
            reason="unexpected_label",
        )
        try:
            await bus.publish(subjects.alerts(policy), alert, msg_id=f"{policy}:unexpected:{version}:{engine}:{label}")
        except PublishError as exc:
            log.error("could not publish the unexpected-label alert", extra={"policy": policy, "error": str(exc)})

    # Concurrently: a fleet restarted whole (every engine "default") must not wait one round trip per engine.
    await asyncio.gather(*(_one(engine, str(labels[engine])) for engine in flagged))
    return flagged


async def alert_uncovered(
    bus: Bus, policy: str, trainer_id: str, version: int, labels: Mapping[str, str], quarantined: str
) -> None:
    """Alert (``EngineOutOfSync``, ``not_covered``) each engine a push did not bring to ``version``.

    Args:
        labels: each uncovered engine's label before the push, by URL (``actual`` on the alert).
        quarantined: the label it carries now (recorded as the alert's ``error``).
    """

    async def _one(engine: str, label: str) -> None:
        log.error(
            "the push does not cover this engine: quarantined, not stamped",
            extra={"policy": policy, "engine": engine, "label": label, "version": version},
        )
        alert = EngineOutOfSync(
            policy=policy,
            engine=engine,
            expected=str(version),
            actual=label,
            trainer_id=trainer_id,
            published_at=now(),
            error=f"the push covers the difference from another weight set; relabelled {quarantined!r}",
            reason="not_covered",
        )
        try:
            await bus.publish(subjects.alerts(policy), alert, msg_id=f"{policy}:not_covered:{version}:{engine}")
        except PublishError as exc:
            log.error("could not publish the not-covered alert", extra={"policy": policy, "error": str(exc)})

    await asyncio.gather(*(_one(engine, label) for engine, label in labels.items()))
