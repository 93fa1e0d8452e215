"""The trainer process: GRPO-style steps on drained batches, then a weight push stamped and published by weightbus.

The counter is the bus's (a replacement resumes it); a step's ``steps.jsonl`` line precedes its checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from prometheus_client import CollectorRegistry

from weightbus.backoff import Backoff, retry_async
from weightbus.bus import BusMetrics, connect
from weightbus.bus.options import ConnectOptions
from weightbus.errors import EngineError, WeightbusError
from weightbus.process.overhead import OverheadMeter, covered
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.producers.artifact import safetensors_artifact
from weightbus.rl.batches import BatchReply, BatchRequest, request_batch
from weightbus.rl.config import TrainerConfig
from weightbus.rl.report import trained_staleness
from weightbus.schemas import LoraAdapter
from weightbus.schemas.rollouts import Group

if TYPE_CHECKING:
    from weightbus.bus.nats import NatsBus

__all__ = ["TrainerConfig", "TrainerProgress", "grpo_loss", "run_trainer", "safetensors_artifact"]

log = logging.getLogger("weightbus.rl")

_BATCH_TIMEOUT = 5.0
_BATCH_RETRY_DELAY = 0.2
_BATCH_RETRY_CAP = 1.0
_PUSH_PATIENCE = 60.0
_PUSH_RETRY_DELAY = 0.5
_PUSH_RETRY_CAP = 2.0


class TrainerProgress(msgspec.Struct, kw_only=True, frozen=True):
    """One step trained and pushed: what the trainer reports after each step."""

    step: int
    steps: int
    """The step count the trainer trains to."""
    version: int
    """The version published after the step."""
    reward: float
    """The batch's mean reward."""
    staleness_max: int | None
    """The largest staleness of the groups trained on (``trained_under - oldest``), the one the bound holds for."""
    step_s: float
    judged_staleness_max: int | None = None
    """The largest staleness the drain judged for this batch, recycled and dropped groups too."""


def grpo_loss(policy: Any, groups: list[Group], clip: float) -> tuple[Any, float]:
    """The clipped surrogate loss over ``groups`` and their mean reward.

    Advantages are group-relative (reward minus the group mean, over the group's standard deviation); the ratio is
    ``exp(logp_now - logp_engine)`` per token, clipped to ``[1 - clip, 1 + clip]`` as in PPO.
    """
    import torch

    from weightbus.rl.policy import token_windows

    windows: list[list[int]] = []
    tokens: list[int] = []
    old: list[float] = []
    adv: list[float] = []
    rewards: list[float] = []
    for group in groups:
        r = torch.tensor([s.reward or 0.0 for s in group.samples])
        a = (r - r.mean()) / (r.std() + 1e-4) if len(group.samples) > 1 else r * 0
        rewards.extend(r.tolist())
        for sample, advantage in zip(group.samples, a.tolist(), strict=True):
            response = sample.tokens[len(sample.tokens) - sample.response_length :]
            logprobs = sample.metadata.get("logprobs") or [0.0] * len(response)
            windows.extend(token_windows(sample.tokens, sample.response_length))
            tokens.extend(response)
            old.extend(logprobs[: len(response)])
            adv.extend([advantage] * len(response))
    new = policy.token_logprobs(windows, tokens)
    ratio = torch.exp(new - torch.tensor(old))
    advantages = torch.tensor(adv)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip, 1 + clip) * advantages)
    return -surrogate.mean(), sum(rewards) / max(1, len(rewards))


def _group_versions(group: Group) -> dict[str, Any]:
    oldest = [s.oldest_version for s in group.samples]
    newest = [s.newest_version for s in group.samples]
    known = [v for v in oldest if v is not None]
    return {
        "oldest": min(known) if known else None,
        "newest": max((v for v in newest if v is not None), default=None),
        "unknown": any(s.has_unknown_version or s.oldest_version is None for s in group.samples),
    }


