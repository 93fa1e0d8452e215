"""The rollout process: keeps groups in flight through the SGLang router and serves drained batches to the trainer.

Every sample is stamped from the answer that produced it (with ``require_version``, first with the version its engine
served at the start, from the replica view); a drain waits until the tracker holds the trainer's version; a group
starts only with an admission slot; a refused batch subject ends it (``PermissionDeniedError``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import httpx
import msgspec
from prometheus_client import CollectorRegistry

from weightbus.backoff import Backoff
from weightbus.bus import BusMetrics, connect, subjects
from weightbus.bus.identity import process_identity
from weightbus.bus.options import ConnectOptions
from weightbus.bus.rpc import Served
from weightbus.consumers import (
    DrainReporter,
    FullyAsyncBuffer,
    StalenessMetrics,
    StalenessStage,
    VersionTracker,
    buffer_capacity,
)
from weightbus.consumers.admission import AcceptedGroups, Admission, SharedBudget
from weightbus.consumers.admission.metrics import AdmissionMetrics
from weightbus.consumers.inflight import EngineAborter, Flight, InFlightGroups, oldest_label
from weightbus.consumers.replicas import (
    ConvergenceMetrics,
    PickedEngine,
    ReplicaFollower,
    RequestMetrics,
    VersionConstraint,
    VersionRouter,
)
from weightbus.engines import httpx_request
from weightbus.errors import EngineError, VersionUnavailableError
from weightbus.process.overhead import BusyTimer
from weightbus.rl.batches import BatchReply, BatchRequest, serve_batches
from weightbus.rl.config import ROUTER_WAIT_S, RolloutConfig
from weightbus.rl.task import Task, load_task
from weightbus.rules.abort import oldest_bound
from weightbus.rules.source import version_or_none
from weightbus.schemas import WeightUpdated
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

if TYPE_CHECKING:
    from weightbus.bus.nats import NatsBus

__all__ = ["ROUTER_WAIT_S", "RolloutConfig", "RolloutProgress", "generate_group", "run_rollout", "wait_for_router"]

log = logging.getLogger("weightbus.rl")

#: What a failed generation of a group raises: no answer (EngineError), an error status, a malformed answer, or no
#: engine serving the required version in time. The group is recycled and generated again.
_GENERATION_FAILURES: Final = (httpx.HTTPError, EngineError, KeyError, TypeError, ValueError, VersionUnavailableError)

#: The waits after a failed generation, one producer's failures in a row: 0.2 s growing to 1 s, jittered.
_RETRY: Final = Backoff(first_s=0.2, cap_s=1.0)
_STOP_S = 5.0
#: How long a version-constrained request waits for an engine that serves its version (``require_version``).
_VERSION_WAIT_S = 10.0
_LAGS_KEPT = 64


class RolloutProgress(msgspec.Struct, kw_only=True, frozen=True):
    """One batch served: what the rollout reports after each answer to the trainer."""

    batches: int
    """Batches served since the start."""
    judged_at: int | None
    """The version the batch was judged against."""
    kept: int
    recycled: int
    dropped: int
    staleness_max: int | None
    """The largest staleness judged, recycled and dropped groups too (the kept ones are within the bound)."""
    tokens_generated: int
    """Response tokens generated since the start (kept or not)."""
    early_aborts: int = 0
    """Groups aborted while generating because they had to be stale, since the start."""
    tokens_saved: int = 0
    """At most how many tokens those aborts saved."""


async def generate_group(
    http: httpx.AsyncClient,
    config: RolloutConfig,
    task: Task,
    group: Group,
    prompt: str,
    next_index: itertools.count[int],
    lora_path: str | None = None,
    flight: Flight | None = None,
    inflight: InFlightGroups | None = None,
    *,
    versions: VersionRouter | None = None,
    constraint: VersionConstraint | None = None,
) -> Group:
    """Generate ``config.group_size`` samples of ``prompt`` through the router into ``group`` (reset first).

    With ``flight`` (registered in ``inflight``), request ``i`` carries ``rid = flight.rids[i]`` and reports its
    oldest label to ``inflight`` as it answers, which may abort the others.

    With ``constraint`` (a ``min_version`` or an ``exact_version``), each request goes straight to an engine that
    ``versions`` picks from the replica view (one known to serve an allowed version), not through the router, and
    its sample records the version that engine served at the start before the label its answer reports at the end:
    the drain judges the older. Without, requests go through the router as before.

    Raises:
        EngineError: the router (or the engine picked) did not answer (the HTTP client failed, however it failed).
        httpx.HTTPStatusError: it answered an error status.
        VersionUnavailableError: no engine was known to serve an allowed version within ``versions.wait_s``.
        ValueError: a ``constraint`` without ``versions``.
    """
    if constraint is not None and versions is None:
        raise ValueError("a version-constrained request needs a VersionRouter to pick its engine")
    ids = task.encode(prompt)
    body: dict[str, object] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": task.max_new_tokens, "temperature": config.temperature},
        "return_logprob": True,
    }
    if lora_path is not None:
        body["lora_path"] = lora_path

    async def one(i: int) -> tuple[dict[str, Any], PickedEngine | None]:
        picked = None
        if constraint is not None and versions is not None:
            picked = await versions.pick(constraint)
        # An engine picked by version is addressed directly (an absolute URL bypasses the router's base URL).
        base = str(http.base_url).rstrip("/") if picked is None else picked.engine
        payload = body if flight is None else {**body, "rid": flight.rids[i]}
        response = await httpx_request(http, base, "POST", "/generate", json=payload)  # no answer: EngineError
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        if flight is not None and inflight is not None:
            oldest = oldest_label(answer["meta_info"])
            inflight.finished(flight, i, oldest if picked is None else oldest_bound([oldest, picked.version]))
        return answer, picked

    answers = await asyncio.gather(*(one(i) for i in range(config.group_size)))
    group.samples = [
        _sample(task, prompt, ids, answer, next(next_index), None if picked is None else picked.version)
        for answer, picked in answers
    ]
    aborted = any(s.status == SampleStatus.ABORTED for s in group.samples)
    group.status = SampleStatus.ABORTED if aborted else SampleStatus.COMPLETED
    group.metadata["prompt"] = prompt
    return group


def _sample(
    task: Task, prompt: str, ids: list[int], answer: dict[str, Any], index: int, started_on: int | None = None
) -> Sample:
    meta = answer["meta_info"]
    out = list(answer["output_ids"])
    text = task.decode(out)
    aborted = meta.get("finish_reason", {}).get("type") == "abort"
    sample = Sample(
        index=index,
        prompt=prompt,
        tokens=ids + out,
        response=text,
        response_length=len(out),
        reward=task.reward(prompt, text),
        status=SampleStatus.ABORTED if aborted else SampleStatus.COMPLETED,
        metadata={"logprobs": [float(entry[0]) for entry in meta.get("output_token_logprobs", [])]},
    )
    if started_on is not None:
        # The version the replica view said the engine served when the request left: its start label, first.
        sample.record_weight_version(str(started_on))
    sample.record_meta_info(meta)
    return sample


class _Rollout:
    """One rollout process's state: the buffer, its producers, the lag and adapter followers, the batch handler."""

    def __init__(
        self,
        config: RolloutConfig,
        task: Task,
        bus: NatsBus,
        registry: CollectorRegistry,
        progress: Callable[[RolloutProgress], None] | None,
    ) -> None:
        self.config = config
        self.task = task
        self.bus = bus
        self.progress = progress
        metrics = StalenessMetrics(registry).for_policy(config.policy)
        consumer = config.consumer or f"rollout-{uuid.uuid4().hex[:8]}"
        stage = StalenessStage(max_staleness=config.max_staleness, on_stale=config.on_stale, metrics=metrics)
        self.retry: asyncio.Queue[Group] = asyncio.Queue()
        self.accepted = AcceptedGroups()
        self.buffer = FullyAsyncBuffer(
            buffer_capacity(config.batch),
            stage=stage,
            reporter=DrainReporter(bus, config.policy, consumer, metrics=metrics),
            on_recycle=self.retry.put_nowait,
            slots=self.accepted,
        )
        self.rng = random.Random(config.seed)
        self.next_index = itertools.count()
        self.prompts = itertools.count()
        self.generated = 0
        self.delivered = 0
        self.batches = 0
        # New at each start (a pid can repeat on a host): the counts above start from zero with it.
        self.rollout_id = f"{process_identity('rollout')}:{uuid.uuid4().hex[:8]}"
        # require_version: the replica view, fed live, picks each request's engine (started in run()).
        self.replicas: ReplicaFollower | None = None
        self.versions: VersionRouter | None = None
        if config.require_version != "off":
            self.replicas = ReplicaFollower(
                bus, config.policy, metrics=ConvergenceMetrics(registry).for_policy(config.policy)
            )
            self.versions = VersionRouter(
                self.replicas, wait_s=_VERSION_WAIT_S, metrics=RequestMetrics(registry).for_policy(config.policy)
            )
        self.adapter: str | None = None
        self.announced = asyncio.Event()
        self.lags: dict[int, float] = {}
        self.tracker: VersionTracker | None = None
        # Request ids must be unique on the engines: a consumer id set in the config may be shared or reused.
        self.rid_prefix = f"{consumer}-{uuid.uuid4().hex[:8]}"
        self.inflight: InFlightGroups | None = None
        self.early_aborts = 0
        self.tokens_saved = 0
        self.budget = (
            SharedBudget(
                bus,
                config.policy,
                name=consumer,
                lease_s=config.admission_lease_s,
                metrics=AdmissionMetrics(registry),
            )
            if config.admission_shared and config.admission != "off"  # off has nothing to share
            else None
        )
        self.admission = Admission(
            config.admission,
            current=lambda: self.tracker.current if self.tracker is not None else None,
            max_staleness=config.max_staleness,
            batch=config.batch,
            cap=(config.cap or config.in_flight) if config.admission == "cap" else None,
            budget=self.budget,
        )

    async def follow_adapter(self) -> None:
        # The adapter to generate with is the one the latest announced version names.
        async with self.bus.subscribe(subjects.weights(self.config.policy)) as sub:
            async for env in sub:
                event = env.event
                if isinstance(event, WeightUpdated) and event.lora is not None:
                    self.adapter = event.lora.name
                    self.announced.set()

    async def produce(self, tracker: VersionTracker) -> None:
        # Nothing is generated before the first version is announced: it would all be "default" (or, with
        # LoRA, for an adapter not loaded yet) and thrown away.
        await tracker.wait_for(1)
        if self.config.follow_lora:
            await self.announced.wait()
        async with httpx.AsyncClient(base_url=self.config.router_url, timeout=30.0) as http:
            inflight = self._inflight(tracker, http)
            failures = 0  # generations failed in a row
            while True:
                group = self.retry.get_nowait() if not self.retry.empty() else Group(prompt_index=next(self.prompts))
                prompt = group.metadata.get("prompt") or self.task.prompt(self.rng)
                async with self.admission.slot() as slot:  # released on leaving unless accepted or released
                    flight = inflight.open(self.rid_prefix, self.config.group_size) if inflight is not None else None
                    started = time.time()
                    # "current": at least the version the tracker holds now (None, not ready: any acknowledged one).
                    constraint = None if self.versions is None else VersionConstraint(version_or_none(tracker))
                    try:
                        await generate_group(
                            http,
                            self.config,
                            self.task,
                            group,
                            prompt,
                            self.next_index,
                            self.adapter,
                            flight,
                            inflight,
                            versions=self.versions,
                            constraint=constraint,
                        )
                    except _GENERATION_FAILURES as exc:
                        failures += 1
                        wait = _RETRY.delay(failures)
                        log.warning(
                            "generation failed; retrying the group", extra={"error": repr(exc), "retry_in": wait}
                        )
                        slot.release("recycled")
                        group.metadata["prompt"] = prompt
                        group.reset_for_retry()
                        await asyncio.sleep(wait)
                        self.retry.put_nowait(group)
                        continue
                    finally:
                        if flight is not None and inflight is not None:
                            inflight.close(flight)
                    if flight is not None and flight.aborted:
                        slot.release("aborted")  # never enters the buffer; its prompt asks for a new slot
                    else:
                        self.accepted.accept(slot, group)  # it counts until a drain keeps or routes it
                failures = 0
                self.generated += sum(s.response_length for s in group.samples)
                group.started_at = started
                group.generated_at = time.time()
                group.generated_version = version_or_none(tracker)  # not ready: no split rather than a guess
                if flight is not None and flight.aborted:
                    self._aborted_early(group)
                    continue
                await self.buffer.put(group)

    def _inflight(self, tracker: VersionTracker, http: httpx.AsyncClient) -> InFlightGroups | None:
        # One registry for every producer of this rollout, made by the first that starts.
        if not self.config.early_abort or self.config.max_staleness is None:
            return None
        if self.inflight is None:
            aborter = EngineAborter(self.config.router_url, http)
            self.inflight = InFlightGroups(self.config.max_staleness, tracker, aborter)
        return self.inflight

    def _aborted_early(self, group: Group) -> None:
        """A group aborted because it had to be stale: counted with the tokens saved, its prompt recycled."""
        limit = self.task.max_new_tokens
        saved = sum(max(0, limit - s.response_length) for s in group.samples if s.status == SampleStatus.ABORTED)
        self.early_aborts += 1
        self.tokens_saved += saved
        # Through the drain window: counted (generated, not trained: aborted) and routed to on_recycle.
        self.buffer.window.early_abort(group, saved)

    async def abort_on_changes(self, tracker: VersionTracker) -> None:
        """Each version change: abort the groups in flight that it makes certain to be stale."""
        # The newest state only: a skipped version is subsumed by the newer one it is checked against.
        async for change in tracker.latest_changes():
            if self.inflight is not None and change.version is not None:
                self.inflight.check(change.version)

    async def follow_lags(self, tracker: VersionTracker) -> None:
        # Lags are for the report only: a reader that falls behind keeps the newest, never stops the rollout.
        async for change in tracker.latest_changes():
            if change.version is not None and change.lag is not None:
                self.lags[change.version] = change.lag
                self.lags.pop(change.version - _LAGS_KEPT, None)

    async def handle(self, tracker: VersionTracker, request: BatchRequest) -> BatchReply:
        waited = time.perf_counter()
        if request.min_version is not None:
            bound = 30.0 if request.patience_s is None else min(30.0, request.patience_s)
            try:
                await tracker.wait_for(request.min_version, timeout=bound)
            except TimeoutError:
                return BatchReply(error=f"the tracker did not reach v{request.min_version} within {bound:.1f} s")
        wait_s = time.perf_counter() - waited
        timer = BusyTimer(self.buffer.drain(request.size, tracker))
        try:
            # Past the trainer's patience its answer is read by nobody: end the drain, which puts back what it
            # kept (still accepted, its slots unsettled), rather than lose a batch that was never trained.
            left = None if request.patience_s is None else max(0.0, request.patience_s - wait_s)
            async with asyncio.timeout(left):
                drain = await timer
        except TimeoutError:
            kept_back = f"no full batch of {request.size} within {request.patience_s:.1f} s; what it kept was put back"
            return BatchReply(error=kept_back)
        stats = drain.stats  # the drain engine settled each group's slot as it kept or routed it (``accepted``)
        self.delivered += sum(s.response_length for g in drain.groups for s in g.samples)
        self.batches += 1
        if self.progress is not None:
            self.progress(
                RolloutProgress(
                    batches=self.batches,
                    judged_at=stats.current,
                    kept=stats.kept,
                    recycled=stats.recycled,
                    dropped=stats.dropped,
                    staleness_max=stats.staleness_max,
                    tokens_generated=self.generated,
                    early_aborts=self.early_aborts,
                    tokens_saved=self.tokens_saved,
                )
            )
        return BatchReply(
            groups=drain.groups,
            judged_at=stats.current,
            kept=stats.kept,
            recycled=stats.recycled,
            dropped=stats.dropped,
            staleness_avg=stats.staleness_avg,
            staleness_max=stats.staleness_max,
            tokens_generated=self.generated,
            tokens_not_trained=max(0, self.generated - self.delivered),
            lag_s=self.lags.get(request.min_version) if request.min_version is not None else None,
            wait_s=wait_s,
            drain_s=timer.seconds,
            rollout_id=self.rollout_id,
        )

    async def serve(self, tracker: asyncio.Future[VersionTracker]) -> Served:
        """Subscribe to the batch subject; requests wait for ``tracker``."""

        async def on_request(request: BatchRequest) -> BatchReply:
            return await self.handle(await asyncio.shield(tracker), request)

        return await serve_batches(self.bus, self.config.policy, on_request)

    async def run(self, tracker: VersionTracker) -> None:
        self.tracker = tracker
        if self.budget is not None:
            await self.budget.start()
        if self.replicas is not None:
            await self.replicas.start()
        tasks = [asyncio.create_task(self.produce(tracker)) for _ in range(self.config.in_flight)]
        tasks.append(asyncio.create_task(self.follow_lags(tracker)))
        tasks.append(asyncio.create_task(self.admission.follow(tracker.latest_changes)))
        if self.config.early_abort:
            tasks.append(asyncio.create_task(self.abort_on_changes(tracker)))
        if self.config.follow_lora:
            tasks.append(asyncio.create_task(self.follow_adapter()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            # The producers leave their admission slots on the way out; the budget's last write must come after.
            # Bounded: a task that swallows its cancel must not hold the shutdown.
            done, pending = await asyncio.wait(tasks, timeout=_STOP_S)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.debug("rollout task ended with an error", extra={"error": repr(task.exception())})
            if pending:
                log.error("rollout tasks did not stop within the bound", extra={"tasks": len(pending)})
            if self.budget is not None:
                await self.budget.aclose()
            if self.replicas is not None:
                await self.replicas.aclose()


async def wait_for_router(router_url: str, timeout_s: float, *, interval_s: float = 0.25) -> None:
    """Return once the router answers HTTP (``GET /workers``, any status); one that never does is an error, not a hang.

    Raises:
        EngineError: no answer within ``timeout_s`` seconds (the message names the router and the last failure).
    """
    last = "no answer"
    try:
        async with asyncio.timeout(timeout_s), httpx.AsyncClient(timeout=interval_s * 4) as http:
            while True:
                try:
                    await httpx_request(http, router_url.rstrip("/"), "GET", "/workers")
                    return
                except EngineError as exc:
                    if last == "no answer":
                        log.warning("waiting for the router", extra={"router": router_url, "wait_s": timeout_s})
                    last = exc.message
                await asyncio.sleep(interval_s)
    except TimeoutError:
        raise EngineError(router_url, None, f"GET /workers: no answer within {timeout_s:g} s ({last})") from None


async def run_rollout(
    config: RolloutConfig,
    *,
    task: Task | None = None,
    connection: ConnectOptions | None = None,
    registry: CollectorRegistry | None = None,
    progress: Callable[[RolloutProgress], None] | None = None,
    router_wait_s: float = ROUTER_WAIT_S,
) -> None:
    """Run until cancelled: producers fill the buffer, drains answer the trainer's batch requests.

    Args:
        config: what to run.
        task: the task (default: loaded from ``config.task``).
        connection: NATS credentials and TLS (None reads the ``WEIGHTBUS_*`` variables).
        registry: where the bus, tracker and drain metrics are registered (a private one when None).
        progress: called after each batch served.
        router_wait_s: seconds to wait at start for the router to answer (``wait_for_router``).

    Raises:
        EngineError: the router did not answer within ``router_wait_s``.
        BusConnectError: NATS is unreachable.
        PermissionDeniedError: this user may not serve the policy's batch subject (or use the stream).
    """
    registry = registry if registry is not None else CollectorRegistry()
    task = task if task is not None else load_task(config.task)
    bus = await connect(
        config.nats_url,
        name=f"weightbus-rollout-{config.policy}",
        metrics=BusMetrics(registry),
        options=connection,
    )
    try:
        rollout = _Rollout(config, task, bus, registry, progress)
        # The batch subject first: a refusal of it must end the rollout before anything else runs on the connection.
        started: asyncio.Future[VersionTracker] = asyncio.get_running_loop().create_future()
        sub = await rollout.serve(started)
        try:
            # After NATS and the batch subject (exit 5 and 77 come first), before anything generates.
            await wait_for_router(config.router_url, router_wait_s)
            async with VersionTracker(bus, config.policy, registry=registry, freeze_heap=config.freeze_heap) as tracker:
                started.set_result(tracker)
                await rollout.run(tracker)
        finally:
            started.cancel()
            await sub.unsubscribe()
    finally:
        await bus.aclose()
