"""The rollout process: keeps groups in flight through the SGLang router and serves drained batches to the trainer.

Invariants:

* Every sample is stamped from the ``meta_info`` of the ``/generate`` answer that produced it
  (``Sample.record_meta_info``: ``weight_version`` and, for a request that straddled a push, the
  ``weight_versions`` spans), never from what the rollout believes the version is.
* The per-token logprobs the engine reported (``output_token_logprobs``) travel with the sample
  (``metadata["logprobs"]``): the trainer's importance ratio is taken against them.
* A drain for a trainer that has just published ``v`` waits until the tracker holds ``v`` (``min_version``),
  so no group is admitted against an older version than the one it will be trained under.
* A failed or aborted generation never enters the buffer as fresh data: aborted groups are filtered by the
  buffer, a router error retries the group after a short back-off.
* Each batch reply carries weightbus's share of the answer: the wait for the tracker (``wait_s``) and the
  drain's own run time (``drain_s``, :class:`weightbus.process.overhead.BusyTimer`: the waits for groups not counted).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry

from weightbus.bus import connect, subjects
from weightbus.bus.options import ConnectOptions
from weightbus.consumers import (
    DrainReporter,
    FullyAsyncBuffer,
    StalenessMetrics,
    StalenessStage,
    VersionTracker,
    buffer_capacity,
)
from weightbus.errors import SlowConsumerError
from weightbus.process.overhead import BusyTimer
from weightbus.rl.batches import BatchReply, BatchRequest, serve_batches
from weightbus.rl.task import Task
from weightbus.schemas import WeightUpdated
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

__all__ = ["RolloutConfig", "generate_group", "run_rollout"]

log = logging.getLogger("weightbus.rl")

_RETRY_DELAY = 0.2


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """What ``weightbus rollout`` runs.

    Attributes:
        nats_url: the NATS to use.
        router_url: the SGLang router that rollouts generate through.
        policy: the policy id.
        task: the task (prompts, tokenizer, reward).
        group_size: samples per prompt group.
        batch: groups per training batch (sizes the buffer).
        in_flight: prompt groups being generated at once.
        max_staleness: the largest staleness kept.
        on_stale: ``recycle`` or ``drop`` the groups that are not kept.
        temperature: sampling temperature.
        lora: generate with the LoRA adapter that the latest ``WeightUpdated`` names (``lora_path``).
        seed: seeds the prompt stream.
        consumer: the drain reporter's consumer id (default: ``rollout-<random>``, unique per start).
    """

    nats_url: str
    router_url: str
    policy: str
    task: Task
    group_size: int = 8
    batch: int = 8
    in_flight: int = 4
    max_staleness: int = 1
    on_stale: str = "recycle"
    temperature: float = 1.0
    lora: bool = False
    seed: int = 0
    consumer: str | None = None
    connection: ConnectOptions | None = None
    """NATS credentials and TLS (``weightbus.bus.ConnectOptions``); None reads the WEIGHTBUS_* variables."""
    freeze_heap: bool = False
    """Freeze the collector's start-up heap once the tracker is ready (``weightbus rollout`` does; see
    ``VersionTracker``): it acts on the whole process, so an embedding host decides."""


async def generate_group(
    http: httpx.AsyncClient,
    config: RolloutConfig,
    group: Group,
    prompt: str,
    next_index: itertools.count[int],
    lora_path: str | None = None,
) -> Group:
    """Generate ``config.group_size`` samples of ``prompt`` through the router into ``group`` (reset first).

    Raises:
        httpx.HTTPError: the router failed or answered an error.
    """
    task = config.task
    ids = task.encode(prompt)
    body: dict[str, object] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": task.max_new_tokens, "temperature": config.temperature},
        "return_logprob": True,
    }
    if lora_path is not None:
        body["lora_path"] = lora_path

    async def one() -> dict[str, object]:
        response = await http.post("/generate", json=body)
        response.raise_for_status()
        return response.json()

    answers = await asyncio.gather(*(one() for _ in range(config.group_size)))
    samples = []
    for answer in answers:
        meta = answer["meta_info"]
        out = list(answer["output_ids"])
        text = task.decode(out)
        aborted = meta.get("finish_reason", {}).get("type") == "abort"
        sample = Sample(
            index=next(next_index),
            prompt=prompt,
            tokens=ids + out,
            response=text,
            response_length=len(out),
            reward=task.reward(prompt, text),
            status=SampleStatus.ABORTED if aborted else SampleStatus.COMPLETED,
            metadata={"logprobs": [float(entry[0]) for entry in meta.get("output_token_logprobs", [])]},
        )
        sample.record_meta_info(meta)
        samples.append(sample)
    group.samples = samples
    aborted = any(s.status == SampleStatus.ABORTED for s in samples)
    group.status = SampleStatus.ABORTED if aborted else SampleStatus.COMPLETED
    group.metadata["prompt"] = prompt
    return group


async def run_rollout(config: RolloutConfig, *, registry: CollectorRegistry | None = None) -> None:
    """Run until cancelled: producers fill the buffer, drains answer the trainer's batch requests."""
    registry = registry if registry is not None else CollectorRegistry()
    bus = await connect(config.nats_url, name=f"weightbus-rollout-{config.policy}", options=config.connection)
    metrics = StalenessMetrics(registry).for_policy(config.policy)
    consumer = config.consumer or f"rollout-{uuid.uuid4().hex[:8]}"
    stage = StalenessStage(max_staleness=config.max_staleness, on_stale=config.on_stale, metrics=metrics)  # type: ignore[arg-type]
    retry: asyncio.Queue[Group] = asyncio.Queue()
    buffer = FullyAsyncBuffer(
        buffer_capacity(config.batch),
        stage=stage,
        reporter=DrainReporter(bus, config.policy, consumer, metrics=metrics),
        on_recycle=retry.put_nowait,
    )
    rng = random.Random(config.seed)
    next_index = itertools.count()
    prompts = itertools.count()
    counts = {"generated": 0, "delivered": 0}
    adapter: dict[str, str] = {}
    announced = asyncio.Event()

    async def follow_adapter() -> None:
        # The adapter to generate with is the one the latest announced version names.
        async with bus.subscribe(subjects.weights(config.policy)) as sub:
            async for env in sub:
                event = env.event
                if isinstance(event, WeightUpdated) and event.lora is not None:
                    adapter["name"] = event.lora.name
                    announced.set()

    async def producer() -> None:
        # Nothing is generated before the first version is announced: it would all be "default" (or, with
        # LoRA, for an adapter not loaded yet) and thrown away.
        await tracker.wait_for(1)
        if config.lora:
            await announced.wait()
        async with httpx.AsyncClient(base_url=config.router_url, timeout=30.0) as http:
            while True:
                group = retry.get_nowait() if not retry.empty() else Group(prompt_index=next(prompts))
                prompt = group.metadata.get("prompt") or config.task.prompt(rng)
                try:
                    await generate_group(http, config, group, prompt, next_index, adapter.get("name"))
                except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
                    log.warning("generation failed; retrying the group", extra={"error": repr(exc)})
                    group.metadata["prompt"] = prompt
                    group.reset_for_retry()
                    await asyncio.sleep(_RETRY_DELAY)
                    retry.put_nowait(group)
                    continue
                counts["generated"] += sum(s.response_length for s in group.samples)
                await buffer.put(group)

    async with VersionTracker(bus, config.policy, registry=registry, freeze_heap=config.freeze_heap) as tracker:
        lags: dict[int, float] = {}

        async def follow_lags() -> None:
            while True:
                try:
                    async for change in tracker.changes():
                        if change.version is not None and change.lag is not None:
                            lags[change.version] = change.lag
                            lags.pop(change.version - 64, None)
                    return  # the tracker stopped
                except SlowConsumerError as exc:
                    # Lags are for the report only; losing some must never stop the rollout.
                    log.warning("lag listener fell behind; resubscribing", extra={"error": str(exc)})

        async def handle(request: BatchRequest) -> BatchReply:
            waited = time.perf_counter()
            if request.min_version is not None:
                try:
                    await tracker.wait_for(request.min_version, timeout=30.0)
                except TimeoutError:
                    return BatchReply(error=f"the tracker did not reach v{request.min_version} within 30 s")
            wait_s = time.perf_counter() - waited
            timer = BusyTimer(buffer.drain(request.size, tracker))
            drain = await timer
            stats = drain.stats
            counts["delivered"] += sum(s.response_length for g in drain.groups for s in g.samples)
            return BatchReply(
                groups=drain.groups,
                judged_at=stats.current,
                kept=stats.kept,
                recycled=stats.recycled,
                dropped=stats.dropped,
                staleness_avg=stats.staleness_avg,
                staleness_max=stats.staleness_max,
                tokens_generated=counts["generated"],
                tokens_wasted=max(0, counts["generated"] - counts["delivered"]),
                lag_s=lags.get(request.min_version) if request.min_version is not None else None,
                wait_s=wait_s,
                drain_s=timer.seconds,
            )

        sub = await serve_batches(bus.client, config.policy, handle)
        tasks = [asyncio.create_task(producer()) for _ in range(config.in_flight)]
        tasks.append(asyncio.create_task(follow_lags()))
        if config.lora:
            tasks.append(asyncio.create_task(follow_adapter()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await sub.unsubscribe()
            await bus.close()