class _Trainer:
    def __init__(self, config: TrainerConfig) -> None:
        import torch

        from weightbus.rl.policy import Policy

        self.config = config
        self.meter = OverheadMeter()
        self.policy = Policy(seed=config.seed, lora_rank=config.lora_rank)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.lr)
        self.step = 0
        self.version: int | None = None
        """The last version this run announced, as checkpointed: the counter's floor on a resume."""
        self.checkpoint = config.run_path / "checkpoint.pt"
        self.weights_dir = config.run_path / "weights"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        if self.checkpoint.exists():
            state = torch.load(self.checkpoint, weights_only=True)
            self.policy.load_state(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            self.version = state.get("version")

    def save_checkpoint(self, version: int) -> None:
        import torch

        self.version = version
        tmp = self.checkpoint.with_suffix(".tmp")
        state = {"policy": self.policy.state(), "optimizer": self.optimizer.state_dict(), "step": self.step}
        torch.save({**state, "version": version}, tmp)
        # A trainer killed mid-write leaves the previous checkpoint whole.
        os.replace(tmp, self.checkpoint)

    async def push(self, pub: VersionPublisher, fleet: EngineFleet) -> int:
        """Push until it lands (an engine restarting, NATS restarting); returns the version announced.

        A failed update announces nothing but uses its reserved number up (its engines are quarantined until the
        next update lands), so a retry pushes the next number. Only a retryable error is retried, for at most
        ``_PUSH_PATIENCE`` seconds; a final one (fenced, denied, an exhausted counter, ...) is raised at once.
        """

        def retrying(exc: Exception, attempt: int, wait: float) -> None:
            log.warning(
                "push failed; retrying", extra={"error": str(exc), "version": pub.state.next_version, "retry_in": wait}
            )

        return await retry_async(
            lambda: self._push_once(pub, fleet),
            Backoff(first_s=_PUSH_RETRY_DELAY, cap_s=_PUSH_RETRY_CAP, deadline_s=_PUSH_PATIENCE),
            on_retry=retrying,
            clock=time.monotonic,  # this module's clock: a test stands a fake one in for the patience
        )

    async def _push_once(self, pub: VersionPublisher, fleet: EngineFleet) -> int:
        config, meter = self.config, self.meter
        lora = None
        if config.lora_rank is not None:
            # One adapter name per version: loading never has to unload the name rollouts are using.
            path = self.weights_dir / f"adapter-v{pub.state.next_version}.safetensors"
            lora = LoraAdapter(name=f"{config.lora_prefix}-v{pub.state.next_version}", path=str(path))
        # An adapter replaces the previous one on the same base weights: its artifact is a delta on the version
        # before it (none to name before the first announcement: that push announces no artifact).
        base = pub.state.version
        with meter.weightbus():
            # A full push carries weight_version to every engine (load and label in one call): no pending relabel.
            update = pub.update(lora=lora, labels=lora is None)
            async with update as version:
                with meter.excluded():  # the trainer's own work: write the weights, load them on the engines
                    if lora is None:
                        path = self.weights_dir / f"weights-v{version}.safetensors"
                        self.policy.save_weights(str(path))
                        update.artifact = safetensors_artifact(path)
                        for client in fleet.clients:
                            await client.update_weights_from_disk(str(path), weight_version=str(version))
                    else:
                        self.policy.save_adapter(str(path))
                        if base is not None:
                            update.artifact = safetensors_artifact(path, base)
                        for client in fleet.clients:
                            await client.load_lora_adapter(lora.name, str(path))
        if lora is not None:
            # The adapter two versions back is no longer announced; requests already running keep their weights.
            stale = f"{config.lora_prefix}-v{version - 2}"
            for client in fleet.clients:
                with contextlib.suppress(EngineError):
                    await client.unload_lora_adapter(stale)
        return version

    def step_times(self, reply: BatchReply) -> dict[str, float]:
        """Where the last metered step's time went (seconds; see the module docstring)."""
        meter = self.meter
        window = meter.steps[-1]
        report = meter.report(window)
        push_s = covered(meter.excluded_spans, *window)
        meter.reset()  # a long run must not re-scan every earlier step
        rollout = reply.wait_s + reply.drain_s
        return {
            "step_s": report.step_s,
            "update_s": report.weightbus_s,
            "push_s": push_s,
            "engine_http_s": report.engine_http_s,
            "update_own_s": report.own_s,
            "rollout_wait_s": reply.wait_s,
            "drain_s": reply.drain_s,
            "weightbus_s": report.own_s + rollout,
        }


async def run_trainer(
    config: TrainerConfig,
    *,
    connection: ConnectOptions | None = None,
    metrics: BusMetrics | None = None,
    registry: CollectorRegistry | None = None,
    progress: Callable[[TrainerProgress], None] | None = None,
) -> int:
    """Train until ``config.steps``; returns the last published version.

    Args:
        config: what to run.
        connection: NATS credentials and TLS (None reads the ``WEIGHTBUS_*`` variables).
        metrics: where the connection counts invalid payloads (a private registry when None).
        registry: where the publisher exports its update phases and counter state (a private one when None).
        progress: called after each step is recorded.

    Raises:
        FencedError: another trainer took the counter over.
        CounterExhaustedError: the policy's counter reached ``MAX_VERSION`` (raised at once: use a new policy id).
        EngineError, EngineOutOfSyncError: a push did not land on every engine.
        PermissionDeniedError: this user may not ask for batches (or publish the policy's versions).
    """
    config.run_path.mkdir(parents=True, exist_ok=True)
    trainer = _Trainer(config)
    bus = await connect(config.nats_url, name=f"weightbus-trainer-{config.policy}", metrics=metrics, options=connection)
    # One client for every engine request, timed from outside weightbus by the meter's hooks.
    http = httpx.AsyncClient(event_hooks=trainer.meter.http_hooks(), timeout=30.0)
    steps_log = (config.run_path / "steps.jsonl").open("a", encoding="utf-8")
    fleet: EngineFleet | None = None
    pub: VersionPublisher | None = None
    try:
        fleet = await EngineFleet.from_router(config.router_url, http=http)
        # The checkpoint's version is a floor: a bus that lost its history never reissues a number this run used.
        pub = VersionPublisher(
            bus,
            config.policy,
            fleet=fleet,
            pause="retract",
            trainer_id=config.trainer_id,
            floor=trainer.version,
            registry=registry,
        )
        await pub.start()
        version = await trainer.push(pub, fleet)
        log.info("trainer ready", extra={"step": trainer.step, "version": version})
        while trainer.step < config.steps:
            record = await _train_step(trainer, bus, pub, fleet, version)
            version = record["version"]
            steps_log.write(json.dumps(record) + "\n")
            steps_log.flush()
            # Checkpoint last: a trainer killed before this line leaves a step that the next one redoes (a
            # repeated step number in steps.jsonl), never a trained step missing from the record.
            trainer.save_checkpoint(version)
            if progress is not None:
                progress(
                    TrainerProgress(
                        step=record["step"],
                        steps=config.steps,
                        version=version,
                        reward=record["reward"],
                        staleness_max=trained_staleness(record)[1],
                        step_s=record["step_s"],
                        judged_staleness_max=record["staleness_max"],
                    )
                )
        return version
    finally:
        steps_log.close()
        if pub is not None:
            await pub.aclose()
        if fleet is not None:
            await fleet.aclose()
        await http.aclose()
        await bus.aclose()


async def _train_step(
    trainer: _Trainer, bus: NatsBus, pub: VersionPublisher, fleet: EngineFleet, trained_under: int
) -> dict[str, Any]:
    """One step: a batch judged against ``trained_under``, the loss, the push; returns its ``steps.jsonl`` line."""
    config = trainer.config
    with trainer.meter.step():
        started = time.perf_counter()
        reply = await _batch(bus, config, trained_under, pub.state.trainer_id)
        got_batch = time.perf_counter()
        loss, reward = grpo_loss(trainer.policy, reply.groups, config.clip)
        trainer.optimizer.zero_grad()
        loss.backward()
        trainer.optimizer.step()
        trainer.step += 1
        version = await trainer.push(pub, fleet)
    return {
        "step": trainer.step,
        "trainer_id": pub.state.trainer_id,
        "trained_under": trained_under,
        "version": version,
        "reward": reward,
        "groups": [_group_versions(g) for g in reply.groups],
        "judged_at": reply.judged_at,
        "kept": reply.kept,
        "recycled": reply.recycled,
        "dropped": reply.dropped,
        "staleness_avg": reply.staleness_avg,
        "staleness_max": reply.staleness_max,
        "tokens_generated": reply.tokens_generated,
        "tokens_not_trained": reply.tokens_not_trained,
        "rollout_id": reply.rollout_id,
        "lag_s": reply.lag_s,
        "batch_wait_s": got_batch - started,
        **trainer.step_times(reply),
        "time": time.time(),
    }


def _batch_retryable(exc: Exception) -> bool:
    # A rollout restarting, NATS restarting, or a reply cut by a crash (a plain ValueError): ask again. A final
    # error (a refused subject, a bad policy id) would fail every time: the error axis says so.
    if isinstance(exc, WeightbusError):
        return exc.retryable
    return isinstance(exc, TimeoutError | ValueError)


async def _batch(bus: NatsBus, config: TrainerConfig, min_version: int, trainer_id: str) -> BatchReply:
    request = BatchRequest(size=config.batch, min_version=min_version, trainer_id=trainer_id, patience_s=_BATCH_TIMEOUT)
    backoff = Backoff(first_s=_BATCH_RETRY_DELAY, cap_s=_BATCH_RETRY_CAP)

    def retrying(exc: Exception, attempt: int, wait: float) -> None:
        log.warning(
            "no batch from the rollout; asking again",
            extra={"policy": config.policy, "error": repr(exc), "retry_in": wait},
        )

    while True:
        reply = await retry_async(
            lambda: request_batch(bus, config.policy, request, timeout=_BATCH_TIMEOUT),
            backoff,
            retry_on=_batch_retryable,
            on_retry=retrying,
        )
        if reply.error is None:
            return reply
        log.warning("the rollout could not drain; asking again", extra={"error": reply.error})
