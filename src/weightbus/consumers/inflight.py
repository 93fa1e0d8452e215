"""Early abort: a rollout host's groups still generating, and the engine aborts of those that must be stale.

Only certainty aborts (``rules.abort``), at most once per flight; a failed abort changes nothing else: an
optimisation, never a judgement. See docs/rollout.md#early-abort.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any

import httpx

from weightbus.engines import SGLangClient, discover_workers
from weightbus.errors import EngineError
from weightbus.rules.abort import certain_stale, oldest_bound
from weightbus.rules.source import CurrentSource, version_or_none
from weightbus.schemas.rollouts import parse_version

__all__ = ["EngineAborter", "Flight", "InFlightGroups", "oldest_label"]

log = logging.getLogger("weightbus.consumers")

ABORT_MESSAGE = "weightbus: certain to exceed the staleness bound"


def oldest_label(meta_info: Mapping[str, Any]) -> int | None:
    """The oldest version a ``/generate`` answer's ``meta_info`` names (its label and its token spans)."""
    labels = [meta_info.get("weight_version")]
    spans = meta_info.get("weight_versions")
    if isinstance(spans, list):
        labels.extend(span.get("version") for span in spans if isinstance(span, dict))
    versions = [parse_version(label if isinstance(label, str) else str(label)) for label in labels if label is not None]
    return oldest_bound(versions)


class Flight:
    """One group being generated: its request ids and what its finished requests reported."""

    __slots__ = ("key", "rids", "oldest", "done", "aborted")

    def __init__(self, key: str, size: int) -> None:
        self.key = key
        self.rids = [f"{key}-{i}" for i in range(size)]
        self.oldest: list[int | None] = [None] * size
        self.done = [False] * size
        self.aborted = False
        """Whether the group was found certain to be stale (its unfinished requests were sent aborts)."""

    @property
    def unfinished(self) -> list[str]:
        """The rids still generating."""
        return [rid for rid, done in zip(self.rids, self.done, strict=True) if not done]


class InFlightGroups:
    """The groups a rollout is generating, checked against the bound on every version change.

    Args:
        max_staleness: the drain's bound (None: never abort).
        current: the version source (a tracker or a callable), read at each check; one that cannot say aborts nothing.
        abort: sends the aborts of a list of rids; awaited in the background.
    """

    def __init__(
        self,
        max_staleness: int | None,
        current: CurrentSource,
        abort: Callable[[list[str]], Coroutine[Any, Any, None]],
    ) -> None:
        self.max_staleness = max_staleness
        self._current = current
        self._abort = abort
        self._flights: dict[str, Flight] = {}
        self._keys = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self.aborts_sent = 0
        """Flights aborted so far."""

    def open(self, prefix: str, size: int) -> Flight:
        """Register a group about to be generated with ``size`` requests."""
        flight = Flight(f"{prefix}-{next(self._keys)}", size)
        self._flights[flight.key] = flight
        return flight

    def close(self, flight: Flight) -> None:
        """The group's generation ended (answered, aborted or failed)."""
        self._flights.pop(flight.key, None)

    def finished(self, flight: Flight, index: int, oldest: int | None) -> None:
        """Request ``index`` of ``flight`` answered, naming ``oldest``; abort the rest if now certain stale."""
        flight.done[index] = True
        flight.oldest[index] = oldest
        self._check(flight, self._read_current())

    def check(self, current: int | None = None) -> int:
        """A version change: abort every flight now certain to be stale; returns how many."""
        if current is None:
            current = self._read_current()
        return sum(self._check(flight, current) for flight in list(self._flights.values()))

    def __len__(self) -> int:
        return len(self._flights)

    async def wait_sent(self) -> None:
        """Wait for the aborts sent so far (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _read_current(self) -> int | None:
        return version_or_none(self._current)  # a tracker that is not ready knows nothing: never abort on it

    def _check(self, flight: Flight, current: int | None) -> bool:
        if flight.aborted or not certain_stale(oldest_bound(flight.oldest), current, self.max_staleness):
            return False
        flight.aborted = True
        self.aborts_sent += 1
        rids = flight.unfinished
        if rids:
            task = asyncio.get_running_loop().create_task(self._abort(rids), name=f"weightbus-abort-{flight.key}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True


class EngineAborter:
    """Sends ``/abort_request`` by rid to every worker behind a router (routers do not forward it).

    Args:
        router_url: the router whose ``GET /workers`` lists the engines.
        http: a shared ``httpx.AsyncClient`` to borrow.
        engines: the worker URLs, when known (skips the discovery).
    """

    def __init__(self, router_url: str, http: httpx.AsyncClient, engines: Iterable[str] | None = None) -> None:
        self.router_url = router_url
        self._http = http
        self._clients: list[SGLangClient] | None = (
            None if engines is None else [SGLangClient(url, http=http) for url in engines]
        )
        self.failures = 0
        """Aborts that no worker confirmed (the requests then finish normally)."""

    async def _workers(self) -> list[SGLangClient]:
        if self._clients is None:
            urls = await discover_workers(self.router_url, http=self._http)
            self._clients = [SGLangClient(url, http=self._http) for url in urls]
        return self._clients

    async def __call__(self, rids: list[str]) -> None:
        try:
            clients = await self._workers()
        except EngineError as exc:
            self.failures += 1
            log.warning("early abort: cannot list the workers", extra={"error": str(exc)})
            return
        results = await asyncio.gather(
            *(client.abort_request(rid, message=ABORT_MESSAGE) for client in clients for rid in rids),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            self.failures += 1
            self._clients = None  # the fleet may have changed: list it again next time
            log.warning("early abort not delivered", extra={"rids": rids, "error": repr(errors[0])})
