"""The CPU reference engine behaves like SGLang 0.5.23 on the weight, pause, LoRA, flush and generate routes.

The app runs in-process behind httpx.ASGITransport and is driven through SGLangClient, so these tests also
check the client against a strict server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from tests._builders import wait_until
from weightbus.engines import SGLangClient
from weightbus.errors import EngineError
from weightbus.refengine.engine_state import version_spans
from weightbus.refengine.model import VOCAB, encode
from weightbus.refengine.reference import EngineState, create_app

BASE = "http://engine"
# Polled faster than the engine makes tokens (2 ms each), so a wait sees a state before it moves on.
POLL = 0.001


@pytest.fixture
def state() -> EngineState:
    return EngineState(token_delay=0.002)


@pytest_asyncio.fixture
async def http(state: EngineState) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url=BASE) as http:
        yield http


@pytest.fixture
def client(http: httpx.AsyncClient) -> SGLangClient:
    return SGLangClient(BASE, http=http)


def start_generation(client: SGLangClient, rid: str, max_new_tokens: int = 400) -> asyncio.Task:
    return asyncio.create_task(
        client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": max_new_tokens}, rid=rid)
    )


async def generated(state: EngineState, rid: str, tokens: int) -> None:
    await wait_until(lambda: rid in state.in_flight and len(state.in_flight[rid].output_ids) >= tokens, interval=POLL)


async def test_weight_version_is_default_at_boot(client: SGLangClient) -> None:
    assert await client.weight_version() == "default"


async def test_weight_version_boot_label_is_configurable() -> None:
    app = create_app(EngineState(weight_version="step-0"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as http:
        assert await SGLangClient(BASE, http=http).weight_version() == "step-0"


async def test_model_info_has_the_documented_keys(http: httpx.AsyncClient) -> None:
    for path in ("/model_info", "/get_model_info"):
        response = await http.get(path)
        assert response.status_code == 200
        assert set(response.json()) == {
            "model_path",
            "served_model_name",
            "tokenizer_path",
            "is_generation",
            "preferred_sampling_params",
            "weight_version",
            "load_format",
            "reasoning_parser",
            "tool_call_parser",
            "disaggregation_mode",
            "has_image_understanding",
            "has_audio_understanding",
            "model_type",
            "architectures",
        }


@pytest.mark.parametrize("path", ["/pause_generation", "/continue_generation"])
async def test_pause_and_continue_reject_a_missing_or_non_json_body(http: httpx.AsyncClient, path: str) -> None:
    assert (await http.post(path)).status_code == 400
    assert (await http.post(path, content=b"mode=abort")).status_code == 400
    assert (await http.post(path, json=[])).status_code == 400
    response = await http.post(path, json={})
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


async def test_pause_rejects_an_unknown_mode(http: httpx.AsyncClient) -> None:
    response = await http.post("/pause_generation", json={"mode": "sideways"})
    assert response.status_code == 400
    assert "sideways" in response.json()["message"] or "mode" in response.json()["message"]


async def test_update_weight_version_defaults_to_aborting_in_flight_requests(
    state: EngineState, client: SGLangClient, http: httpx.AsyncClient
) -> None:
    task = start_generation(client, "r1")
    await generated(state, "r1", 3)
    response = await http.post("/update_weight_version", json={"new_version": "1"})
    assert response.json() == {"success": True, "message": "Weight version updated to 1", "new_version": "1"}
    out = await asyncio.wait_for(task, 5)
    assert out.meta_info.finish_reason is not None and out.meta_info.finish_reason.type == "abort"
    assert 3 <= out.meta_info.completion_tokens < 400
    # The abort is processed before the relabel, so the aborted output carries the old version.
    assert out.meta_info.weight_version == "default"
    assert await client.weight_version() == "1"


async def test_update_weight_version_without_abort_keeps_requests_and_records_spans(
    state: EngineState, client: SGLangClient
) -> None:
    task = start_generation(client, "r1", max_new_tokens=30)
    await generated(state, "r1", 2)
    assert await client.update_weight_version(2) == "2"
    out = await asyncio.wait_for(task, 5)
    assert out.meta_info.finish_reason is not None and out.meta_info.finish_reason.type == "length"
    assert out.meta_info.weight_version == "2"
    spans = out.meta_info.weight_versions or []
    assert [span.version for span in spans] == ["default", "2"]
    assert spans[0].start == 0 and spans[0].end == spans[1].start and spans[1].end == 30


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_spans_for_a_request_straddling_a_version_change_under_pause(
    state: EngineState, client: SGLangClient, mode: str
) -> None:
    task = start_generation(client, "r1", max_new_tokens=40)
    await generated(state, "r1", 3)
    await client.pause_generation(mode)  # type: ignore[arg-type]
    await wait_until(lambda: state.in_flight["r1"].parked, interval=POLL)
    cut = len(state.in_flight["r1"].output_ids)
    await client.update_weight_version(7)
    await asyncio.sleep(0.02)  # waited out (ten tokens' time): the point is that nothing is generated meanwhile
    assert len(state.in_flight["r1"].output_ids) == cut, "a paused request must not generate"
    await client.continue_generation()
    out = await asyncio.wait_for(task, 5)
    assert out.meta_info.weight_version == "7"
    assert out.meta_info.weight_versions is not None
    assert [(s.version, s.start, s.end) for s in out.meta_info.weight_versions] == [
        ("default", 0, cut),
        ("7", cut, 40),
    ]
    assert out.meta_info.num_retractions == (1 if mode == "retract" else 0)


async def test_no_spans_when_the_version_did_not_change(client: SGLangClient) -> None:
    out = await client.generate(text="hello", sampling_params={"max_new_tokens": 5})
    assert out.meta_info.weight_versions is None
    assert out.meta_info.weight_version == "default"
    assert out.meta_info.prompt_tokens == 5 and len(out.output_ids) == 5
    assert out.text == "".join(VOCAB[i] for i in out.output_ids)


async def test_pause_abort_mode_aborts_and_later_requests_wait(state: EngineState, client: SGLangClient) -> None:
    first = start_generation(client, "r1")
    await generated(state, "r1", 2)
    await client.pause_generation("abort")
    out = await asyncio.wait_for(first, 5)
    assert out.meta_info.finish_reason is not None and out.meta_info.finish_reason.type == "abort"
    second = start_generation(client, "r2", max_new_tokens=5)
    await wait_until(lambda: "r2" in state.in_flight and state.in_flight["r2"].parked, interval=POLL)
    assert state.in_flight["r2"].output_ids == []
    await client.continue_generation()
    out = await asyncio.wait_for(second, 5)
    assert out.meta_info.finish_reason is not None and out.meta_info.finish_reason.type == "length"


async def test_abort_request_by_rid(state: EngineState, client: SGLangClient, http: httpx.AsyncClient) -> None:
    task = start_generation(client, "r1")
    await generated(state, "r1", 1)
    assert (await http.post("/abort_request", json={"rid": "r1"})).status_code == 200
    out = await asyncio.wait_for(task, 5)
    assert out.meta_info.finish_reason is not None and out.meta_info.finish_reason.type == "abort"


async def test_abort_request_through_the_client_aborts_only_that_rid(state: EngineState, client: SGLangClient) -> None:
    first, second = start_generation(client, "a1"), start_generation(client, "a2")
    await generated(state, "a1", 1)
    await generated(state, "a2", 1)
    await client.abort_request("a1", message="certain to be stale")
    out = await asyncio.wait_for(first, 5)
    assert out.meta_info.finish_reason is not None
    assert (out.meta_info.finish_reason.type, out.meta_info.finish_reason.message) == ("abort", "certain to be stale")
    assert not second.done()
    await client.abort_request("never-sent")  # an unknown rid is ignored, as sglang does
    await client.abort_all_requests()
    out2 = await asyncio.wait_for(second, 5)
    assert out2.meta_info.finish_reason is not None and out2.meta_info.finish_reason.type == "abort"


async def test_abort_request_without_a_body_is_refused(http: httpx.AsyncClient) -> None:
    assert (await http.post("/abort_request")).status_code == 400


async def test_lora_load_does_not_change_the_version_and_duplicates_fail(
    state: EngineState, client: SGLangClient
) -> None:
    await client.update_weight_version(3)
    result = await client.load_lora_adapter("a", "/lora/a")
    assert result.success and result.loaded_adapters == {"a": "/lora/a"}
    assert await client.weight_version() == "3"
    with pytest.raises(EngineError) as info:
        await client.load_lora_adapter("a", "/lora/a2")
    assert info.value.status == 400
    assert info.value.message == "LoRA with name a already exists"
    assert state.lora_adapters["a"].path == "/lora/a"

    base = await client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 12})
    tuned = await client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 12}, lora_path="a")
    assert base.output_ids != tuned.output_ids
    with pytest.raises(EngineError, match="not loaded"):
        await client.generate(input_ids=[1], lora_path="b")

    assert (await client.unload_lora_adapter("a")).loaded_adapters == {}
    assert await client.weight_version() == "3"
    with pytest.raises(EngineError, match="not loaded"):
        await client.unload_lora_adapter("a")


async def test_ignore_version_updates_answers_success_but_keeps_the_version(
    state: EngineState, client: SGLangClient
) -> None:
    state.ignore_version_updates = True
    assert await client.update_weight_version(5) == "5"
    await client.update_weights_from_disk("/ckpt/6", weight_version=6)
    assert await client.weight_version() == "default"


async def test_update_weights_from_disk_applies_the_version_only_on_success(
    state: EngineState, client: SGLangClient
) -> None:
    before = await client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 12})
    state.fail_weight_updates = "checkpoint is corrupt"
    with pytest.raises(EngineError, match="checkpoint is corrupt") as info:
        await client.update_weights_from_disk("/ckpt/1", weight_version=1)
    assert info.value.status == 400
    assert await client.weight_version() == "default"

    state.fail_weight_updates = None
    result = await client.update_weights_from_disk("/ckpt/1", weight_version=1)
    assert result.success and result.num_paused_requests == 0
    info_after = await client.model_info()
    assert (info_after.weight_version, info_after.model_path) == ("1", "/ckpt/1")
    after = await client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 12})
    assert after.output_ids != before.output_ids
    assert after.meta_info.weight_version == "1"


async def test_update_weights_without_version_keeps_the_label(client: SGLangClient) -> None:
    await client.update_weight_version(4)
    await client.update_weights_from_disk("/ckpt/x")
    await client.update_weights_from_tensor(["payload"])
    await client.update_weights_from_distributed(["w"], ["float32"], [[2]])
    assert await client.weight_version() == "4"
    await client.update_weights_from_tensor(["payload2"], weight_version=5)
    assert await client.weight_version() == "5"
    await client.update_weights_from_distributed(["w"], ["float32"], [[2]], weight_version=6)
    assert await client.weight_version() == "6"


async def test_update_weights_reports_paused_requests(state: EngineState, client: SGLangClient) -> None:
    task = start_generation(client, "r1", max_new_tokens=20)
    await generated(state, "r1", 1)
    await client.pause_generation("in_place")
    await wait_until(lambda: state.in_flight["r1"].parked, interval=POLL)
    result = await client.update_weights_from_disk("/ckpt/2", weight_version=2)
    assert result.num_paused_requests == 1
    await client.continue_generation()
    out = await asyncio.wait_for(task, 5)
    assert out.meta_info.weight_version == "2"


async def test_flush_cache_is_text_and_fails_while_requests_run(
    state: EngineState, client: SGLangClient, http: httpx.AsyncClient
) -> None:
    response = await http.get("/flush_cache")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert await client.flush_cache() == "Cache flushed.\n"

    task = start_generation(client, "r1", max_new_tokens=15)
    await generated(state, "r1", 1)
    await client.pause_generation("in_place")
    with pytest.raises(EngineError) as info:
        await client.flush_cache()
    assert info.value.status == 400 and "running or waiting" in info.value.message
    await client.continue_generation()
    assert await client.flush_cache(timeout=5) == "Cache flushed.\n"
    await task


async def test_unknown_keys_are_ignored(http: httpx.AsyncClient, client: SGLangClient) -> None:
    body = {"new_version": "9", "abort_all_requests": False, "rid": "x", "from_the_future": {"a": 1}}
    assert (await http.post("/update_weight_version", json=body)).status_code == 200
    assert await client.weight_version() == "9"


async def test_bad_bodies_are_400(http: httpx.AsyncClient) -> None:
    assert (await http.post("/update_weight_version", json={})).status_code == 400
    assert (await http.post("/update_weight_version", json={"new_version": 3})).status_code == 400
    assert (await http.post("/generate", json={"sampling_params": {}})).status_code == 400
    assert (await http.post("/generate", json={"input_ids": [999]})).status_code == 400
    assert (await http.post("/generate", json={"text": "x", "stream": True})).status_code == 400


async def test_generation_is_deterministic_and_honours_stop_tokens(client: SGLangClient) -> None:
    first = await client.generate(text="abc", sampling_params={"max_new_tokens": 10})
    second = await client.generate(input_ids=encode("abc"), sampling_params={"max_new_tokens": 10})
    assert first.output_ids == second.output_ids
    stop = first.output_ids[3]
    stopped = await client.generate(text="abc", sampling_params={"max_new_tokens": 10, "stop_token_ids": [stop]})
    assert stopped.output_ids == first.output_ids[: first.output_ids.index(stop) + 1]
    assert stopped.meta_info.finish_reason is not None
    assert (stopped.meta_info.finish_reason.type, stopped.meta_info.finish_reason.matched) == ("stop", stop)


async def test_every_request_is_recorded(state: EngineState, client: SGLangClient, http: httpx.AsyncClient) -> None:
    await client.pause_generation("in_place")
    await client.update_weight_version(1)
    await client.continue_generation()
    await http.post("/pause_generation", content=b"not json")
    await client.flush_cache(timeout=1)
    assert [(r.method, r.path, r.body) for r in state.requests] == [
        ("POST", "/pause_generation", {"mode": "in_place"}),
        ("POST", "/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
        ("POST", "/continue_generation", {}),
        ("POST", "/pause_generation", "not json"),
        ("POST", "/flush_cache", None),
    ]
    assert state.requests[-1].query == {"timeout": "1.0"}
    assert len(state.recorded("/pause_generation")) == 2


async def test_api_key_is_required_when_configured() -> None:
    state = EngineState(api_key="k")
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as http:
        assert (await http.get("/health")).status_code == 200
        with pytest.raises(EngineError) as info:
            await SGLangClient(BASE, http=http).update_weight_version(1)
        assert info.value.status == 401
        with pytest.raises(EngineError):
            await SGLangClient(BASE, http=http, api_key="wrong").weight_version()
        authed = SGLangClient(BASE, http=http, api_key="k")
        assert await authed.update_weight_version(1) == "1"
        assert await authed.weight_version() == "1"


def test_version_spans_are_half_open_token_ranges() -> None:
    assert version_spans([]) == []
    assert version_spans(["a", "a"]) == [{"version": "a", "start": 0, "end": 2}]
    assert version_spans(["a", "b", "b", "a"]) == [
        {"version": "a", "start": 0, "end": 1},
        {"version": "b", "start": 1, "end": 3},
        {"version": "a", "start": 3, "end": 4},
    ]
