"""Early abort on the reference engine: a group a new version makes certain to be stale is aborted by rid,
a group nothing is known of yet is not, and the rollout recycles the aborted prompt with the tokens counted."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Sequence

import httpx
from prometheus_client import CollectorRegistry

from weightbus.bus.memory import MemoryBus
from weightbus.consumers.inflight import EngineAborter, InFlightGroups, oldest_label
from weightbus.refengine.engine_state import EngineState
from weightbus.refengine.reference import create_app
from weightbus.rl.config import RolloutConfig
from weightbus.rl.rollout import _Rollout, generate_group
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

URL = "http://engine"


class Digits:
    """A task whose prompts are digits and whose responses may run long."""

    max_new_tokens = 3

    def prompt(self, rng: random.Random) -> str:
        return "12."

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 32 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(48 + i % 10) for i in ids)

    def reward(self, prompt: str, response: str) -> float:
        return 0.0


class LongSecond(httpx.AsyncBaseTransport):
    """Lets the second request of a group run long (a real model's long answer): its max_new_tokens is raised."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            body = json.loads(request.content)
            if str(body.get("rid", "")).endswith("-1"):
                body["sampling_params"]["max_new_tokens"] = 10_000
                content = json.dumps(body).encode()
                headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
                request = httpx.Request(request.method, request.url, headers=headers, content=content)
        return await self.inner.handle_async_request(request)


def engine() -> tuple[EngineState, httpx.AsyncClient]:
    state = EngineState(weight_version="5", token_delay=0.005)
    transport = LongSecond(httpx.ASGITransport(app=create_app(state)))
    return state, httpx.AsyncClient(transport=transport, base_url=URL)


def config(**kw: object) -> RolloutConfig:
    return RolloutConfig(nats_url="nats://unused", router_url=URL, policy="p", group_size=2, max_staleness=0, **kw)


async def test_a_new_version_aborts_the_unfinished_request_of_a_group_certain_to_be_stale() -> None:
    state, http = engine()
    current = [5]
    async with http:
        inflight = InFlightGroups(0, lambda: current[0], EngineAborter(URL, http, engines=[URL]))
        flight = inflight.open("t", 2)
        task = asyncio.create_task(
            generate_group(
                http, config(), Digits(), Group(prompt_index=0), "12.", itertools.count(), None, flight, inflight
            )
        )
        while not flight.done[0]:
            await asyncio.sleep(0.01)
        assert flight.oldest[0] == 5 and not flight.aborted  # fresh so far at v5, bound 0
        current[0] = 6
        assert inflight.check() == 1
        group = await asyncio.wait_for(task, 10)
        await inflight.wait_sent()
    assert flight.aborted
    assert [r.body for r in state.recorded("/abort_request")] == [
        {"rid": flight.rids[1], "abort_all": False, "abort_message": "weightbus: certain to exceed the staleness bound"}
    ]
    assert [s.status for s in group.samples] == [SampleStatus.COMPLETED, SampleStatus.ABORTED]
    assert group.samples[1].response_length < 10_000
    assert group.status == SampleStatus.ABORTED
    assert [r.body["rid"] for r in state.recorded("/generate")] == flight.rids


async def test_nothing_finished_means_nothing_is_certain_and_nothing_is_aborted() -> None:
    state, http = engine()
    async with http:
        inflight = InFlightGroups(0, lambda: 100, EngineAborter(URL, http, engines=[URL]))
        flight = inflight.open("t", 2)
        assert inflight.check(100) == 0
        inflight.finished(flight, 1, None)  # a finished request with no numeric label bounds nothing
        assert inflight.check(100) == 0 and not flight.aborted
        await inflight.wait_sent()
    assert state.recorded("/abort_request") == []


async def test_a_tracker_that_is_not_ready_never_aborts() -> None:
    from weightbus.errors import TrackerNotReadyError

    def not_ready() -> int:
        raise TrackerNotReadyError("p", "starting", "")

    calls: list[list[str]] = []

    async def record(rids: list[str]) -> None:
        calls.append(rids)

    inflight = InFlightGroups(0, not_ready, record)
    flight = inflight.open("t", 2)
    inflight.finished(flight, 0, 1)
    assert not flight.aborted and calls == []


def test_oldest_label_reads_the_label_and_the_spans() -> None:
    assert oldest_label({"weight_version": "7"}) == 7
    spans = [{"version": "5", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 4}]
    assert oldest_label({"weight_version": "7", "weight_versions": spans}) == 5
    assert oldest_label({"weight_version": "default"}) is None


async def test_the_rollout_recycles_an_aborted_group_and_counts_the_tokens() -> None:
    registry = CollectorRegistry()
    rollout = _Rollout(config(), Digits(), MemoryBus(), registry, None)
    samples = [
        Sample(index=0, weight_versions=["5"], response_length=3, tokens=[1, 2, 3, 4], status=SampleStatus.COMPLETED),
        Sample(index=1, weight_versions=["5"], response_length=1, tokens=[1, 2], status=SampleStatus.ABORTED),
    ]
    group = Group(prompt_index=4, samples=samples, metadata={"prompt": "12."})
    rollout._aborted_early(group)
    assert (rollout.early_aborts, rollout.tokens_saved) == (1, 2)  # max_new_tokens 3, 1 generated
    recycled = rollout.retry.get_nowait()
    assert recycled is group and recycled.metadata["prompt"] == "12."
    assert all(s.response_length == 0 and s.status == SampleStatus.PENDING for s in recycled.samples)
    stats = rollout.buffer.window.finish([])
    assert stats.tokens_not_trained == {"aborted": 4} and stats.early_aborts == 1 and stats.tokens_saved == 2
    value = registry.get_sample_value
    assert value("weightbus_early_aborts_total", {"policy": "p"}) == 1
    assert value("weightbus_tokens_saved_total", {"policy": "p"}) == 2


async def test_an_early_abort_frees_its_admission_slot_and_the_drain_count_stays_in_step(caplog) -> None:
    from weightbus.rl.batches import BatchRequest

    rollout = _Rollout(config(), Digits(), MemoryBus(), CollectorRegistry(), None)
    fresh = Group(
        prompt_index=1,
        samples=[
            Sample(index=10 + i, weight_versions=["5"], response_length=3, status=SampleStatus.COMPLETED)
            for i in range(2)
        ],
    )
    slot = await rollout.admission.acquire()
    rollout.accepted.accept(slot, fresh)  # as produce() does
    await rollout.buffer.put(fresh)
    aborted = Group(
        prompt_index=2,
        samples=[Sample(index=20, weight_versions=["4"], response_length=1, status=SampleStatus.ABORTED)],
        metadata={"prompt": "12."},
    )
    slot = await rollout.admission.acquire()
    slot.release("aborted")  # as produce() does for a flight it aborted
    rollout._aborted_early(aborted)
    reply = await rollout.handle(5, BatchRequest(size=1))  # type: ignore[arg-type]  # an int is a version source
    assert (reply.kept, reply.recycled) == (1, 1)
    # The reply names this rollout process (its counts start with it); another start is another name.
    assert reply.rollout_id.startswith("rollout:")
    assert reply.rollout_id != _Rollout(config(), Digits(), MemoryBus(), CollectorRegistry(), None).rollout_id
    assert rollout.admission.ready == 0 and rollout.admission.running == 0
    assert "out of step" not in caplog.text
