"""The main job, end to end on one machine: a fully-async RL loop whose staleness weightbus controls.

``run_demo`` wires every real part together: an embedded nats-server (or a given NATS), CPU reference
engines speaking the SGLang 0.5.23 API, a trainer whose ``VersionPublisher`` pauses, pushes, stamps,
verifies, publishes and resumes the engines, and a rollout manager whose producer generates groups on
those engines into a ``FullyAsyncBuffer`` judged against a ``VersionTracker`` at every drain.

The script exercises the failures weightbus exists for: the training cell fails over mid-run (the new
cell resumes the counter instead of restarting at 1, and the old one is fenced), one push is a LoRA
adapter (stamped like a full push), and a publisher that bypasses the counter announces version 1 at the
end (the tracker holds the higher version and raises an alert). It returns a ``DemoResult`` whose
``problems`` list is empty only if every invariant held, so the demo doubles as an end-to-end check.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
from prometheus_client import CollectorRegistry, start_http_server

from weightbus.bus import BusMetrics, EmbeddedNats, NatsBus, connect, subjects
from weightbus.consumers import (
    DrainReporter,
    FullyAsyncBuffer,
    StalenessMetrics,
    StalenessStage,
    VersionTracker,
    buffer_capacity,
)
from weightbus.engines import SGLangClient
from weightbus.errors import EngineError, FencedError
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.schemas import LoraAdapter, WeightUpdated, now
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

if TYPE_CHECKING:
    from weightbus.engines.serve import ServedEngine

__all__ = ["DemoConfig", "DemoResult", "StepRow", "run_demo"]

log = logging.getLogger("weightbus.demo")


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of the demo run (defaults: about ten seconds on two cores)."""

    policy: str = "demo"
    steps: int = 6
    engines: int = 2
    model: Literal["hash", "torch"] = "hash"
    group_size: int = 4
    batch: int = 4
    in_flight: int = 3
    max_staleness: int = 1
    on_stale: Literal["drop", "recycle"] = "recycle"
    pause: Literal["retract", "in_place"] = "in_place"
    max_new_tokens: int = 12
    token_delay: float = 0.004
    train_seconds: float = 0.15
    failover_at: int | None = 3
    lora_at: int | None = 5
    rogue: bool = True
    nats_url: str | None = None
    metrics_port: int | None = None


@dataclass(frozen=True)
class StepRow:
    """One training step: what the drain judged, then which version the push produced."""

    step: int
    trainer: str
    judged_at: int | None
    kept: int
    recycled: int
    dropped: int
    reasons: dict[str, int]
    staleness_avg: float | None
    staleness_max: int | None
    queue: int
    pushed: int
    push_kind: str


