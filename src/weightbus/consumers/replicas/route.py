"""Version-constrained requests: the engine a request may go to, picked from the live replica view, never guessed.

A request may carry a ``min_version`` or an ``exact_version`` (``VersionConstraint``). ``VersionRouter.pick`` chooses,
among the engines a ready ``ReplicaFollower`` knows serve a satisfying version (``rules.replicas``: an activation
acknowledgement, no alert or quarantine since), one at random; it waits at most ``wait_s`` for one and then raises
``VersionUnavailableError`` (retryable). Invariants: no engine is picked before the follower is ready nor from an
announcement alone; the version the pick reports is the one the view says the engine serves, which the caller
records as the sample's start label, so the drain judges a sample by the version it started on (or an older label its
answer reports), never fresher.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from weightbus.consumers.replicas.follower import ReplicaFollower
from weightbus.consumers.replicas.metrics import PolicyRequestMetrics
from weightbus.errors import VersionUnavailableError
from weightbus.rules.replicas import ReplicaView

__all__ = ["PickedEngine", "VersionConstraint", "VersionRouter"]


@dataclass(frozen=True, slots=True)
class VersionConstraint:
    """The versions a request allows: at least ``min_version`` and, when given, exactly ``exact_version``.

    Raises:
        ValueError: a negative version, or an exact version below the minimum.
    """

    min_version: int | None = None
    exact_version: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("min_version", self.min_version), ("exact_version", self.exact_version)):
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be a version (an int >= 0), got {value!r}")
        if self.min_version is not None and self.exact_version is not None and self.exact_version < self.min_version:
            raise ValueError(f"exact_version {self.exact_version} is below min_version {self.min_version}")

    @property
    def requested(self) -> int | None:
        """The version asked for: the exact one, else the minimum (None: any)."""
        return self.exact_version if self.exact_version is not None else self.min_version

    def engines(self, view: ReplicaView) -> tuple[str, ...]:
        """The engines ``view`` knows serve a version this allows, sorted."""
        return view.serving(min_version=self.min_version, exact_version=self.exact_version)


@dataclass(frozen=True, slots=True)
class PickedEngine:
    """The engine a request goes to, and what the view said when it was picked.

    Attributes:
        engine: its URL (a worker behind the router, as its ``WeightApplied`` names it).
        version: the version the view says it serves: the request's start version.
        newest: the newest version announced at the pick (None: none).
    """

    engine: str
    version: int
    newest: int | None


class VersionRouter:
    """Pick engines for version-constrained requests from ``follower``'s view.

    Args:
        follower: the live replica view of the policy (started by the caller).
        wait_s: the longest a pick waits for a satisfying engine before ``VersionUnavailableError``.
        rng: chooses among satisfying engines (seed it for tests).
        metrics: the request metrics of this policy (``RequestMetrics(registry).for_policy(policy)``).

    Raises:
        ValueError: a negative ``wait_s``.
    """

    def __init__(
        self,
        follower: ReplicaFollower,
        *,
        wait_s: float = 10.0,
        rng: random.Random | None = None,
        metrics: PolicyRequestMetrics | None = None,
    ) -> None:
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.follower = follower
        self.wait_s = wait_s
        self._rng = rng if rng is not None else random.Random()
        self._metrics = metrics

    async def pick(self, constraint: VersionConstraint) -> PickedEngine:
        """An engine known to serve a version ``constraint`` allows, waiting up to ``wait_s`` for one.

        Raises:
            VersionUnavailableError: none within ``wait_s`` (or the follower not ready by then).
        """
        started = time.monotonic()

        def found(view: ReplicaView) -> PickedEngine | None:
            engines = constraint.engines(view)
            if not engines:
                return None
            engine = self._rng.choice(engines)
            version = view.engines[engine].serving
            assert version is not None
            return PickedEngine(engine, version, view.newest)

        try:
            picked = await self.follower.wait_until(found, self.wait_s)
        except TimeoutError:
            view = self.follower.view
            if self._metrics is not None:
                self._metrics.unavailable(constraint.exact_version is not None)
            raise VersionUnavailableError(
                self.follower.policy,
                constraint.min_version,
                constraint.exact_version,
                time.monotonic() - started,
                view.newest,
                {e.engine: e.serving for e in view.engines.values()},
            ) from None
        if self._metrics is not None:
            self._metrics.picked(constraint.requested, picked.version, picked.newest)
        return picked
