"""A rollout group generated on a reference engine: stamped from meta_info, with the engine's logprobs and rewards."""

from __future__ import annotations

import itertools

import httpx
import pytest

pytest.importorskip("torch")

from weightbus.refengine.policy_model import WindowLM  # noqa: E402
from weightbus.refengine.reference import EngineState, create_app  # noqa: E402
from weightbus.rl.rollout import RolloutConfig, generate_group  # noqa: E402
from weightbus.rl.task import ReverseDigits  # noqa: E402
from weightbus.schemas.rollouts import Group, SampleStatus  # noqa: E402

pytestmark = pytest.mark.torch


async def test_a_group_is_stamped_from_meta_info_and_carries_the_engine_logprobs() -> None:
    state = EngineState(model=WindowLM(seed=0), weight_version="12")
    task = ReverseDigits(3)
    config = RolloutConfig(nats_url="nats://unused", router_url="http://engine", policy="p", group_size=4)
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
        group = await generate_group(http, config, task, Group(prompt_index=0), "407.", itertools.count(5))
        state.weight_version = "default"
        unknown = await generate_group(http, config, task, Group(prompt_index=1), "123.", itertools.count())
    assert [s.index for s in group.samples] == [5, 6, 7, 8]
    assert group.status == SampleStatus.COMPLETED and group.metadata["prompt"] == "407."
    for sample in group.samples:
        assert sample.weight_versions == ["12"] and sample.oldest_version == 12
        assert sample.response_length == 3 and sample.tokens[:4] == task.encode("407.")
        assert len(sample.metadata["logprobs"]) == 3 and all(lp <= 0 for lp in sample.metadata["logprobs"])
        assert sample.reward == task.reward("407.", sample.response)
    # Every request asked for logprobs at the rollout's temperature.
    bodies = [r.body for r in state.recorded("/generate")]
    assert all(b["return_logprob"] is True and b["sampling_params"]["temperature"] == 1.0 for b in bodies)
    # An engine that booted as "default" yields samples the staleness rule can never take for fresh.
    assert all(s.has_unknown_version and s.oldest_version is None for s in unknown.samples)
