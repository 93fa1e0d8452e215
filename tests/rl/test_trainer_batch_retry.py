"""The trainer's batch request retries by the error axis: a retryable error or a cut reply is asked again, a final
error is raised at once (it would fail every time)."""

from __future__ import annotations

from typing import Any

import pytest

import weightbus.errors as errors
import weightbus.rl.trainer as rl_trainer
from weightbus.rl.batches import BatchReply
from weightbus.rl.config import TrainerConfig


def _config() -> TrainerConfig:
    return TrainerConfig(
        policy="p", router_url="http://127.0.0.1:1", run_dir="/nonexistent", nats_url="nats://127.0.0.1:1"
    )


def _requests(monkeypatch: pytest.MonkeyPatch, planned: list[Any]) -> list[int]:
    calls: list[int] = []

    async def request_batch(bus: Any, policy: str, request: Any, timeout: float) -> BatchReply:
        calls.append(1)
        item = planned.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr(rl_trainer, "request_batch", request_batch)
    monkeypatch.setattr(rl_trainer, "_BATCH_RETRY_DELAY", 0.0)
    return calls


async def test_retryable_errors_and_a_cut_reply_are_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = BatchReply(kept=4)
    calls = _requests(
        monkeypatch,
        [
            errors.NoRolloutError("no rollout"),
            ValueError("invalid batch reply: truncated"),
            errors.BusConnectError("nats://h:1", "refused", "refused"),
            TimeoutError(),
            reply,
        ],
    )
    assert await rl_trainer._batch(None, _config(), 1, "t") is reply  # type: ignore[arg-type]
    assert len(calls) == 5


@pytest.mark.parametrize(
    "final",
    [
        errors.PermissionDeniedError("publish", "weightbus.p.batch"),
        errors.InvalidPolicyError("p q", "spaces"),
        errors.StreamNotFoundError("nats://h:1", "WEIGHTBUS"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_final_error_is_raised_at_once(monkeypatch: pytest.MonkeyPatch, final: Exception) -> None:
    calls = _requests(monkeypatch, [final, BatchReply(kept=4)])
    with pytest.raises(type(final)):
        await rl_trainer._batch(None, _config(), 1, "t")  # type: ignore[arg-type]
    assert len(calls) == 1