@dataclass
class DemoResult:
    """What happened, and every invariant that did not hold (empty when all is well)."""

    rows: list[StepRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    final_version: int | None = None
    tracker_version: int | None = None
    regressions: float = 0.0
    lag_mean_ms: float | None = None
    groups_generated: int = 0
    nats_url: str = ""


async def run_demo(config: DemoConfig = DemoConfig(), *, emit: Callable[[str], None] = print) -> DemoResult:
    """Run the demo and return its result; ``emit`` receives progress lines as they happen."""
    result = DemoResult()
    with contextlib.ExitStack() as stack:
        if config.nats_url is None:
            server = stack.enter_context(EmbeddedNats())
            url = server.url
            emit(f"embedded nats-server with JetStream at {url} (pid {server.pid})")
        else:
            url = config.nats_url
        result.nats_url = url
        engine_urls = [stack.enter_context(_engine(config)).url for _ in range(config.engines)]
        emit(f"{config.engines} reference engines ({config.model} model): {', '.join(engine_urls)}")
        await _run(config, url, engine_urls, result, emit)
    return result


def _engine(config: DemoConfig) -> ServedEngine:
    """A reference engine, not started yet (the caller's ExitStack starts and stops it)."""
    from weightbus.engines.reference import EngineState, create_app
    from weightbus.engines.serve import ServedEngine

    model = None
    if config.model == "torch":
        from weightbus.engines.tiny_model import TinyTorchModel

        model = TinyTorchModel()
    return ServedEngine(create_app(EngineState(model=model, token_delay=config.token_delay)))


async def _run(
    config: DemoConfig, url: str, engine_urls: list[str], result: DemoResult, emit: Callable[[str], None]
) -> None:
    registry = CollectorRegistry()
    bus_metrics = BusMetrics(registry)
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server, _ = start_http_server(config.metrics_port, addr="127.0.0.1", registry=registry)
        emit(f"metrics on http://127.0.0.1:{config.metrics_port}/metrics")
    policy = config.policy if config.nats_url is None else f"{config.policy}-{uuid.uuid4().hex[:6]}"
    rollout_bus = await connect(url, name="demo-rollout", metrics=bus_metrics)
    cell0_bus = await connect(url, name="demo-cell-0", metrics=bus_metrics)
    cell1_bus: NatsBus | None = None
    drain_metrics = StalenessMetrics(registry).for_policy(policy)
    stage = StalenessStage(max_staleness=config.max_staleness, on_stale=config.on_stale, metrics=drain_metrics)
    reporter = DrainReporter(rollout_bus, policy, f"demo-rollout-{uuid.uuid4().hex[:6]}", metrics=drain_metrics)
    buffer = FullyAsyncBuffer(
        buffer_capacity(config.batch), stage=stage, reporter=reporter, samples_per_group=config.group_size
    )
    clients = [SGLangClient(u, timeout=30) for u in engine_urls]
    fleet0 = EngineFleet(engine_urls)
    fleet1: EngineFleet | None = None
    weights_dir = Path(tempfile.mkdtemp(prefix="weightbus-demo-"))
    producers: list[asyncio.Task[None]] = []
    try:
        async with VersionTracker(rollout_bus, policy, registry=registry, observer="demo-rollout") as tracker:
            await tracker.wait_ready(10)
            pub = await VersionPublisher(
                cell0_bus, policy, trainer_id="cell-0", fleet=fleet0, pause=config.pause
            ).start()
            emit(f"cell-0 claimed policy {policy!r} (epoch {pub.epoch}); first push before the loop")
            async with pub.update() as version:
                await _push_full(fleet0, config, weights_dir, version)
            emit(f"  v{version} pushed, stamped on every engine, read back, published")

            counter = itertools.count()
            for worker in range(config.in_flight):
                producers.append(asyncio.create_task(_producer(worker, clients, buffer, counter, config, result)))

            prev_version = version
            for step in range(1, config.steps + 1):
                drain = await asyncio.wait_for(buffer.drain(config.batch, tracker), 60)
                s = drain.stats
                if s.current is not None and s.staleness_max is not None and config.max_staleness is not None:
                    kept_max = max((_oldest_age(g, s.current) for g in drain.groups), default=0)
                    if kept_max > config.max_staleness:
                        result.problems.append(f"step {step}: kept a group {kept_max} versions old")
                await asyncio.sleep(config.train_seconds)  # the optimizer step

                if config.failover_at == step:
                    emit(f"step {step}: cell-0 dies; cell-1 takes over the counter from the bus")
                    cell1_bus = await connect(url, name="demo-cell-1", metrics=bus_metrics)
                    old = pub
                    fleet1 = EngineFleet(engine_urls)
                    pub = await VersionPublisher(
                        cell1_bus, policy, trainer_id="cell-1", fleet=fleet1, pause=config.pause
                    ).start()
                    emit(
                        f"  cell-1 resumed at v{pub.version} (epoch {pub.epoch}); next version v{pub.next_version}"
                    )
                    try:
                        async with old.update() as stale_version:
                            result.problems.append(f"the old cell was allowed to publish v{stale_version}")
                    except FencedError as exc:
                        emit(f"  cell-0 tries to publish again: FencedError: {exc}")
                        result.notes.append(f"fenced: {exc}")
                    await fleet0.aclose()

                if config.lora_at == step:
                    adapter = LoraAdapter(name="demo-lora", path=str(weights_dir / "demo-lora"))
                    version = await pub.publish_lora(adapter)
                    kind = "lora"
                else:
                    async with pub.update() as version:
                        await _push_full(pub.fleet, config, weights_dir, version)
                    kind = "full"
                if version != prev_version + 1:
                    result.problems.append(f"step {step}: version went from {prev_version} to {version}")
                prev_version = version
                row = StepRow(
                    step=step,
                    trainer=pub.trainer_id,
                    judged_at=s.current,
                    kept=s.kept,
                    recycled=s.recycled,
                    dropped=s.dropped,
                    reasons=dict(s.reasons),
                    staleness_avg=s.staleness_avg,
                    staleness_max=s.staleness_max,
                    queue=s.queue_size,
                    pushed=version,
                    push_kind=kind,
                )
                result.rows.append(row)
                emit(_row_line(row))

            await tracker.wait_for(version, 10)
            result.final_version = version
            if config.rogue:
                emit(f"a publisher that bypasses the counter announces v1 while v{version} is current")
                rogue = WeightUpdated(policy=policy, version=1, epoch=0, trainer_id="rogue-script", published_at=now())
                await rollout_bus.publish(subjects.weights(policy), rogue, msg_id=f"{policy}:rogue:{uuid.uuid4().hex}")
                await _until(
                    lambda: (
                        (registry.get_sample_value("weightbus_version_regressions_total", {"policy": policy}) or 0) >= 1
                    ),
                    10,
                )
                emit(f"  tracker held v{tracker.current}, counted the regression, published VersionRegressed")
            result.tracker_version = tracker.current
    finally:
        for task in producers:
            task.cancel()
        for task in producers:
            with contextlib.suppress(asyncio.CancelledError, EngineError):
                await task
        for client in clients:
            await client.aclose()
        await fleet0.aclose()
        if fleet1 is not None:
            await fleet1.aclose()
        for bus in (rollout_bus, cell0_bus, cell1_bus):
            if bus is not None:
                await bus.close()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
    _summarise(registry, policy, config, result)


async def _push_full(fleet: EngineFleet | None, config: DemoConfig, weights_dir: Path, version: int) -> None:
    """The trainer's weight push: each engine loads a checkpoint from disk."""
    assert fleet is not None
    path = weights_dir / f"v{version}.pt"
    if config.model == "torch":
        from weightbus.engines.tiny_model import save_random_weights

        save_random_weights(str(path), seed=version)
    await asyncio.gather(*(c.update_weights_from_disk(str(path)) for c in fleet.clients))


async def _producer(
    worker: int,
    clients: list[SGLangClient],
    buffer: FullyAsyncBuffer,
    counter: itertools.count[int],
    config: DemoConfig,
    result: DemoResult,
) -> None:
    """One in-flight group at a time: regenerate recycled prompts first, else take a new one."""
    while True:
        recycled = buffer.take_recycled()
        groups = recycled or [Group(prompt_index=next(counter))]
        for group in groups:
            await _generate(group, clients, config, worker)
            result.groups_generated += 1
            await buffer.put(group)


async def _generate(group: Group, clients: list[SGLangClient], config: DemoConfig, worker: int) -> None:
    base = group.prompt_index * config.group_size
    if not group.samples:
        group.samples = [
            Sample(index=base + i, prompt=f"prompt {group.prompt_index}") for i in range(config.group_size)
        ]

    async def one(i: int, sample: Sample) -> None:
        client = clients[(base + i + worker) % len(clients)]
        out = await client.generate(text=sample.prompt, sampling_params={"max_new_tokens": config.max_new_tokens})
        sample.response = out.text
        sample.record_meta_info(msgspec.to_builtins(out.meta_info))
        finish = out.meta_info.finish_reason
        sample.status = (
            SampleStatus.ABORTED if finish is not None and finish.type == "abort" else SampleStatus.COMPLETED
        )

    await asyncio.gather(*(one(i, s) for i, s in enumerate(group.samples)))
    group.status = SampleStatus.COMPLETED


def _oldest_age(group: Group, current: int) -> int:
    oldest = min((s.oldest_version for s in group.iter_samples() if s.oldest_version is not None), default=current)
    return current - oldest


async def _until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


def _row_line(row: StepRow) -> str:
    reasons = ",".join(f"{k}={v}" for k, v in sorted(row.reasons.items())) or "-"
    stale = "-" if row.staleness_avg is None else f"avg {row.staleness_avg:.2f} max {row.staleness_max}"
    return (
        f"step {row.step}: drain judged at v{row.judged_at}: kept {row.kept}, recycled {row.recycled}, "
        f"dropped {row.dropped} ({reasons}); staleness {stale}; queue {row.queue} | "
        f"{row.trainer} pushed v{row.pushed} ({row.push_kind})"
    )


def _summarise(registry: CollectorRegistry, policy: str, config: DemoConfig, result: DemoResult) -> None:
    labels = {"policy": policy}
    result.regressions = registry.get_sample_value("weightbus_version_regressions_total", labels) or 0.0
    count = registry.get_sample_value("weightbus_propagation_lag_seconds_count", labels) or 0.0
    total = registry.get_sample_value("weightbus_propagation_lag_seconds_sum", labels) or 0.0
    result.lag_mean_ms = 1000 * total / count if count else None
    if result.tracker_version != result.final_version:
        result.problems.append(f"tracker ended at {result.tracker_version}, trainer at {result.final_version}")
    if config.rogue and result.regressions < 1:
        result.problems.append("the rogue lower version was not counted as a regression")
    if (
        config.failover_at is not None
        and config.failover_at <= config.steps
        and not any(n.startswith("fenced") for n in result.notes)
    ):
        result.problems.append("the old cell was not fenced after the failover")
    if len(result.rows) != config.steps:
        result.problems.append(f"{len(result.rows)} steps ran, {config.steps} expected")
