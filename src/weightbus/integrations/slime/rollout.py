"""The rollout half of the slime integration: a rollout function around slime's fully-async one (``generate_rollout``).

slime's worker, queue and data buffer run unchanged; weightbus stands at two of its seams. The data buffer the worker
tops up from is ``GatedDataBuffer``: a prompt group is handed out only with an ``Admission`` slot (none free: the
top-up waits, as slime's queue gate makes it), and a pristine copy of it is kept. Each group slime collects is judged
by the drain engine against the version a ``VersionTracker`` follows on the bus (slime has none of its own): kept,
or recycled (its pristine copy back through ``add_samples``) or dropped. Invariants: a tracker that cannot say what is
current admits nothing and judges nothing (the collected groups are held, never lost); every group handed out is
trained, recycled, dropped (counted) or still in slime's worker. The session lives on slime's own background loop
(``slime.utils.async_utils``); the worker thread reaches it through ``call``. docs/integrations/slime.md.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from weightbus.consumers.admission import AcceptedGroups, Admission, Slot
from weightbus.consumers.inflight import EngineAborter, Flight, InFlightGroups
from weightbus.consumers.tracker.tracker import VersionTracker
from weightbus.integrations.host.drain import staleness_stage
from weightbus.integrations.host.groups import group_key, to_weightbus_group
from weightbus.integrations.host.rollout import RolloutSetup
from weightbus.integrations.host.settings import seconds, setting
from weightbus.rules.source import read_version, version_or_none
from weightbus.schemas.rollouts import Group, SampleStatus, parse_version

if TYPE_CHECKING:
    import httpx

    from weightbus.bus.protocol import Bus

__all__ = ["DEFAULT_ROLLOUT", "GatedDataBuffer", "SlimeRollout", "active_rollout", "generate_rollout", "shutdown"]

log = logging.getLogger("weightbus.integrations.slime")

#: slime's fully-async rollout function, wrapped unless ``WEIGHTBUS_ROLLOUT_FUNCTION`` names another.
DEFAULT_ROLLOUT: Final = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
_ENTRY: Final = "slime_group"  # a converted group's metadata: slime's list[Sample]
_PRISTINE: Final = "slime_pristine"  # ... and the copy taken when it was handed out
_T = TypeVar("_T")


def _int_setting(args: Any, name: str, env: str) -> int | None:
    raw = setting(args, name, env)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{env} (args.{name}) must be a number of versions, not {raw!r}") from None
    if value < 0:
        raise ValueError(f"{env} (args.{name}) must be >= 0, not {value}")
    return value


@dataclass(slots=True)
class _Entry:
    """A group handed out to slime's worker: its slot, its pristine copy, its requests."""

    slot: Slot | None
    pristine: list[Any]
    started_at: float
    flight: Flight | None = None


