"""``SyncVersionPublisher``: the version publisher for trainers that are not async.

A daemon thread's private loop owns the bus, the fleet and the publisher; each call blocks until done there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from weightbus.bus.options import ConnectOptions
from weightbus.bus.protocol import Bus
from weightbus.engines.sglang import PauseMode
from weightbus.producers.coverage import Push
from weightbus.producers.fleet import EngineFleet
from weightbus.producers.metrics import PublisherMetrics
from weightbus.producers.publisher import VersionPublisher
from weightbus.producers.update import VersionUpdate
from weightbus.schemas import ClaimStanding, LoraAdapter, WeightArtifact

__all__ = ["SyncPublisherState", "SyncUpdate", "SyncVersionPublisher"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class SyncPublisherState:
    """A snapshot of a ``SyncVersionPublisher`` (``SyncVersionPublisher.state``).

    Attributes:
        policy: the policy id.
        trainer_id: this publisher's identity on the bus (None before ``start()``).
        epoch: the claimed epoch (None before ``start()``).
        version: the current published version (None before ``start()``, and for a policy that
            never announced one).
        connected: whether ``connect()`` (or ``start()``) connected the bus.
        started: whether ``start()`` claimed the counter.
    """

    policy: str
    trainer_id: str | None
    epoch: int | None
    version: int | None
    connected: bool
    started: bool


class SyncVersionPublisher:
    """A blocking facade over ``VersionPublisher``; see the module docstring.

    Args:
        policy: the policy id.
        nats_url: NATS URL to connect to (ignored when ``bus_factory`` is given).
        bus_factory: an async callable returning a ``Bus``, called on the private loop (tests, custom
            connections); the bus is closed by ``close()``.
        trainer_id: this publisher's identity (default ``<hostname>:<pid>``).
        engines: SGLang worker URLs to stamp, verify (and pause) around each update.
        router: a router whose ``GET /workers`` lists the engines (instead of ``engines``).
        pause: pause mode for the fleet during an update, or None.
        api_key: bearer token for the engines.
        connect_timeout: seconds for the NATS connect.
        floor: the version of the trainer's own checkpoint; see ``VersionPublisher``.
        options: credentials and TLS for the NATS connect (``ConnectOptions.from_env()`` when None).
        fleet_factory: an async callable returning the ``EngineFleet``, called on the private loop by
            ``start()`` (engines a framework addresses its own way); closed by ``close()``.
        registry: where the update phases and the counter's state are exported
            (``PublisherMetrics``, docs/operations.md#metrics); a private registry when None.

    Raises:
        ValueError: neither ``nats_url`` nor ``bus_factory``; more than one of ``engines``, ``router``
            and ``fleet_factory``.
    """

    def __init__(
        self,
        policy: str,
        *,
        nats_url: str | None = None,
        bus_factory: Callable[[], Awaitable[Bus]] | None = None,
        trainer_id: str | None = None,
        engines: Sequence[str] | None = None,
        router: str | None = None,
        pause: PauseMode | None = None,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        floor: int | None = None,
        options: ConnectOptions | None = None,
        fleet_factory: Callable[[], Awaitable[EngineFleet]] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if bus_factory is None and nats_url is None:
            raise ValueError("pass nats_url or bus_factory")
        if sum(1 for given in (engines, router, fleet_factory) if given) > 1:
            raise ValueError("pass one of engines, router and fleet_factory")
        self._policy = policy
        self._nats_url = nats_url
        self._bus_factory = bus_factory
        self._trainer_id = trainer_id
        self._engines = list(engines or [])
        self._router = router
        self._pause: PauseMode | None = pause
        self._api_key = api_key
        self._connect_timeout = connect_timeout
        self._floor = floor
        self._options = options
        self._fleet_factory = fleet_factory
        # Built once: a publisher started again after close() registers nothing twice.
        self._metrics = PublisherMetrics(registry)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._bus: Bus | None = None
        self._fleet: EngineFleet | None = None
        self._pub: VersionPublisher | None = None

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return self._submit(coro).result()

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Run ``coro`` as a new task on the private loop."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("the publisher is not started (call start() or use it as a context manager)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def publisher(self) -> VersionPublisher:
        """The async publisher running on the private loop."""
        if self._pub is None:
            raise RuntimeError("the publisher is not started")
        return self._pub

    @property
    def state(self) -> SyncPublisherState:
        """Where the publisher stands and what it knows now, as one frozen snapshot (read it again for later values)."""
        pub = self._pub.state if self._pub is not None else None
        return SyncPublisherState(
            policy=self._policy,
            trainer_id=pub.trainer_id if pub is not None else None,
            epoch=pub.epoch if pub is not None else None,
            version=pub.version if pub is not None else None,
            connected=self._bus is not None,
            started=pub is not None,
        )

    @property
    def fleet(self) -> EngineFleet | None:
        """The engine fleet (its methods are coroutines: call them through ``call``)."""
        return self._fleet

    def connect(self) -> SyncVersionPublisher:
        """Start the private loop and connect the bus, without building the fleet or claiming.

        For a trainer whose engines are known only later: connecting at init makes an unreachable
        bus an error there, within ``connect_timeout``; ``start()`` then claims.

        Raises:
            BusConnectError: NATS did not answer.
        """
        if self._bus is not None:
            return self
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="weightbus-publisher", daemon=True)
            self._thread.start()
        try:
            self._bus = self._run(self._aconnect())
        except BaseException:
            self.close()
            raise
        return self

    async def _aconnect(self) -> Bus:
        if self._bus_factory is not None:
            return await self._bus_factory()
        from weightbus.bus.nats import connect

        assert self._nats_url is not None
        return await connect(
            self._nats_url, name="weightbus-trainer", connect_timeout=self._connect_timeout, options=self._options
        )

    def start(self, *, standing: ClaimStanding | None = None, outrank: bool = False) -> SyncVersionPublisher:
        """Start the private loop, connect (unless ``connect()`` did), build the fleet, and claim the counter.

        ``standing`` and ``outrank`` are ``VersionPublisher.start``'s.

        Raises:
            FencedError: ``outrank`` and ``standing`` does not outrank the owner's (nothing published).
            BusConnectError: NATS did not answer.
            EngineError: the router could not list its workers.
            PublishError: the claim failed.
        """
        if self._pub is not None:
            return self
        self.connect()
        try:
            self._pub = self._run(self._astart(standing, outrank))
        except BaseException:
            self.close()
            raise
        return self

    async def _astart(self, standing: ClaimStanding | None, outrank: bool) -> VersionPublisher:
        assert self._bus is not None
        if self._fleet_factory is not None:
            self._fleet = await self._fleet_factory()
        elif self._router:
            self._fleet = await EngineFleet.from_router(self._router, api_key=self._api_key)
        elif self._engines:
            self._fleet = EngineFleet(self._engines, api_key=self._api_key)
        pub = VersionPublisher(
            self._bus,
            self._policy,
            trainer_id=self._trainer_id,
            fleet=self._fleet,
            pause=self._pause,
            floor=self._floor,
            metrics=self._metrics,
        )
        return await pub.start(standing=standing, outrank=outrank)

    def call(self, fn: Callable[[VersionPublisher], Awaitable[_T]]) -> _T:
        """Run ``fn(publisher)`` on the private loop and return its result (e.g. a custom push)."""

        async def _call() -> _T:
            return await fn(self.publisher)

        return self._run(_call())

    def update(
        self,
        *,
        lora: LoraAdapter | None = None,
        push: Push | None = None,
        labels: bool = False,
        artifact: WeightArtifact | None = None,
    ) -> SyncUpdate:
        """One weight update (``with pub.update() as version:``); see ``VersionPublisher.update`` and ``SyncUpdate``."""
        return SyncUpdate(self, lora=lora, push=push, labels=labels, artifact=artifact)

    def publish_lora(
        self,
        adapter: LoraAdapter,
        *,
        pinned: bool = False,
        base: str | None = None,
        artifact: WeightArtifact | None = None,
    ) -> int:
        """Load ``adapter`` on every engine, stamp, and publish; see ``VersionPublisher.publish_lora``."""
        return self._run(self.publisher.publish_lora(adapter, pinned=pinned, base=base, artifact=artifact))

    def close(self) -> None:
        """Write the deferred mark (``VersionPublisher.aclose``), close the fleet and the bus, stop the private loop."""
        loop, thread = self._loop, self._thread
        if loop is None:
            return
        try:
            self._run(self._aclose())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(timeout=10)
            loop.close()
            self._loop = self._thread = None
            self._pub = None

    async def _aclose(self) -> None:
        fleet, bus, pub = self._fleet, self._bus, self._pub
        self._fleet = self._bus = None
        if pub is not None:
            await pub.aclose()  # the deferred mark, while the bus is still open
        if fleet is not None:
            await fleet.aclose()
        if bus is not None:
            await bus.aclose()

    def __enter__(self) -> SyncVersionPublisher:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class SyncUpdate:
    """One ``VersionUpdate`` of a ``SyncVersionPublisher``, begun and ended in one task on its private loop.

    ``begin()`` starts a task on the loop that begins the update and then waits there for the
    outcome; ``commit()`` or ``abort(exc)`` hands it the outcome and blocks until that task has
    ended the update. So both halves run in the same task, and task-bound state (a cancel scope,
    a context variable, ``asyncio.timeout``) set while beginning is there while ending. ``with``
    runs them: ``begin`` on entering, ``commit`` on a normal exit, ``abort`` on an exception (which
    is then raised). Arguments are ``VersionPublisher.update``'s.

    Attributes:
        version: the version the push carries (set by ``begin()``).
        artifact: what the announcement carries as ``WeightUpdated.artifact`` (``VersionUpdate.artifact``); set
            it inside the block, once the version is known, before ``commit()``.
        update: the ``VersionUpdate`` on the loop (its ``missing``, ``stamps`` and ``event``; call its
            coroutines such as ``before_push`` through ``SyncVersionPublisher.call``), set by ``begin()``.
    """

    def __init__(
        self,
        owner: SyncVersionPublisher,
        *,
        lora: LoraAdapter | None,
        push: Push | None,
        labels: bool,
        artifact: WeightArtifact | None = None,
    ) -> None:
        if lora is not None and artifact is not None and artifact.lineage == "full":
            raise ValueError("a LoRA update's artifact is a delta (the adapter on the previous base)")
        self._owner = owner
        self._args = (lora, push, labels)
        self._artifact = artifact
        self.version: int | None = None
        self.update: VersionUpdate | None = None
        self._outcome: concurrent.futures.Future[BaseException | None] | None = None
        self._task: concurrent.futures.Future[None] | None = None

    @property
    def artifact(self) -> WeightArtifact | None:
        """What the announcement carries as ``WeightUpdated.artifact``; see the class docstring."""
        return self.update.artifact if self.update is not None else self._artifact

    @artifact.setter
    def artifact(self, artifact: WeightArtifact | None) -> None:
        # Set in the block on the caller's thread; the loop reads it only after commit() hands it the outcome.
        self._artifact = artifact
        if self.update is not None:
            self.update.artifact = artifact

    @property
    def phases(self) -> dict[str, float]:
        """Seconds each phase of the update took (``VersionUpdate.phases``); empty before ``begin()``."""
        return dict(self.update.phases) if self.update is not None else {}

    def begin(self) -> int:
        """Take the number and pause (``VersionUpdate.begin``) in a new task on the loop; return the version.

        Raises:
            RuntimeError: the publisher is not started, or this update was begun.
            Whatever ``VersionUpdate.begin`` raises (then the update is over).
        """
        if self._task is not None:
            raise RuntimeError("begin() belongs to a new update; this one was begun")
        lora, push, labels = self._args
        update = self._owner.publisher.update(lora=lora, push=push, labels=labels, artifact=self._artifact)
        begun: concurrent.futures.Future[int] = concurrent.futures.Future()
        outcome: concurrent.futures.Future[BaseException | None] = concurrent.futures.Future()
        self._task = task = self._owner._submit(_drive(update, begun, outcome))
        either: list[concurrent.futures.Future[Any]] = [begun, task]
        concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
        if not begun.done():
            task.result()  # the task ended before it began the update: raise why
            raise RuntimeError("the update's task ended without beginning it")
        self.version = begun.result()  # raises what begin() raised; the task has ended then
        self.update, self._outcome = update, outcome
        return self.version

    def commit(self) -> None:
        """Stamp, read back, announce, resume (``VersionUpdate.commit``), in the task that began the update."""
        self._end(None)

    def abort(self, exc: BaseException) -> None:
        """Quarantine and resume after ``exc`` (``VersionUpdate.abort``), in the task that began the update.

        ``exc`` is not raised here: the caller raises it.
        """
        self._end(exc)

    def _end(self, exc: BaseException | None) -> None:
        outcome, task = self._outcome, self._task
        if outcome is None or task is None:
            raise RuntimeError("commit() and abort() belong to a begun update")
        if outcome.done():
            raise RuntimeError("this update is over")
        if self._owner._loop is None:
            raise RuntimeError("the publisher was closed during the update")
        outcome.set_result(exc)
        task.result()

    def __enter__(self) -> int:
        return self.begin()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.commit()
        else:
            self.abort(exc)


async def _drive(
    update: VersionUpdate,
    begun: concurrent.futures.Future[int],
    outcome: concurrent.futures.Future[BaseException | None],
) -> None:
    """Begin ``update``, wait for the caller's outcome, and end it, all in this one task."""
    try:
        version = await update.begin()
    except BaseException as exc:
        begun.set_exception(exc)
        raise
    begun.set_result(version)
    failure = await asyncio.wrap_future(outcome)
    if failure is None:
        await update.commit()
    else:
        await update.abort(failure)
