"""The trainer's step math and checkpoint: a replacement trainer continues training, not only counting."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from weightbus.rl.policy import Policy, token_windows  # noqa: E402
from weightbus.rl.trainer import TrainerConfig, _Trainer, grpo_loss  # noqa: E402
from weightbus.schemas.rollouts import Group, Sample  # noqa: E402

pytestmark = pytest.mark.torch

PROMPT = [29, 30, 31, 37]


def _group(policy: Policy, responses: list[list[int]], rewards: list[float], stale: float = 0.0) -> Group:
    samples = []
    for i, (response, reward) in enumerate(zip(responses, rewards, strict=True)):
        tokens = PROMPT + response
        logprobs = policy.token_logprobs(token_windows(tokens, len(response)), response).detach() - stale
        samples.append(
            Sample(
                index=i,
                tokens=tokens,
                response_length=len(response),
                reward=reward,
                metadata={"logprobs": logprobs.tolist()},
            )
        )
    return Group(prompt_index=0, samples=samples)


def test_the_loss_pushes_up_the_better_response_and_clips_far_off_policy_data() -> None:
    policy = Policy(seed=0)
    good, bad = [33, 32, 31], [1, 2, 3]
    group = _group(policy, [good, bad], [1.0, 0.0])
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.05)
    before = policy.token_logprobs(token_windows(PROMPT + good, 3), good).sum().item()
    loss, reward = grpo_loss(policy, [group], clip=0.2)
    assert reward == pytest.approx(0.5)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    assert policy.token_logprobs(token_windows(PROMPT + good, 3), good).sum().item() > before


def test_a_far_off_policy_token_with_positive_advantage_is_clipped_out() -> None:
    policy = Policy(seed=0)
    response = [33, 32, 31]
    windows = token_windows(PROMPT + response, 3)
    current = policy.token_logprobs(windows, response).detach()
    # The same response twice: rewarded 1 with recorded logprobs far below the policy's (ratio e^5, clipped),
    # and rewarded 0 on-policy (ratio 1, never clipped on the negative side).
    good = Sample(
        index=0,
        tokens=PROMPT + response,
        response_length=3,
        reward=1.0,
        metadata={"logprobs": (current - 5.0).tolist()},
    )
    bad = Sample(
        index=1, tokens=PROMPT + response, response_length=3, reward=0.0, metadata={"logprobs": current.tolist()}
    )
    loss, _ = grpo_loss(policy, [Group(prompt_index=0, samples=[good, bad])], clip=0.2)
    params = policy.parameters()
    got = torch.autograd.grad(loss, params, allow_unused=True)
    # Expected: only the on-policy sample carries gradient; the clipped one is a constant.
    advantage = (0.0 - 0.5) / (torch.tensor([1.0, 0.0]).std() + 1e-4)
    new = policy.token_logprobs(windows, response)
    expected_loss = -(torch.exp(new - current) * advantage).sum() / 6
    expected = torch.autograd.grad(expected_loss, params, allow_unused=True)
    for g, e in zip(got, expected, strict=True):
        if e is None:
            assert g is None or torch.count_nonzero(g) == 0
        else:
            assert torch.allclose(g, e, atol=1e-6)


def test_a_replacement_trainer_resumes_weights_optimizer_and_step(tmp_path: Path) -> None:
    config = TrainerConfig(nats_url="nats://unused", router_url="http://unused", policy="p", run_dir=str(tmp_path))
    first = _Trainer(config)
    group = _group(first.policy, [[33, 32, 31], [1, 2, 3]], [1.0, 0.0])
    for _ in range(3):
        loss, _ = grpo_loss(first.policy, [group], clip=0.2)
        first.optimizer.zero_grad()
        loss.backward()
        first.optimizer.step()
        first.step += 1
    first.save_checkpoint(7)
    second = _Trainer(config)
    assert second.step == 3
    assert second.version == 7  # the counter's floor when it starts its publisher
    for name, tensor in first.policy.module.state_dict().items():
        assert torch.equal(second.policy.module.state_dict()[name], tensor)
    assert second.optimizer.state_dict()["state"][0]["step"] == first.optimizer.state_dict()["state"][0]["step"]
    assert not (tmp_path / "checkpoint.tmp").exists()
    # A fresh run directory starts from the seed instead.
    fresh = _Trainer(TrainerConfig(nats_url="", router_url="", policy="p", run_dir=str(tmp_path / "other")))
    assert fresh.step == 0 and fresh.version is None
    resumed = second.policy.module.state_dict()["fc.weight"]
    assert not torch.equal(fresh.policy.module.state_dict()["fc.weight"], resumed)
