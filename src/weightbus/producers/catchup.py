"""Catch-up without the trainer: bring one restarted or lagging engine to the policy's announced version, from the bus.

The version and its artifacts come from the weights history as trackers fold it (``rules.history``); the plan is the
pure rule ``rules.catchup``. Invariants: every file is checked against its announced digests before the engine is
touched, and must still be the file that was checked when its load ends (else the engine is quarantined). A label
is only ever set together with the weights it names, and only after that check: the files are loaded under
``quarantine:<v>`` (a LoRA version's adapter may instead go on the boot base that ``producers.coverage``'s lineage
rule says the engine holds, under its boot label), and the engine is relabelled ``v`` only then, and only if nothing
relabelled it meanwhile.
An engine at or above the target is never brought down. After a load the bus is read again and a newer announcement
is followed (``rounds`` at most), else the engine is left truthfully labelled with the verified version it holds.
On a failure the engine is quarantined (``quarantine:<v>``, a ``FleetQuarantined`` alert, a metric) and a
``CatchupError`` says why. See docs/operations.md#catching-an-engine-up.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Final, Literal

from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.identity import process_identity
from weightbus.bus.protocol import Bus
from weightbus.engines.sglang import PauseMode, SGLangClient
from weightbus.errors import (
    ArtifactDigestError,
    ArtifactLineageError,
    ArtifactMissingError,
    BusError,
    CatchupEngineError,
    CatchupError,
    EngineError,
)
from weightbus.producers.artifact import CheckedArtifact, check_artifact
from weightbus.producers.coverage import fold_lineage, is_boot_label
from weightbus.producers.fleet import EngineFleet, EngineStamp
from weightbus.producers.lora import push_lora_adapter
from weightbus.producers.metrics import CatchupMetrics
from weightbus.producers.stamping import publish_applied
from weightbus.producers.status import read_weights_history
from weightbus.producers.update import quarantine_label
from weightbus.rules.catchup import CatchupPlan, PlanRefused, label_standing, plan_catchup
from weightbus.schemas import FleetQuarantined, now

__all__ = ["CatchupOutcome", "CatchupResult", "catch_up"]

log = logging.getLogger("weightbus.producers")

#: Seconds the engine may take to take its quarantine label, and the alert to be stored.
_CLEANUP_TIMEOUT: Final = 5.0

#: How a catch-up that did not fail ended: ``caught_up`` (loaded, verified, labelled the bus's current version),
#: ``current`` (it already carried it), ``ahead`` (it carries a higher number than the bus had: never brought
#: down), ``behind`` (loaded and labelled a verified version, but the bus announced a newer one ``rounds`` times).
CatchupOutcome = Literal["caught_up", "current", "ahead", "behind"]

_ERRORS: Final[dict[str, type[CatchupError]]] = {
    "digest_mismatch": ArtifactDigestError,
    "missing_file": ArtifactMissingError,
    "no_artifact": ArtifactLineageError,
    "unannounced_base": ArtifactLineageError,
    "unsupported": ArtifactLineageError,
    "engine_error": CatchupEngineError,
    "busy": CatchupEngineError,
}


@dataclass(frozen=True, slots=True)
class CatchupResult:
    """How one catch-up ended (it raised ``CatchupError`` otherwise).

    Attributes:
        engine: the engine URL.
        outcome: see ``CatchupOutcome``.
        before: the engine's label when the catch-up began.
        label: its label at the end (read back).
        version: the version it serves at the end (the number its label names).
        announced: the policy's current version on the bus at the last read.
        loaded: the versions whose verified artifacts were loaded, in order (empty: nothing was loaded); the last
            may have been superseded by a trainer's push (outcome ``ahead`` or ``current``).
    """

    engine: str
    outcome: CatchupOutcome
    before: str
    label: str
    version: int
    announced: int
    loaded: tuple[int, ...] = ()


class _Failed(Exception):
    """A step failed: the reason and detail the ``CatchupError`` carries (raised after the quarantine)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


async def _unchanged(checked: list[CheckedArtifact], target: int) -> None:
    """Raise unless every checked file is still the one whose bytes were checked (looked at in a thread: a checkpoint
    on NFS is many slow stats)."""
    for artifact in checked:
        why = await asyncio.to_thread(artifact.changed)
        if why is not None:
            raise _Failed(
                "digest_mismatch",
                f"{why}: it changed after it was checked, so the engine may hold other bytes than v{target}'s",
            )