class SlimeRollout:
    """One process' weightbus session for slime's rollout side (one per policy; ``active_rollout``).

    Args:
        args: slime's namespace (``rollout_batch_size``, ``n_samples_per_prompt``, ``sglang_router_ip`` /
            ``sglang_router_port``, ``sglang_server_concurrency``, ``rollout_max_response_len``) and weightbus'
            settings (``weightbus_*`` attributes, else ``WEIGHTBUS_*``; docs/integrations/slime.md#settings).
        loop: the loop the session lives on (slime's background loop).
        bus: a connected bus to use instead of connecting to ``WEIGHTBUS_NATS`` (tests, shared connections).

    The bus, the tracker, the drain reporter and the admission gate are ``integrations.host.rollout``'s
    ``RolloutSetup``: the connect settings (URL, credentials, TLS, timeout) are read from ``args`` first, then the
    variables, when ``start`` connects.

    Raises:
        ValueError: no policy, a bad bound, ``on_stale``, unknown-label policy, ready timeout or metrics port.
    """

    def __init__(self, args: Any, loop: asyncio.AbstractEventLoop, *, bus: Bus | None = None) -> None:
        policy = setting(args, "weightbus_policy", "WEIGHTBUS_POLICY")
        if not policy:
            raise ValueError("set the policy to follow: args.weightbus_policy or the WEIGHTBUS_POLICY variable")
        batch = getattr(args, "rollout_batch_size", None)
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"args.rollout_batch_size must be a positive int, not {batch!r}")
        self.args = args
        self.policy = policy
        self.loop = loop
        self.batch = batch
        self.max_staleness = _int_setting(args, "weightbus_max_staleness", "WEIGHTBUS_MAX_STALENESS")
        on_stale = setting(args, "weightbus_on_stale", "WEIGHTBUS_ON_STALE", "recycle")
        if on_stale not in ("recycle", "drop"):
            raise ValueError(f"WEIGHTBUS_ON_STALE must be 'recycle' or 'drop', not {on_stale!r}")
        self.ready_timeout = seconds(args, "weightbus_ready_timeout", "WEIGHTBUS_READY_TIMEOUT", "30")
        early = setting(args, "weightbus_early_abort", "WEIGHTBUS_EARLY_ABORT", "1") or "1"
        self.early_abort = early.lower() in ("1", "true", "yes", "on") and self.max_staleness is not None
        self._setup = RolloutSetup(args, host="slime", policy=policy, bus=bus)
        metrics = self._setup.metrics
        drain_metrics = metrics.drain.for_policy(policy) if metrics is not None else None
        self.stage = staleness_stage(
            args,
            max_staleness=self.max_staleness,
            on_stale="recycle" if on_stale == "recycle" else "drop",
            metrics=drain_metrics,
        )
        self._accepted = AcceptedGroups()
        self.window = self.stage.window(on_unused=self._unused, slots=self._accepted)
        self.consumer = self._setup.consumer
        self.data_source: Any = None
        self.gate: Admission | None = None
        """The admission gate at slime's top-up, once started (None: ``WEIGHTBUS_ADMISSION=off``)."""
        self.inflight: InFlightGroups | None = None
        self._http: httpx.AsyncClient | None = None
        self._started = False
        self._entries: dict[int, _Entry] = {}
        self._requests: dict[tuple[int, int], tuple[Flight, int]] = {}
        self._held: deque[Group] = deque()  # collected, admitted to the window, not judged yet
        self._carried: list[list[Any]] = []  # kept by a rollout call that failed later: the next call's first
        self._follow: asyncio.Task[None] | None = None
        self._waiting_logged = False
        self._closed = False
        self.handed_out = 0
        """Groups handed to slime's worker so far."""
        self.recycled: list[list[Any]] = []
        """The pristine groups recycled to the data buffer since the start (tests and accounts read it)."""
        self._setup.serve()

    @property
    def tracker(self) -> VersionTracker | None:
        """The version tracker, once started."""
        return self._setup.tracker

    # -- lifecycle (on the session's loop) -------------------------------------------------------

    async def start(self, data_source: Any) -> None:
        """Connect, follow the policy, and make the gate and the in-flight registry; idempotent."""
        self.data_source = data_source
        if self._started:
            return
        # slime's judgement waits for the tracker itself (``_read_version``): the start does not.
        tracker = await self._setup.start(self.window, drain_metrics=self.stage.metrics)
        self.gate = await self._setup.admission(
            version=lambda: read_version(tracker),  # not ready: raises, and the gate admits nothing
            default_cap=self._worker_groups,
            max_staleness=self.max_staleness,
        )
        self._started = True
        if self.early_abort:
            import httpx

            self._http = httpx.AsyncClient(timeout=10.0)
            router = f"http://{self.args.sglang_router_ip}:{self.args.sglang_router_port}"
            self.inflight = InFlightGroups(self.max_staleness, tracker, EngineAborter(router, self._http))
        self._follow = asyncio.create_task(self._follow_versions(tracker), name="weightbus-slime-versions")
        if self.max_staleness is None:
            log.warning(
                "no staleness bound (WEIGHTBUS_MAX_STALENESS): staleness is measured, no group is filtered",
                extra={"policy": self.policy},
            )

    async def aclose(self) -> None:
        """Stop following, let the aborts in flight be sent, then the setup's teardown (``RolloutSetup.aclose``:
        the shared budget's slots, pending reports, the tracker, the bus if opened here, the metrics port)."""
        self._closed = True  # slime's worker may outlive the session: it is handed nothing more
        follow, self._follow = self._follow, None
        if follow is not None:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
        if self.inflight is not None:
            await self.inflight.wait_sent()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        self._started = False
        await self._setup.aclose()

    # -- from slime's worker thread --------------------------------------------------------------

    def call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the session's loop and return its result (from another thread: slime's worker)."""
        try:
            if asyncio.get_running_loop() is self.loop:
                return fn()
        except RuntimeError:
            pass  # no loop in this thread: slime's worker calls from its own, or a plain thread
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return done.result()

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the session's loop soon (from slime's worker thread, without waiting)."""
        self.loop.call_soon_threadsafe(fn)

    # -- the top-up gate (on the session's loop) -------------------------------------------------

    def hand_out(self, num_samples: int) -> list[list[Any]]:
        """Up to ``num_samples`` prompt groups from the data source, each with a slot; [] while none is free."""
        out: list[list[Any]] = []
        if self._closed:
            return out
        for _ in range(num_samples):
            slot = None
            if self.gate is not None:
                slot = self.gate.try_acquire()
                if slot is None:
                    if self._setup.budget is not None:
                        self._setup.budget.wanted()  # as a waiting acquire would: the shared budget lends more
                    if not self._waiting_logged:
                        self._waiting_logged = True
                        log.info(
                            "admission holds slime's top-up: the horizon is full or the version is not known",
                            extra={"policy": self.policy, "running": self.gate.running, "ready": self.gate.ready},
                        )
                    break
                self._waiting_logged = False
            got = self.data_source.get_samples(1)
            if not got:
                if slot is not None:
                    slot.release("finished")
                break
            group = got[0]
            key = group_key(group)
            if key is None:
                if slot is not None:
                    slot.release("aborted")
                self.data_source.add_samples([group])
                raise ValueError("weightbus needs slime's Sample.group_index on every sample (its data source)")
            entry = _Entry(slot=slot, pristine=copy.deepcopy(group), started_at=time.time())
            if self.inflight is not None:
                entry.flight = flight = self.inflight.open(f"wb-{key}-{uuid.uuid4().hex[:6]}", len(group))
                for i, sample in enumerate(group):
                    self._requests[(key, _index(sample, i))] = (flight, i)
            self._entries[key] = entry
            self.handed_out += 1
            out.append(group)
        return out

    def request(self, sample: Any) -> tuple[Flight, int] | None:
        """The flight and request index of ``sample`` (a handed-out group's), for its generate call's rid."""
        key = getattr(sample, "group_index", None)
        if not isinstance(key, int):
            return None
        return self._requests.get((key, _index(sample, -1)))

    def returned(self, groups: list[list[Any]]) -> None:
        """slime's worker hands groups back (its aborted path, ``add_samples``): routed by the drain engine."""
        for group in groups:
            key = group_key(group)
            entry = self._entries.pop(key, None) if key is not None else None
            if entry is None:
                self.data_source.add_samples([group])  # not handed out here: slime's own, as slime would
                continue
            wb = self._arrived(group, entry)
            if entry.slot is not None and entry.slot.open:
                entry.slot.release("aborted")
            if entry.flight is not None and entry.flight.aborted:
                limit = int(getattr(self.args, "rollout_max_response_len", 0) or 0)
                saved = sum(max(0, limit - s.response_length) for s in wb.samples if s.status == SampleStatus.ABORTED)
                self.window.early_abort(wb, saved)  # counted, routed to _unused (its pristine copy recycled)
            elif self.window.admit(wb):  # aborted (slime hands back only those): counted and routed there
                log.warning("slime handed back a group that is not aborted; recycled", extra={"group": key})
                self._unused(wb)

    # -- judging (on the session's loop) ---------------------------------------------------------

    async def judge(self, groups: list[list[Any]], wanted: int) -> list[list[Any]]:
        """Judge the groups slime collected (and any held from before): the kept ones, at most ``wanted``.

        While the tracker cannot say what is current (NATS down), it waits, every collected group held, with an
        error line each ``ready_timeout``: judging on a guess would break the bound, and raising would end slime's
        training loop, which has no retry.
        """
        await self.hold(groups)
        if not self._held:
            return []
        current, state = await self._read_version()
        w = self.window
        t = w.begin(current, state)
        kept: list[Group] = []
        try:
            while self._held and len(kept) < wanted:
                wb = self._held.popleft()
                try:
                    if w.take(t, wb):
                        kept.append(wb)
                except BaseException:
                    self._held.appendleft(wb)
                    raise
        except BaseException:
            self._held.extendleft(reversed(w.abandon(t)))
            raise
        closed = w.close(t)
        return [g.metadata[_ENTRY] for g in closed]

    async def hold(self, groups: list[list[Any]]) -> None:
        """Groups collected but not judged (the call failed before): admitted and held for the next judgement."""
        for group in groups:
            key = group_key(group)
            entry = self._entries.pop(key, None) if key is not None else None
            wb = self._arrived(group, entry)
            if self.window.admit(wb):
                if entry is not None and entry.slot is not None and entry.slot.open:
                    self._accepted.accept(entry.slot, wb)
                self._held.append(wb)
            elif entry is not None and entry.slot is not None and entry.slot.open:
                entry.slot.release("aborted")

    def finish(self) -> dict[str, float]:
        """Close the drain window of one rollout: its metrics (slime logs them with the rollout's), one report."""
        state = "current" if self.tracker is not None and self.tracker.ready else "given"
        return self.window.finish(self._held, version_state=state).metrics

    def carry(self, kept: list[list[Any]]) -> None:
        """Groups a failed rollout call had kept: the next call returns them first (nothing drained is lost)."""
        self._carried = kept + self._carried

    def carried(self) -> list[list[Any]]:
        """Take the groups carried from a failed call."""
        out, self._carried = self._carried, []
        return out

    @property
    def held(self) -> int:
        """Collected groups waiting for a judgement (the tracker could not say what is current)."""
        return len(self._held)

    # -- internals -------------------------------------------------------------------------------

    def _arrived(self, group: list[Any], entry: _Entry | None) -> Group:
        wb = to_weightbus_group(group, {_ENTRY: group, _PRISTINE: entry.pristine if entry is not None else None})
        if entry is not None:
            if entry.flight is not None:
                key = group_key(group)
                for i, sample in enumerate(group):
                    self._requests.pop((key if key is not None else -1, _index(sample, i)), None)
                if self.inflight is not None:
                    self.inflight.close(entry.flight)
            # Stamped like weightbus rollout's groups: the drain splits their staleness into in flight and in queue.
            wb.started_at, wb.generated_at = entry.started_at, time.time()
            wb.generated_version = version_or_none(self.tracker) if self.tracker is not None else None
        return wb

    async def _read_version(self) -> tuple[int | None, str]:
        tracker = self.tracker
        assert tracker is not None
        if not tracker.ready:
            log.warning(
                "the policy's version is not known (%s): %d collected groups wait for it, none is judged on a guess",
                tracker.status.value,
                len(self._held),
                extra={"policy": self.policy, "status": tracker.status.value, "held": len(self._held)},
            )
            # slime's training loop has no retry: raising here would end a job that, without weightbus, would
            # have gone on. So the rollout waits out the outage, saying so every ``ready_timeout``.
            began = time.monotonic()
            while True:
                try:
                    await tracker.wait_ready(timeout=max(self.ready_timeout, 0.1))
                    break
                except TimeoutError:
                    log.error(
                        "the policy's version is still not known after %.0f s (%s): the rollout waits for it, "
                        "%d collected groups are held, none is judged on a guess",
                        time.monotonic() - began,
                        tracker.status.value,
                        len(self._held),
                        extra={"policy": self.policy, "status": tracker.status.value, "held": len(self._held)},
                    )
        current = read_version(tracker)
        return current, "current" if current is not None else "never_published"

    def _unused(self, group: Group) -> None:
        """The drain engine routed ``group`` as not to be trained: its pristine copy goes back, or it is dropped."""
        pristine = group.metadata.get(_PRISTINE)
        if self.stage.on_stale == "recycle":
            back = pristine if pristine is not None else group.metadata[_ENTRY]
            self.data_source.add_samples([back])
            self.recycled.append(back)

    def _worker_groups(self) -> int:
        """The groups slime's fully-async worker keeps in flight (its ``concurrency``, by slime's own count)."""
        from slime.utils.http_utils import get_rollout_num_engines  # type: ignore[import-not-found]

        return max(1, int(self.args.sglang_server_concurrency) * max(1, int(get_rollout_num_engines(self.args))))

    async def _follow_versions(self, tracker: VersionTracker) -> None:
        # The newest state only: a skipped version is subsumed by the newer one it is checked against.
        async for change in tracker.latest_changes():
            if self.gate is not None:
                self.gate.notify()
            if self.inflight is not None and change.version is not None:
                self.inflight.check(change.version)

    def finished(self, flight: Flight, index: int, labels: list[Any]) -> None:
        """Request ``index`` of ``flight`` answered with ``labels``: abort the rest of its group if certain stale."""
        if self.inflight is None:
            return
        versions = [parse_version(str(label)) for label in labels]
        known = [v for v in versions if v is not None]
        self.inflight.finished(flight, index, min(known) if known else None)


