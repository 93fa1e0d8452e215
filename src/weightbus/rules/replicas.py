"""The replica view: which version each engine acknowledged serving, and how each announced version converged.

One pure fold of a policy's ``WeightUpdated`` (the announcement), ``WeightApplied`` (an engine's activation
acknowledgement: its read-back after the stamp) and the alerts that leave an engine's weights unknown
(``EngineOutOfSync``, ``FleetQuarantined``). The monitor behind ``weightbus watch``, ``weightbus status``, the
convergence metrics and the version-constrained rollout client all read this one view.

Invariants:

* No I/O and no clock: every time is an event's own ``published_at``.
* An engine serves a version only after an ``ok`` read-back of it, never because a version was announced.
* An out-of-sync alert, a failed read-back, or a quarantine that names the engine leaves it serving nothing known,
  until a later ``ok`` read-back.
* Per engine, the newest observation by ``published_at`` decides, whatever order events arrive in; at equal times
  the unknown one wins (when weightbus cannot know, it errs toward stale). An older event arriving late still records
  its acknowledgement time, and a duplicate changes nothing.
* Bounded: only the newest ``max_versions`` versions keep their rollout (announcement and acknowledgement times).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from weightbus.schemas import EngineOutOfSync, FleetQuarantined, WeightApplied, WeightUpdated

__all__ = [
    "DEFAULT_SHARES",
    "Activation",
    "Convergence",
    "EngineReplica",
    "ReplicaEvent",
    "ReplicaView",
    "VersionRollout",
    "fold_replicas",
    "newly_activated",
    "newly_converged",
    "observe",
]

ReplicaEvent = WeightUpdated | WeightApplied | EngineOutOfSync | FleetQuarantined
"""The events the view folds; anything else leaves it unchanged."""

#: The shares of a version's fleet whose convergence time is measured by default: all of it, and 90%.
DEFAULT_SHARES = (1.0, 0.9)


@dataclass(frozen=True, slots=True)
class EngineReplica:
    """What one engine serves, as far as the events say.

    Attributes:
        engine: the engine's URL.
        serving: the version it acknowledged serving (an ``ok`` read-back); None: nothing known.
        label: what the deciding event says it carries (the read-back, the alert's label).
        since: the deciding event's ``published_at``.
        reason: why nothing is known (``read_back``, ``unexpected_label``, ``not_covered``, ``quarantined``);
            None while it serves a version.
    """

    engine: str
    serving: int | None
    label: str | None
    since: float
    reason: str | None = None

    def serves(self, *, min_version: int | None = None, exact_version: int | None = None) -> bool:
        """Whether the version it serves is ``exact_version`` (when given) and at least ``min_version`` (when given)."""
        if self.serving is None:
            return False
        if exact_version is not None and self.serving != exact_version:
            return False
        return min_version is None or self.serving >= min_version


@dataclass(frozen=True, slots=True)
class VersionRollout:
    """One version's way through the fleet.

    Attributes:
        version: the version.
        announced_at: the ``published_at`` of its ``WeightUpdated`` (None: not seen yet).
        announced_engines: the engines its announcement says were stamped and read back.
        acks: engine URL → the earliest ``published_at`` of an ``ok`` read-back of this version.
        expected: engines an alert said should have reached this version and did not (``not_covered``,
            ``read_back``): part of the fleet, never acknowledged.
    """

    version: int
    announced_at: float | None = None
    announced_engines: tuple[str, ...] = ()
    acks: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    expected: frozenset[str] = frozenset()

    @property
    def fleet(self) -> tuple[str, ...]:
        """The engines this version is meant to reach: those announced, acknowledged, or alerted for it, sorted."""
        return tuple(sorted({*self.announced_engines, *self.acks, *self.expected}))

    def converged_at(self, share: float = 1.0) -> float | None:
        """When ``share`` of the fleet had acknowledged it (the k-th acknowledgement's time); None: not yet.

        Raises:
            ValueError: ``share`` is not in (0, 1].
        """
        if not 0.0 < share <= 1.0:
            raise ValueError(f"a share of the fleet is in (0, 1], not {share}")
        fleet = self.fleet
        if not fleet:
            return None
        needed = math.ceil(share * len(fleet) - 1e-9)
        times = sorted(self.acks[e] for e in fleet if e in self.acks)
        return times[needed - 1] if len(times) >= needed else None

    def time_to_converge(self, share: float = 1.0) -> float | None:
        """Seconds from the announcement to ``share`` of the fleet acknowledged (0 when acknowledged before it)."""
        at = self.converged_at(share)
        if at is None or self.announced_at is None:
            return None
        return max(0.0, at - self.announced_at)

    def activation(self, engine: str) -> float | None:
        """Seconds from the announcement to ``engine``'s acknowledgement (None: one of them not seen)."""
        ack = self.acks.get(engine)
        if ack is None or self.announced_at is None:
            return None
        return max(0.0, ack - self.announced_at)


@dataclass(frozen=True, slots=True)
class Convergence:
    """How far a version has reached: ``serving`` of the ``fleet`` engines serve it or newer now."""

    version: int
    serving: int
    fleet: int
    announced_at: float | None
    converged_in: float | None
    """Seconds from its announcement to the whole fleet acknowledged; None while it has not."""

    @property
    def converged(self) -> bool:
        """Every engine of the fleet serves it (or newer) now."""
        return self.fleet > 0 and self.serving >= self.fleet


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """The fold: per engine what it serves, per version its rollout.

    Attributes:
        engines: engine URL → its replica, for every engine any event named.
        versions: version → its rollout (the newest ``max_versions``).
        newest: the highest version announced (None: none).
        max_versions: how many versions keep their rollout.
    """

    engines: Mapping[str, EngineReplica] = field(default_factory=lambda: MappingProxyType({}))
    versions: Mapping[int, VersionRollout] = field(default_factory=lambda: MappingProxyType({}))
    newest: int | None = None
    max_versions: int = 32

    def serving(self, *, min_version: int | None = None, exact_version: int | None = None) -> tuple[str, ...]:
        """The engines known to serve a version that satisfies the constraint, sorted."""
        return tuple(
            sorted(
                e.engine
                for e in self.engines.values()
                if e.serves(min_version=min_version, exact_version=exact_version)
            )
        )

    def convergence(self, version: int | None = None) -> Convergence | None:
        """How far ``version`` (default: the newest announced) has reached; None without such a rollout."""
        version = self.newest if version is None else version
        rollout = None if version is None else self.versions.get(version)
        if rollout is None:
            return None
        fleet = rollout.fleet
        serving = sum(
            1 for e in fleet if self.engines.get(e) is not None and self.engines[e].serves(min_version=version)
        )
        return Convergence(rollout.version, serving, len(fleet), rollout.announced_at, rollout.time_to_converge(1.0))

    def unconverged_since(self) -> float | None:
        """The announcement time of the oldest version announced after the newest one that converged; None: none.

        A version counts as settled once it, or any later version, reached its whole fleet: an engine that leaves
        the fleet holds up only the versions announced before one that converged without it. A version no engine
        was named for (announced without engines, none acknowledged or alerted) has no fleet and holds up nothing.
        The alert on a version that does not converge within a bound compares this time with the clock
        (docs/operations.md).
        """
        done = self.last_converged()
        pending = [
            r.announced_at
            for v, r in self.versions.items()
            if r.announced_at is not None and r.fleet and (done is None or v > done.version)
        ]
        return min(pending) if pending else None

    def last_converged(self) -> VersionRollout | None:
        """The newest announced version whose whole fleet acknowledged it, if any is kept."""
        for version in sorted(self.versions, reverse=True):
            rollout = self.versions[version]
            if rollout.announced_at is not None and rollout.converged_at(1.0) is not None:
                return rollout
        return None


def _newer(current: EngineReplica | None, at: float, unknown: bool) -> bool:
    """Whether an observation at ``at`` decides over ``current`` (later wins; at a tie, the unknown one)."""
    if current is None or at > current.since:
        return True
    return at == current.since and unknown and current.serving is not None


def _set_engine(
    engines: dict[str, EngineReplica],
    engine: str,
    serving: int | None,
    label: str | None,
    at: float,
    reason: str | None,
) -> None:
    current = engines.get(engine)
    if not _newer(current, at, serving is None):
        return
    if current is not None and at == current.since and serving is not None and current.serving is not None:
        serving = min(serving, current.serving)  # two acknowledgements at one instant: the older one, toward stale
    engines[engine] = EngineReplica(engine, serving, label, at, reason)


def observe(view: ReplicaView, event: object) -> ReplicaView:
    """The view after ``event``; ``view`` is unchanged. Events the view does not fold return ``view`` itself."""
    match event:
        case WeightUpdated():
            rollout = view.versions.get(event.version) or VersionRollout(event.version)
            if rollout.announced_at is not None and rollout.announced_at <= event.published_at:
                return view  # a duplicate, or a later copy: the first announcement is the announcement
            rollout = replace(rollout, announced_at=event.published_at, announced_engines=event.engines)
            newest = event.version if view.newest is None else max(view.newest, event.version)
            return _with_rollout(replace(view, newest=newest), rollout)
        case WeightApplied():
            engines = dict(view.engines)
            if event.ok:
                _set_engine(engines, event.engine, event.version, event.read_back, event.published_at, None)
                rollout = view.versions.get(event.version) or VersionRollout(event.version)
                first = rollout.acks.get(event.engine)
                if first is None or event.published_at < first:
                    acks = dict(rollout.acks)
                    acks[event.engine] = event.published_at
                    rollout = replace(rollout, acks=MappingProxyType(acks))
            else:
                _set_engine(engines, event.engine, None, event.read_back, event.published_at, "read_back")
                rollout = _expect(view.versions.get(event.version) or VersionRollout(event.version), event.engine)
            return _with_rollout(replace(view, engines=MappingProxyType(engines)), rollout)
        case EngineOutOfSync():
            engines = dict(view.engines)
            _set_engine(engines, event.engine, None, event.actual, event.published_at, event.reason)
            out = replace(view, engines=MappingProxyType(engines))
            if event.reason != "unexpected_label" and event.expected.isdigit():
                # Stamped with (or meant to reach) ``expected`` and did not: that version's fleet includes it.
                version = int(event.expected)
                out = _with_rollout(out, _expect(view.versions.get(version) or VersionRollout(version), event.engine))
            return out
        case FleetQuarantined():
            engines = dict(view.engines)
            for engine in (*event.engines, *event.failed):
                _set_engine(engines, engine, None, event.label, event.published_at, "quarantined")
            return replace(view, engines=MappingProxyType(engines))
    return view


def _expect(rollout: VersionRollout, engine: str) -> VersionRollout:
    return rollout if engine in rollout.expected else replace(rollout, expected=rollout.expected | {engine})


def _with_rollout(view: ReplicaView, rollout: VersionRollout) -> ReplicaView:
    versions = dict(view.versions)
    versions[rollout.version] = rollout
    if len(versions) > view.max_versions:
        for version in sorted(versions)[: len(versions) - view.max_versions]:
            del versions[version]
        if rollout.version not in versions:
            return view  # older than every version kept: nothing to record
    return replace(view, versions=MappingProxyType(versions))


def fold_replicas(events: Iterable[object], *, max_versions: int = 32) -> ReplicaView:
    """Fold ``events`` (any order) into a fresh view keeping ``max_versions`` rollouts."""
    view = ReplicaView(max_versions=max_versions)
    for event in events:
        view = observe(view, event)
    return view


@dataclass(frozen=True, slots=True)
class Activation:
    """A time the view can tell now and could not before: from ``version``'s announcement to a point of its rollout.

    ``engine`` is the engine that acknowledged (an activation), or None for a share of the fleet (a convergence,
    ``share`` set).
    """

    version: int
    seconds: float
    engine: str | None = None
    share: float | None = None


def newly_activated(before: ReplicaView, after: ReplicaView) -> list[Activation]:
    """Each engine's announcement-to-acknowledgement time ``after`` knows and ``before`` did not."""
    out: list[Activation] = []
    for version, rollout in after.versions.items():
        old = before.versions.get(version)
        for engine in rollout.acks:
            seconds = rollout.activation(engine)
            if seconds is not None and (old is None or old.activation(engine) is None):
                out.append(Activation(version, seconds, engine=engine))
    return out


def newly_converged(
    before: ReplicaView, after: ReplicaView, shares: Iterable[float] = DEFAULT_SHARES
) -> list[Activation]:
    """Each version's time to converge to each of ``shares`` that ``after`` knows and ``before`` did not."""
    out: list[Activation] = []
    for version, rollout in after.versions.items():
        old = before.versions.get(version)
        for share in shares:
            seconds = rollout.time_to_converge(share)
            if seconds is not None and (old is None or old.time_to_converge(share) is None):
                out.append(Activation(version, seconds, share=share))
    return out