async def catch_up(
    bus: Bus,
    policy: str,
    engine: SGLangClient,
    *,
    observer: str | None = None,
    metrics: CatchupMetrics | None = None,
    pause: PauseMode = "retract",
    rounds: int = 3,
    history_timeout: float = 10.0,
) -> CatchupResult:
    """Bring ``engine`` to the version ``policy`` has announced, from the bus alone; see the module docstring.

    Args:
        bus: where the weights history is read and ``WeightApplied`` and alerts go.
        policy: the policy id.
        engine: the engine (a worker, not a router); borrowed, not closed.
        observer: who catches up, recorded on the events (default: this process' identity, ``catchup:...``).
        metrics: where the outcome is counted, or None.
        pause: the pause mode while loading.
        rounds: the most versions loaded in turn: the target, then each newer one announced while it loaded; past
            them the engine is left truthfully labelled with the last verified version it loaded (outcome
            ``behind``).
        history_timeout: seconds each read of the history may take.

    Returns:
        How it ended.

    Raises:
        ArtifactDigestError, ArtifactMissingError, ArtifactLineageError: nothing loadable and verified names the
            version; the engine was quarantined (nothing was loaded).
        CatchupEngineError: the engine failed or read back another label (quarantined), or a trainer's update holds
            it (``busy``: left as it was).
        CatchupError: the policy never announced a version (``never_published``; the engine was not touched).
        BusError: the history could not be read (the engine was not touched, or is left truthfully labelled).
        ValueError: ``rounds`` below 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    who = observer or process_identity("catchup")
    run = _Catchup(bus, policy, engine, who, pause)
    try:
        result = await run.run(rounds, history_timeout)
    except CatchupError as exc:
        if metrics is not None:
            metrics.runs.labels(policy, "failed").inc()
            metrics.failures.labels(policy, exc.reason).inc()
        raise
    if metrics is not None:
        metrics.runs.labels(policy, result.outcome).inc()
    return result


class _Catchup:
    """One catch-up's state: whether it paused the engine, and what it loaded."""

    def __init__(self, bus: Bus, policy: str, client: SGLangClient, observer: str, pause: PauseMode) -> None:
        self.bus, self.policy, self.client, self.observer, self.pause = bus, policy, client, observer, pause
        self.url = client.url
        self.paused = False
        self.target: int | None = None

    async def run(self, rounds: int, history_timeout: float) -> CatchupResult:
        try:
            return await self._run(rounds, history_timeout)
        except _Failed as failed:
            raise await self._quarantine(failed) from failed.__cause__
        finally:
            if self.paused:
                self.paused = False
                # Shielded: a cancelled catch-up must not leave the engine paused (its label is truthful either way).
                try:
                    await asyncio.shield(self.client.continue_generation())
                except EngineError as exc:
                    log.error(
                        "could not resume the engine after the catch-up", extra={"engine": self.url, "error": str(exc)}
                    )

    async def _label(self) -> str:
        try:
            return await self.client.weight_version()
        except EngineError as exc:
            raise _Failed("engine_error", f"reading its label failed: {exc}") from exc

    async def _run(self, rounds: int, history_timeout: float) -> CatchupResult:
        history = await read_weights_history(self.bus, self.policy, timeout=history_timeout)
        target = history.state.version
        if target is None:
            raise CatchupError(self.policy, self.url, None, "never_published", "the policy never announced a version")
        self.target = target
        before = label = await self._label()
        loaded: list[int] = []
        followed = 0
        while True:
            standing = label_standing(label, target)
            if standing in ("current", "ahead"):
                # Nothing to load (and an engine above the bus is never brought down to it).
                return self._result(standing, before, label, target, loaded)
            if standing == "busy":
                raise _Failed("busy", f"it carries {label!r}: a trainer's update above v{target} holds it")
            plan = plan_catchup(history.updates, target)
            if isinstance(plan, PlanRefused) and plan.reason == "no_artifact" and await self._boot_base(label):
                plan = plan_catchup(history.updates, target, boot_base=True)
            if isinstance(plan, PlanRefused):
                raise _Failed(plan.reason, plan.detail)
            checked: list[CheckedArtifact] = []
            for announcement in plan.announcements:
                assert announcement.artifact is not None  # a plan names only announcements with one
                # In a thread: a real checkpoint is gigabytes to hash, and the loop must go on (the bus, other engines).
                result = await asyncio.to_thread(check_artifact, announcement.artifact)
                if not isinstance(result, CheckedArtifact):
                    raise _Failed(*result)
                checked.append(result)
            if not self.paused:
                try:
                    await self.client.pause_generation(self.pause)
                except EngineError as exc:
                    raise _Failed("engine_error", f"the pause failed: {exc}") from exc
                self.paused = True
            # Read again under the pause: a trainer's push may have moved it since.
            label = await self._label()
            standing = label_standing(label, target)
            if standing in ("current", "ahead"):
                return self._result(standing, before, label, target, loaded)
            if standing == "busy":
                raise _Failed("busy", f"it carries {label!r}: a trainer's update above v{target} holds it")
            await self._load(plan, label, checked)
            loaded.append(target)
            label = await self._label()
            if label != str(target):
                if label_standing(label, target) == "ahead":  # a trainer's push landed over ours: its label stands
                    return self._result("ahead", before, label, target, loaded)
                raise _Failed("engine_error", f"loaded v{target} but it reads back {label!r}")
            await self._report(plan, label, before)
            log.info("engine caught up", extra={"policy": self.policy, "engine": self.url, "version": target})
            history = await read_weights_history(self.bus, self.policy, timeout=history_timeout)
            newest = history.state.version
            if newest is None or newest <= target:
                return self._result("caught_up", before, label, target, loaded, newest)
            if followed >= rounds - 1:
                log.warning(
                    "the bus moved on during the catch-up; the engine keeps the verified version it loaded",
                    extra={"policy": self.policy, "engine": self.url, "version": target, "announced": newest},
                )
                return self._result("behind", before, label, target, loaded, newest)
            followed += 1
            target = self.target = newest

    def _result(
        self,
        outcome: CatchupOutcome,
        before: str,
        label: str,
        target: int,
        loaded: list[int],
        announced: int | None = None,
    ) -> CatchupResult:
        # Current or ahead: the number its label carries; loaded: the last version it verified and loaded.
        version = int(label) if outcome in ("current", "ahead") else loaded[-1]
        return CatchupResult(
            self.url, outcome, before, label, version, target if announced is None else announced, tuple(loaded)
        )

    async def _boot_base(self, label: str) -> bool:
        """Whether the engine's base is its boot weights, by the lineage rule the trainer's stamps trust."""
        events = await read_subject_history(self.bus, subjects.weights(self.policy))
        lineage = fold_lineage(e.event for e in events.events)
        return lineage.untouched or (lineage.boot_base and is_boot_label(label))

    async def _load(self, plan: CatchupPlan, label: str, checked: list[CheckedArtifact]) -> None:
        """Load the plan's checked files; a label is set only with the weights it names (see the module docstring).

        The files are loaded under a label that names no version (``quarantine:<v>``, or the boot label a LoRA-only
        run's adapter goes on), and the engine is relabelled ``v`` only once every file is found unchanged since its
        check and nothing relabelled the engine meanwhile. So a catch-up cancelled or killed at any await leaves no
        number on bytes nobody checked, and a file that changed under the load quarantines the engine
        (``digest_mismatch``) before it is resumed, even if the load read the checked bytes (nothing can tell).
        """
        client, target = self.client, plan.target
        try:
            if plan.full is None:
                transitional = label  # the boot base it holds: relabelled only once the adapter is on it
            else:
                assert plan.full.artifact is not None
                transitional = quarantine_label(target)
                await client.update_weights_from_disk(plan.full.artifact.uri, weight_version=transitional)
            if plan.adapter is not None:
                assert plan.adapter.artifact is not None and plan.adapter.lora is not None
                await push_lora_adapter(EngineFleet([client]), plan.adapter.lora.name, plan.adapter.artifact.uri)
            await _unchanged(checked, target)
            label = await client.weight_version()
            if label != transitional:
                if plan.adapter is not None:
                    raise _Failed("engine_error", f"relabelled {label!r} while its adapter was loaded")
                return  # a trainer's push landed over the load: its label stands (read back by the caller)
            await client.update_weight_version(str(target), abort_all_requests=False)
        except EngineError as exc:
            raise _Failed("engine_error", f"the load failed: {exc}") from exc

    async def _report(self, plan: CatchupPlan, label: str, before: str) -> None:
        lora = None if plan.adapter is None else plan.adapter.lora
        stamp = EngineStamp(self.url, str(plan.target), label, before=before)
        try:
            await publish_applied(self.bus, self.policy, self.observer, plan.target, lora, [stamp])
        except BusError as exc:
            # The engine serves what its label says whatever the bus heard; a lost read-back is monitoring only.
            log.error("the catch-up's WeightApplied was not published", extra={"engine": self.url, "error": str(exc)})

    async def _quarantine(self, failed: _Failed) -> CatchupError:
        """Quarantine the engine unless a trainer's update moved it (its label then stands); the error to raise."""
        target = self.target
        assert target is not None
        error = _ERRORS[failed.reason](self.policy, self.url, target, failed.reason, failed.detail)
        log.error(
            "catch-up failed",
            extra={"policy": self.policy, "engine": self.url, "version": target, "reason": failed.reason},
        )
        label = quarantine_label(target)
        try:
            async with asyncio.timeout(_CLEANUP_TIMEOUT):
                now_label = await self.client.weight_version()
                if label_standing(now_label, target) in ("ahead", "busy"):
                    error.add_note(f"not quarantined: it carries {now_label!r}, set by a trainer's update")
                    return error
                await self.client.update_weight_version(label, abort_all_requests=False)
            error.quarantined = True
        except (EngineError, TimeoutError) as exc:
            error.add_note(f"quarantining {self.url} failed too: {exc!r}")
        alert = FleetQuarantined(
            policy=self.policy,
            label=label,
            reason="catchup_failed",
            version=target,
            trainer_id=self.observer,
            published_at=now(),
            engines=(self.url,) if error.quarantined else (),
            failed=() if error.quarantined else (self.url,),
            resumed=self.paused,
            detail=f"{failed.reason}: {failed.detail}"[:500],
        )
        try:
            async with asyncio.timeout(_CLEANUP_TIMEOUT):
                msg_id = f"{self.policy}:catchup-quarantine:{self.url}:{target}:{uuid.uuid4().hex}"
                await self.bus.publish(subjects.alerts(self.policy), alert, msg_id=msg_id)
        except (BusError, TimeoutError) as exc:
            log.error("could not publish the catch-up's quarantine alert", extra={"error": repr(exc)})
            error.add_note(f"the FleetQuarantined alert was not published: {exc!r}")
        return error