def _index(sample: Any, fallback: int) -> int:
    index = getattr(sample, "index", None)
    return index if isinstance(index, int) else fallback


class GatedDataBuffer:
    """slime's data buffer as its fully-async worker sees it: the top-up passes the admission gate.

    Everything but ``get_samples`` and ``add_samples`` is the wrapped data source's (``save``, ``load``, ``len``...).
    """

    def __init__(self, inner: Any, session: SlimeRollout) -> None:
        self._inner = inner
        self._session = session

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """Prompt groups with a slot each (slime asks for 1); [] holds the top-up until a slot frees."""
        session = self._session
        return session.call(lambda: session.hand_out(num_samples))

    def add_samples(self, samples: list[list[Any]]) -> None:
        """slime's worker hands back aborted groups: the drain engine routes them (on the session's loop)."""
        session = self._session
        groups = list(samples)
        session.post(lambda: session.returned(groups))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


_lock = threading.Lock()
_sessions: dict[str, SlimeRollout] = {}
_active: SlimeRollout | None = None
_buffers: dict[int, GatedDataBuffer] = {}
_inner_rollout: dict[str, Callable[..., Any]] = {}


def active_rollout() -> SlimeRollout | None:
    """The session this process' rollout function made (the generate function reads it), if any."""
    return _active


