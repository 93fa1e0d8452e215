"""Early abort inside slime (``--custom-generate-function-path weightbus.integrations.slime.generate``): a request
that can no longer be fresh is aborted on the engine by its rid, and its group is recycled.

Real engines over real HTTP: the reference engine (SGLang 0.5.23's routes, ``/abort_request`` by rid) behind a
router stand-in that lists it on ``GET /workers`` and forwards ``/generate``, cutting every request short but the
second it sees (a long answer). The bound is 0: once the group's short request answered at v1 and v2 is
published, the long one cannot be fresh any more. slime's own generate function (the control) sends no rid and
no abort: the group runs to its end and is trained over the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests._builders import wait_until
from tests.integrations.slime import slime_standin as standin
from tests.integrations.slime.slime_standin import SLIME_ROLLOUT, WEIGHTBUS_ROLLOUT, announce, make_args, oldest
from weightbus.bus import NatsBus
from weightbus.refengine.engine_state import EngineState
from weightbus.refengine.reference import create_app
from weightbus.refengine.serve import ServedEngine

# The engines first, so that they outlive slime: its worker's last requests find them up, and its stop returns at
# once instead of after its 5 s join, the worker thread retrying against closed ports.
pytestmark = [pytest.mark.nats, pytest.mark.usefixtures("engines", "slime_modules")]

LONG, SHORT = 400, 4  # tokens of the long answer (4 s at the engine's 10 ms a token) and of every other one
WEIGHTBUS_GENERATE = "weightbus.integrations.slime.generate"


class Router:
    """A router stand-in: ``GET /workers`` lists the engine, ``/generate`` is forwarded (all but the 2nd cut short)."""

    def __init__(self, engine_url: str, long: int = LONG) -> None:
        self.engine_url = engine_url
        self.long = long
        self.seen = self.answered = 0
        self.long_rid: str | None = None
        self.long_running = False
        self.app = Starlette(
            routes=[Route("/workers", self.workers), Route("/generate", self.generate, methods=["POST"])]
        )

    async def workers(self, request: Request) -> Response:
        return JSONResponse({"workers": [{"url": self.engine_url, "id": "engine-0"}]})

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.seen += 1
        long = self.seen == 2
        if long:
            self.long_rid, self.long_running = body.get("rid", ""), True
            body["sampling_params"]["max_new_tokens"] = self.long
        else:
            body["sampling_params"]["max_new_tokens"] = SHORT
        async with httpx.AsyncClient(timeout=None) as http:
            answer = await http.post(f"{self.engine_url}/generate", json=body)
        self.answered += 1
        if long:
            self.long_running = False
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")


@pytest.fixture
def engines() -> Iterator[tuple[EngineState, Router, ServedEngine]]:
    state = EngineState(weight_version="1", token_delay=0.01)
    with ServedEngine(create_app(state)) as engine:
        router = Router(engine.url)
        with ServedEngine(router.app) as served:
            yield state, router, served


@pytest.mark.parametrize("generate", [WEIGHTBUS_GENERATE, pytest.param(None, marks=pytest.mark.slow)])
async def test_a_request_that_cannot_be_fresh_is_aborted_and_its_group_recycled(
    nats_bus: NatsBus,
    nats_url: str,
    policy: str,
    monkeypatch: pytest.MonkeyPatch,
    engines: tuple[EngineState, Router, ServedEngine],
    generate: str | None,
) -> None:
    from slime.ray.rollout import RolloutManager  # type: ignore[import-not-found]

    state, router, served = engines
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_MAX_STALENESS", "0")
    args = make_args(
        rollout_batch_size=1,
        n_samples_per_prompt=2,
        sglang_server_concurrency=2,
        sglang_router_port=served.port,
        rollout_max_response_len=LONG,
        custom_generate_function_path=generate,
        rollout_function_path=WEIGHTBUS_ROLLOUT if generate is not None else SLIME_ROLLOUT,
    )
    await announce(nats_bus, policy, 1)
    manager = RolloutManager(args)
    rollout = asyncio.ensure_future(standin.in_thread(manager.generate, 0, timeout=30))
    # Group 0's short request answered at v1; its long one is generating.
    try:
        await wait_until(
            lambda: router.long_running and router.answered >= 1, 10, "the long one to run, its sibling answered"
        )
    except BaseException:
        standin.release()
        raise
    async with httpx.AsyncClient() as http:
        body = {"new_version": "2", "abort_all_requests": False}
        (await http.post(f"{router.engine_url}/update_weight_version", json=body)).raise_for_status()
    await announce(nats_bus, policy, 2)
    [group] = await rollout
    aborts = [r.body for r in state.recorded("/abort_request")]
    source = manager.data_source
    if generate is None:
        # The control, slime alone: no rid, no abort; the group runs to its end and is trained though stale.
        step = 0
        while group[0].group_index != 0:  # slime's pool runs other groups meanwhile: group 0 comes when it ends
            step += 1
            assert step < 1000, "group 0 never came"
            [group] = await standin.in_thread(manager.generate, step, timeout=30)
        assert group[0].group_index == 0 and oldest(group) == 1  # trained at v2 with a v1 sample: over the bound
        assert [r.body for r in state.recorded("/abort_request")] == [] and router.long_rid == ""
        return
    assert router.long_rid and [a["rid"] for a in aborts] == [router.long_rid]
    metrics = manager.metrics[0]
    assert metrics["weightbus/early_aborts"] == 1 and metrics["weightbus/tokens_saved"] > 0
    assert metrics["weightbus/recycled"] == 1
    # The aborted group came back pristine and was generated again at v2: that is what is trained.
    [back] = source.added
    assert back[0].group_index == 0 and all(s.weight_versions == [] for s in back)
    assert group[0].group_index == 0 and oldest(group) == 2


@pytest.mark.parametrize("generate", [WEIGHTBUS_GENERATE, None])
async def test_a_call_that_spans_an_update_is_labelled_by_its_oldest_tokens(
    nats_bus: NatsBus,
    nats_url: str,
    policy: str,
    monkeypatch: pytest.MonkeyPatch,
    engines: tuple[EngineState, Router, ServedEngine],
    generate: str | None,
) -> None:
    # The bound is wide (no abort): the long request runs through the update and answers with version spans
    # [v1, v2]. slime keeps only "2"; weightbus' generate function adds the oldest, so the group is judged by it.
    from slime.ray.rollout import RolloutManager

    state, router, served = engines
    router.long = 100  # 1 s
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_MAX_STALENESS", "5")
    args = make_args(
        rollout_batch_size=1,
        n_samples_per_prompt=2,
        sglang_server_concurrency=2,
        sglang_router_port=served.port,
        rollout_max_response_len=LONG,
        custom_generate_function_path=generate,
    )
    await announce(nats_bus, policy, 1)
    manager = RolloutManager(args)
    rollout = asyncio.ensure_future(standin.in_thread(manager.generate, 0, timeout=30))
    try:
        await wait_until(lambda: router.long_running and router.answered >= 1, 10, "the long one to run")
    except BaseException:
        standin.release()
        raise
    async with httpx.AsyncClient() as http:
        body = {"new_version": "2", "abort_all_requests": False}
        (await http.post(f"{router.engine_url}/update_weight_version", json=body)).raise_for_status()
    await announce(nats_bus, policy, 2)
    [group] = await rollout
    step = 0
    while group[0].group_index != 0:
        step += 1
        assert step < 1000, "group 0 never came"
        [group] = await standin.in_thread(manager.generate, step, timeout=30)
    [long] = [s for s in group if s.response_length > SHORT]
    assert "2" in long.weight_versions  # the engine's version when it answered
    if generate is None:
        assert long.weight_versions == ["2"]  # the control: slime's label says v2 for tokens made at v1
        return
    assert min(int(label) for label in long.weight_versions) == 1
