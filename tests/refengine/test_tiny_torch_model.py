"""The reference engine with TinyTorchModel: weights really come from torch.save'd files and payloads."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

torch = pytest.importorskip("torch")

from weightbus.engines import SGLangClient  # noqa: E402
from weightbus.errors import EngineError  # noqa: E402
from weightbus.refengine.reference import EngineState, create_app  # noqa: E402
from weightbus.refengine.tiny_model import (  # noqa: E402
    TinyTorchModel,
    random_state_dict,
    save_random_weights,
    serialize_named_tensors,
)

pytestmark = pytest.mark.torch

PROMPT = [3, 1, 4, 1, 5]
PARAMS = {"max_new_tokens": 12}


@pytest.fixture
def model() -> TinyTorchModel:
    return TinyTorchModel(seed=0)


@pytest_asyncio.fixture
async def client(model: TinyTorchModel) -> AsyncIterator[SGLangClient]:
    app = create_app(EngineState(model=model))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as http:
        yield SGLangClient("http://engine", http=http)


async def ids(client: SGLangClient) -> list[int]:
    return (await client.generate(input_ids=PROMPT, sampling_params=PARAMS)).output_ids


async def test_disk_update_loads_the_saved_weights(client: SGLangClient, tmp_path: Path) -> None:
    before = await ids(client)
    assert before == await ids(client)
    path = tmp_path / "step1.pt"
    save_random_weights(str(path), seed=1)
    await client.update_weights_from_disk(str(path), weight_version=1)
    after = await ids(client)
    assert after != before
    reference = TinyTorchModel(seed=1)
    expected, context = [], list(PROMPT)
    for _ in range(12):
        expected.append(reference.next_token(context, None))
        context.append(expected[-1])
    assert after == expected
    assert (await client.model_info()).model_path == str(path)
    assert await client.weight_version() == "1"


@pytest.mark.parametrize("content", ["missing", "garbage", "wrong_shape", "partial"])
async def test_bad_checkpoint_fails_and_keeps_weights_and_version(
    client: SGLangClient, model: TinyTorchModel, tmp_path: Path, content: str
) -> None:
    before = await ids(client)
    path = tmp_path / "bad.pt"
    if content == "garbage":
        path.write_bytes(b"not a torch file")
    elif content == "wrong_shape":
        state = random_state_dict(1)
        state["head.bias"] = torch.zeros(3)
        torch.save(state, path)
    elif content == "partial":
        state = random_state_dict(1)
        del state["head.weight"]
        torch.save(state, path)
    with pytest.raises(EngineError) as info:
        await client.update_weights_from_disk(str(path), weight_version=1)
    assert info.value.status == 400
    assert await client.weight_version() == "default"
    assert await ids(client) == before


async def test_tensor_update_accepts_a_subset(client: SGLangClient, model: TinyTorchModel) -> None:
    new_bias = torch.arange(model.vocab_size, dtype=torch.float32) * 100
    await client.update_weights_from_tensor([serialize_named_tensors({"head.bias": new_bias})], weight_version="2")
    assert torch.equal(model.state_dict()["head.bias"], new_bias)
    # A dominant bias on the last token makes greedy decoding pick it every time.
    assert set(await ids(client)) == {model.vocab_size - 1}
    assert await client.weight_version() == "2"
    with pytest.raises(EngineError, match="unknown parameters"):
        await client.update_weights_from_tensor([serialize_named_tensors({"nope": new_bias})], weight_version="3")
    with pytest.raises(EngineError, match="cannot decode"):
        await client.update_weights_from_tensor(["!!not base64!!"], weight_version="3")
    assert await client.weight_version() == "2"


async def test_distributed_update_is_refused_on_cpu(client: SGLangClient) -> None:
    with pytest.raises(EngineError, match="NCCL") as info:
        await client.update_weights_from_distributed(["head.bias"], ["float32"], [[44]], weight_version=1)
    assert info.value.status == 400
    assert await client.weight_version() == "default"