def shutdown(timeout: float = 10.0) -> None:
    """Close every session of this process on its loop (pending drain reports are published), and forget them.

    Registered with ``atexit``; tests call it between runs. A session whose loop is gone is only forgotten.
    """
    global _active
    with _lock:
        sessions = list(_sessions.values())
        _sessions.clear()
        _buffers.clear()
        _inner_rollout.clear()
        _active = None
    for session in sessions:
        if session.loop.is_closed() or not session.loop.is_running():
            continue
        try:
            asyncio.run_coroutine_threadsafe(session.aclose(), session.loop).result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            log.error("a slime rollout session did not close in %.0f s", timeout, extra={"policy": session.policy})


atexit.register(shutdown)


def _session(args: Any) -> SlimeRollout:
    global _active
    from slime.utils.async_utils import get_async_loop  # type: ignore[import-not-found]

    policy = setting(args, "weightbus_policy", "WEIGHTBUS_POLICY") or ""
    with _lock:
        session = _sessions.get(policy)
        if session is None:
            session = _sessions[policy] = SlimeRollout(args, get_async_loop().loop)
        _active = session
        return session


def _load(path: str) -> Callable[..., Any]:
    fn = _inner_rollout.get(path)
    if fn is None:
        from slime.utils.misc import load_function  # type: ignore[import-not-found]

        fn = load_function(path)
        _inner_rollout[path] = fn
    return fn


