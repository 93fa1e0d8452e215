"""SGLangClient against httpx.MockTransport: the exact JSON on the wire and the typed errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from weightbus.engines import SGLangClient
from weightbus.errors import EngineError
from weightbus.producers import EngineFleet

URL = "http://engine-0:30000"
OK_UPDATE = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


class Recorder:
    """A MockTransport handler that records every request and answers from a per-path table."""

    def __init__(self, answers: dict[str, httpx.Response | Callable[[httpx.Request], httpx.Response]]) -> None:
        self.answers = answers
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.get(request.url.path)
        if answer is None:
            return httpx.Response(404, text="Not Found")
        return answer(request) if callable(answer) else answer

    @property
    def body(self) -> Any:
        content = self.requests[-1].content
        return json.loads(content) if content else None


def client_for(recorder: Recorder, **kwargs: Any) -> SGLangClient:
    return SGLangClient(URL + "/", http=httpx.AsyncClient(transport=httpx.MockTransport(recorder)), **kwargs)


async def test_url_is_normalized() -> None:
    async with SGLangClient("engine-0:30000/") as client:
        assert client.url == "http://engine-0:30000"
    with pytest.raises(ValueError):
        SGLangClient("  ")


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_pause_generation_always_sends_mode(mode: str) -> None:
    rec = Recorder({"/pause_generation": httpx.Response(200, json={"message": "ok", "status": "ok"})})
    await client_for(rec).pause_generation(mode)  # type: ignore[arg-type]
    request = rec.requests[-1]
    assert (request.method, str(request.url)) == ("POST", f"{URL}/pause_generation")
    assert request.headers["content-type"] == "application/json"
    assert rec.body == {"mode": mode}


async def test_pause_generation_defaults_to_retract_and_continue_sends_empty_object() -> None:
    ack = httpx.Response(200, json={"message": "ok", "status": "ok"})
    rec = Recorder({"/pause_generation": ack, "/continue_generation": ack})
    client = client_for(rec)
    await client.pause_generation()
    assert rec.body == {"mode": "retract"}
    await client.continue_generation()
    assert rec.requests[-1].content == b"{}"


async def test_update_weight_version_sends_string_and_explicit_false() -> None:
    answer = {"success": True, "message": "Weight version updated to 12", "new_version": "12"}
    rec = Recorder({"/update_weight_version": httpx.Response(200, json=answer)})
    client = client_for(rec)
    assert await client.update_weight_version(12) == "12"
    assert rec.body == {"new_version": "12", "abort_all_requests": False}
    await client.update_weight_version("12", abort_all_requests=True)
    assert rec.body == {"new_version": "12", "abort_all_requests": True}


async def test_update_weights_from_disk_body() -> None:
    rec = Recorder({"/update_weights_from_disk": httpx.Response(200, json=OK_UPDATE)})
    client = client_for(rec)
    result = await client.update_weights_from_disk("/ckpt/step_3")
    assert result.success and result.num_paused_requests == 0
    assert rec.body == {
        "model_path": "/ckpt/step_3",
        "load_format": None,
        "abort_all_requests": False,
        "weight_version": None,
        "flush_cache": True,
    }
    await client.update_weights_from_disk(
        "/ckpt/step_4", weight_version=4, load_format="auto", flush_cache=False, abort_all_requests=True
    )
    assert rec.body == {
        "model_path": "/ckpt/step_4",
        "load_format": "auto",
        "abort_all_requests": True,
        "weight_version": "4",
        "flush_cache": False,
    }


async def test_update_weights_from_tensor_body() -> None:
    rec = Recorder({"/update_weights_from_tensor": httpx.Response(200, json={"success": True, "message": ""})})
    await client_for(rec).update_weights_from_tensor(
        ["AAAA", "BBBB"], weight_version=7, load_format="flattened_bucket", flush_cache=False, selector="target"
    )
    assert rec.body == {
        "serialized_named_tensors": ["AAAA", "BBBB"],
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "abort_all_requests": False,
        "weight_version": "7",
        "selector": "target",
    }


async def test_update_weights_from_distributed_body() -> None:
    rec = Recorder({"/update_weights_from_distributed": httpx.Response(200, json={"success": True, "message": ""})})
    client = client_for(rec)
    await client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], weight_version="8")
    assert rec.body == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "weight_update_group",
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": "8",
        "load_format": None,
        "selector": "all",
    }
    with pytest.raises(ValueError, match="differ in length"):
        await client.update_weights_from_distributed(["w", "b"], ["bfloat16"], [[2]])
    assert len(rec.requests) == 1


async def test_lora_bodies() -> None:
    answer = {"success": True, "error_message": None, "loaded_adapters": {"a": "/lora/a"}}
    rec = Recorder(
        {
            "/load_lora_adapter": httpx.Response(200, json=answer),
            "/unload_lora_adapter": httpx.Response(200, json={"success": True, "loaded_adapters": {}}),
        }
    )
    client = client_for(rec)
    result = await client.load_lora_adapter("a", "/lora/a")
    assert rec.body == {"lora_name": "a", "lora_path": "/lora/a", "pinned": False}
    assert result.loaded_adapters == {"a": "/lora/a"}
    await client.load_lora_adapter("b", "/lora/b", pinned=True)
    assert rec.body == {"lora_name": "b", "lora_path": "/lora/b", "pinned": True}
    assert (await client.unload_lora_adapter("a")).loaded_adapters == {}
    assert rec.body == {"lora_name": "a"}


async def test_model_info_ignores_unknown_keys_and_falls_back_to_get_model_info() -> None:
    info = {"weight_version": "3", "model_path": "m", "is_generation": True, "brand_new_key": [1]}
    rec = Recorder({"/model_info": httpx.Response(200, json=info)})
    client = client_for(rec)
    model_info = await client.model_info()
    assert (model_info.weight_version, model_info.model_path, model_info.architectures) == ("3", "m", None)
    assert rec.requests[-1].method == "GET" and rec.requests[-1].content == b""

    old = Recorder({"/get_model_info": httpx.Response(200, json={"weight_version": "default"})})
    assert await client_for(old).weight_version() == "default"
    assert [r.url.path for r in old.requests] == ["/model_info", "/get_model_info"]


async def test_model_info_without_weight_version_is_an_engine_error() -> None:
    rec = Recorder({"/model_info": httpx.Response(200, json={"model_path": "m"})})
    with pytest.raises(EngineError, match="weight_version") as info:
        await client_for(rec).model_info()
    assert info.value.status == 200


async def test_flush_cache_returns_text_and_sends_timeout_query() -> None:
    rec = Recorder({"/flush_cache": httpx.Response(200, text="Cache flushed.\n")})
    client = client_for(rec)
    assert await client.flush_cache() == "Cache flushed.\n"
    assert rec.requests[-1].url.query == b""
    await client.flush_cache(timeout=2.5)
    assert rec.requests[-1].url.params["timeout"] == "2.5"


async def test_generate_body_and_output() -> None:
    answer = {
        "text": "ab",
        "output_ids": [1, 2],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": "5",
            "weight_versions": [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 2}],
            "e2e_latency": 0.1,
        },
    }
    rec = Recorder({"/generate": httpx.Response(200, json=answer)})
    client = client_for(rec)
    out = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert rec.body == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "stream": False}
    assert out.meta_info.weight_version == "5"
    assert out.meta_info.finish_reason is not None and out.meta_info.finish_reason.type == "length"
    assert [span.version for span in out.meta_info.weight_versions or []] == ["4", "5"]

    await client.generate(text="hi", lora_path="a", rid="r9")
    assert rec.body == {"text": "hi", "sampling_params": {}, "stream": False, "lora_path": "a", "rid": "r9"}
    with pytest.raises(ValueError):
        await client.generate()
    with pytest.raises(ValueError):
        await client.generate(text="x", input_ids=[1])


async def test_bearer_auth_header() -> None:
    rec = Recorder({"/model_info": httpx.Response(200, json={"weight_version": "1"})})
    await client_for(rec, api_key="s3cret").model_info()
    assert rec.requests[-1].headers["authorization"] == "Bearer s3cret"
    await client_for(rec).model_info()
    assert "authorization" not in rec.requests[-1].headers


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(400, json={"success": False, "message": "bad version"}), "bad version"),
        (httpx.Response(400, json={"success": False, "error_message": "LoRA with name a already exists"}), "LoRA"),
        (httpx.Response(500, text="Internal Server Error\n"), "Internal Server Error"),
        (httpx.Response(422, json={"detail": "field required"}), "field required"),
        (httpx.Response(401, json={"error": {"message": "Unauthorized"}}), "Unauthorized"),
        (httpx.Response(503), "Service Unavailable"),
    ],
)
async def test_non_2xx_is_engine_error_with_status_and_message(response: httpx.Response, message: str) -> None:
    rec = Recorder({"/update_weight_version": response})
    with pytest.raises(EngineError) as info:
        await client_for(rec).update_weight_version(1)
    assert info.value.url == URL
    assert info.value.status == response.status_code
    assert message in info.value.message


async def test_success_false_with_200_is_engine_error() -> None:
    rec = Recorder({"/update_weights_from_disk": httpx.Response(200, json={"success": False, "message": "no such"})})
    with pytest.raises(EngineError) as info:
        await client_for(rec).update_weights_from_disk("/nope")
    assert (info.value.status, info.value.message) == (200, "no such")


async def test_unexpected_body_is_engine_error() -> None:
    rec = Recorder({"/update_weight_version": httpx.Response(200, text="<html>proxy</html>")})
    with pytest.raises(EngineError, match="unexpected response body") as info:
        await client_for(rec).update_weight_version(1)
    assert info.value.status == 200


@pytest.mark.parametrize(
    ("exc", "words"),
    [(httpx.ConnectError("refused"), "ConnectError"), (httpx.ReadTimeout("slow"), "timed out")],
)
async def test_transport_errors_have_no_status(exc: Exception, words: str) -> None:
    def boom(request: httpx.Request) -> httpx.Response:
        raise exc

    client = SGLangClient(URL, http=httpx.AsyncClient(transport=httpx.MockTransport(boom)))
    with pytest.raises(EngineError) as info:
        await client.pause_generation()
    assert (info.value.url, info.value.status) == (URL, None)
    assert words in info.value.message
    assert isinstance(info.value.__cause__, httpx.HTTPError)


async def test_an_http_client_that_breaks_inside_is_an_engine_error_not_a_crash_of_the_caller() -> None:
    # Seen in the demo: an engine killed as the trainer connected, on uvloop, made anyio (under httpcore) raise
    # AttributeError ('NoneType' object has no attribute 'getpeername'); it escaped httpx, the fleet's step and the
    # trainer's retry of engine errors, and the trainer process died.
    def broken(request: httpx.Request) -> httpx.Response:
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    client = SGLangClient(URL, http=httpx.AsyncClient(transport=httpx.MockTransport(broken)))
    with pytest.raises(EngineError) as info:
        await client.pause_generation()
    assert (info.value.url, info.value.status) == (URL, None)
    assert "AttributeError" in info.value.message and "getpeername" in info.value.message
    fleet = EngineFleet([client])
    with pytest.raises(EngineError):  # what update() and the trainer's retry handle as an engine failure
        await fleet.pause()


async def test_borrowed_http_client_is_not_closed() -> None:
    http = httpx.AsyncClient(transport=httpx.MockTransport(Recorder({})))
    async with SGLangClient(URL, http=http):
        pass
    assert not http.is_closed
    await http.aclose()


async def test_abort_request_sends_sglangs_abort_req_by_rid() -> None:
    rec = Recorder({"/abort_request": httpx.Response(200)})
    client = client_for(rec)
    await client.abort_request("group-7-3")
    request = rec.requests[-1]
    assert (request.method, str(request.url)) == ("POST", f"{URL}/abort_request")
    assert request.headers["content-type"] == "application/json"
    assert rec.body == {"rid": "group-7-3", "abort_all": False, "abort_message": None}
    await client.abort_request("r", message="certain to be stale")
    assert rec.body == {"rid": "r", "abort_all": False, "abort_message": "certain to be stale"}
    await client.abort_all_requests()
    assert rec.body == {"rid": None, "abort_all": True, "abort_message": None}
    with pytest.raises(ValueError, match="rid"):
        await client.abort_request("")


async def test_abort_request_failure_is_an_engine_error() -> None:
    rec = Recorder({"/abort_request": httpx.Response(400, json={"message": "bad"})})
    with pytest.raises(EngineError) as info:
        await client_for(rec).abort_request("r1")
    assert info.value.status == 400


async def test_generate_sends_the_rid_it_is_given() -> None:
    answer = {"text": "", "output_ids": [], "meta_info": {"id": "r9", "weight_version": "1"}}
    rec = Recorder({"/generate": httpx.Response(200, json=answer)})
    await client_for(rec).generate(input_ids=[1], rid="r9")
    assert rec.body["rid"] == "r9"