def generate_rollout(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> Any:
    """slime's ``--rollout-function-path`` contract: ``rollout_batch_size`` groups, each fresh enough to train on.

    Calls the wrapped fully-async rollout function (``WEIGHTBUS_ROLLOUT_FUNCTION``, by default slime's) with a
    ``GatedDataBuffer`` around ``data_buffer``, judges what it collected, and asks it again for as many groups
    as were not kept. Returns slime's ``RolloutFnTrainOutput`` with the window's ``weightbus/*`` metrics.

    While the policy's version is unknown (NATS down; nothing published on a fresh bus is *not* this: that judges
    against "never published") it waits, saying so each ``WEIGHTBUS_READY_TIMEOUT``: nothing is judged on a guess,
    nothing is lost, and slime's training goes on once the bus is back.

    Raises:
        ValueError: bad settings (see ``SlimeRollout``).
    """
    from slime.rollout.base_types import RolloutFnTrainOutput  # type: ignore[import-not-found]
    from slime.utils.async_utils import run

    inner = _load(setting(args, "weightbus_rollout_function", "WEIGHTBUS_ROLLOUT_FUNCTION", DEFAULT_ROLLOUT) or "")
    if evaluation:
        return inner(args, rollout_id, data_buffer, evaluation=True)
    session = _session(args)
    run(session.start(data_buffer))
    gated = _buffers.get(id(data_buffer))
    if gated is None:
        gated = _buffers[id(data_buffer)] = GatedDataBuffer(data_buffer, session)
    kept = session.carried()[: session.batch]
    collected: list[list[Any]] = []
    try:
        while True:
            # Held groups first (a judgement the tracker could not make); then slime's worker for the rest.
            kept += run(session.judge(collected, session.batch - len(kept)))
            collected = []
            if len(kept) >= session.batch:
                break
            view = args
            if session.batch - len(kept) != args.rollout_batch_size:
                view = copy.copy(args)
                view.rollout_batch_size = session.batch - len(kept)
            output = inner(view, rollout_id, gated)
            collected = list(getattr(output, "samples", output))
    except BaseException:
        session.carry(kept)
        if collected:
            run(session.hold(collected))
        raise
    metrics = session.call(session.finish)  # on the session's loop: the drain report is published there
    kept.sort(key=lambda group: _first_index(group))
    return RolloutFnTrainOutput(samples=kept, metrics=metrics)


def _first_index(group: list[Any]) -> int:
    first = group[0] if group else None
    if isinstance(first, list):
        first = first[0] if first else None
    index = getattr(first, "index", None)
    return index if isinstance(index, int) else 0
