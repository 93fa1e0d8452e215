"""Admission inside miles' fully-async worker (``--custom-generate-function-path
weightbus.integrations.miles.generate``), driven by miles' own loop and per-sample generate calls
(``miles_standin``) on a real nats-server.

The trainer steps and pushes while the worker keeps twice a batch of groups in flight; an "engine" labels
each sample with the version it holds when the sample starts, and aborts one group in nine. From what was
recorded (every sample start inside its slot, every batch trained, every group the data source served):

* at no sample start do running plus accepted groups exceed what the bound allows;
* no trained group exceeds the bound; with admission, a group is filtered as stale only when it was overtaken
  (a group admitted after it finished first and took its place in a batch it was admitted for: the budget counts
  groups, the drain takes them as they finish), while the same run without it (``WEIGHTBUS_ADMISSION=off``)
  throws groups away, so the check can fail;
* nothing is lost: every group served is trained, recycled, or still buffered or in flight.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from tests._builders import has_waiters, updated, wait_until
from tests.integrations.miles.miles_standin import (
    FullyAsyncRolloutFn,
    GenerateFnOutput,
    RolloutFnTrainInput,
    Sample,
    ScriptedDataSource,
    install_miles_helpers,
    make_args,
    make_group,
)
from weightbus.bus import NatsBus, subjects
from weightbus.integrations.miles import admission as miles_admission
from weightbus.integrations.miles.admission import MilesAdmission

pytestmark = pytest.mark.nats

BATCH, N, IN_FLIGHT_GROUPS = 4, 2, 8


class Engine:
    """The engines, as the generate function sees them: the version they hold, and what was seen at each start.

    ``source`` (set by the run) tells each start which attempt of its group it is: the times the group was
    handed back before.
    """

    def __init__(self) -> None:
        self.version = 1
        self.rng = random.Random(7)
        self.starts: list[dict[str, Any]] = []
        self.aborted: set[int] = set()
        self.source: ScriptedDataSource | None = None

    def attempt(self, group: int | None) -> int:
        recycled = self.source.recycled if self.source is not None else []
        return sum(1 for g in recycled if g[0].group_index == group)


ENGINE = Engine()


async def engine_generate(input: Any) -> GenerateFnOutput:
    """The wrapped generate function: records the budget at the start, labels the sample, sometimes aborts it."""
    sample = input.sample
    buffer = miles_admission.active_buffer()
    assert buffer is not None
    admission = await buffer.admission()
    gate = admission.gate if admission is not None else None
    ENGINE.starts.append(
        {
            "group": sample.group_index,
            "attempt": ENGINE.attempt(sample.group_index),
            "engine": ENGINE.version,
            "used": gate.used if gate is not None else None,
            "allowance": gate.allowance if gate is not None else None,
            "horizon": gate.version if gate is not None else None,  # read after allowance: the horizon slid
            "gate": id(gate),
        }
    )
    label = ENGINE.version
    await asyncio.sleep(ENGINE.rng.uniform(0.001, 0.01))
    sample.weight_versions.append(str(label))
    if sample.group_index % 9 == 4 and sample.group_index not in ENGINE.aborted:
        ENGINE.aborted.add(sample.group_index)
        sample.status = Sample.Status.ABORTED  # miles: the engine aborted it; the buffer hands it back
    else:
        sample.status = Sample.Status.COMPLETED
    return GenerateFnOutput(samples=sample)


async def announce(bus: NatsBus, policy: str, version: int) -> None:
    event = updated(version, policy=policy, trainer="trainer")
    await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:1:{version}")


@pytest.fixture
def miles_env(nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_GENERATE_FUNCTION", f"{__name__}.engine_generate")
    global ENGINE
    ENGINE = Engine()
    return policy


def _args(bound: int, **overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        rollout_batch_size=BATCH,
        n_samples_per_prompt=N,
        max_weight_staleness=bound,
        async_unused_samples_handler="retry",
        async_max_concurrent_samples=IN_FLIGHT_GROUPS * N,
        custom_generate_function_path="weightbus.integrations.miles.generate",
        sglang_server_concurrency=IN_FLIGHT_GROUPS * N,  # one permit per sample in flight: just enough
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
    )
    return make_args(**(settings | overrides))


async def _train(nats_bus: NatsBus, policy: str, bound: int, steps: int) -> tuple[Any, list[tuple[int, list[Any]]]]:
    await announce(nats_bus, policy, 1)
    source = ScriptedDataSource([], fresh=lambda i: make_group(i, [], status=Sample.Status.PENDING, n=N))
    ENGINE.source = source
    trained: list[tuple[int, list[Any]]] = []
    with install_miles_helpers():
        fn = FullyAsyncRolloutFn(_args(bound), source, max_in_flight=IN_FLIGHT_GROUPS)
        try:
            for step in range(steps):
                version = step + 1
                out = await fn(RolloutFnTrainInput(rollout_id=step, weight_version=version))
                trained += [(version, group) for group in out.samples]
                fn.metrics = getattr(fn, "metrics", []) + [out.metrics]
                ENGINE.version = version + 1  # the push, then the announcement
                await asyncio.sleep(0.005)
                await announce(nats_bus, policy, version + 1)
                # A real step outlasts propagation by far (seconds against milliseconds). Under load the next
                # drain could come before the buffer's tracker has the announcement: groups admitted against the
                # old version would then be judged stale, which is right, but not what this test measures.
                buffer = miles_admission.active_buffer()
                tracker = getattr(buffer, "tracker", None)  # the WeightbusDataBuffer miles built
                if tracker is not None:
                    await wait_until(lambda t=tracker, v=version + 1: t.current == v, 5, "the tracker to see the push")
            return fn, trained
        finally:
            await fn.aclose()


def overtaken(fn: Any, trained: list[tuple[int, list[Any]]], bound: int) -> list[tuple[int, int]]:
    """The attempts ``(group, attempt)`` handed back for a retry that were not aborted, each checked overtaken.

    A group admitted at horizon ``h`` (labelled ``h`` or later: the push comes before the announcement) is fresh
    for the batches judged at ``h … h + bound``, and the gate admitted it only while those batches had room for
    every group admitted before it too. So if it was not trained in them, a group admitted after it was: asserted
    for each, from the starts (in admission order) and the batches trained.
    """
    firsts: dict[tuple[int, int], tuple[int, dict[str, Any]]] = {}
    for seq, start in enumerate(ENGINE.starts):
        firsts.setdefault((start["group"], start["attempt"]), (seq, start))
    recycled = [g[0].group_index for g in fn.data_source.recycled]
    # A group's first attempt is the one the engine aborts (one in nine); every other hand-back is a stale one.
    handed_back = [(g, a) for g in set(recycled) for a in range(recycled.count(g)) if a > 0 or g not in ENGINE.aborted]
    for group, attempt in handed_back:
        seq, start = firsts[(group, attempt)]
        assert start["engine"] >= start["horizon"], start  # never labelled older than the horizon it was admitted in
        took_its_place = [
            (version, g[0].group_index)
            for version, g in trained
            if version <= start["horizon"] + bound
            and firsts[(g[0].group_index, recycled.count(g[0].group_index))][0] > seq
        ]
        assert took_its_place, (group, attempt, start)
    return handed_back


@pytest.mark.parametrize("bound", [0, 1])
async def test_admission_keeps_miles_within_the_budget_and_wastes_only_overtaken_groups(
    nats_bus: NatsBus, miles_env: str, bound: int
) -> None:
    fn, trained = await _train(nats_bus, miles_env, bound, steps=12)
    starts = [s for s in ENGINE.starts if s["used"] is not None]
    assert len(starts) == len(ENGINE.starts) > 0
    assert len({s["gate"] for s in starts}) == 1  # the first groups' samples all ask at once: one gate
    over = [s for s in starts if s["used"] > s["allowance"]]
    assert over == [], over[:3]
    for version, group in trained:
        oldest = min(int(label) for sample in group for label in sample.weight_versions)
        assert version - oldest <= bound, (version, group)
    stale = sum(m.get("rollout/fully_async/stale_groups_filtered", 0) for m in fn.metrics)
    assert stale == len(overtaken(fn, trained, bound)), fn.metrics  # no group stale but one overtaken
    # Paced groups carry their start: the drain splits staleness into time in flight and in queue.
    split = ("weightbus/staleness/in_flight_seconds", "weightbus/staleness/in_flight_versions")
    assert all(key in m for m in fn.metrics for key in split), fn.metrics[-1]
    aborted = sum(m.get("rollout/fully_async/aborted_groups_filtered", 0) for m in fn.metrics)
    assert 0 < aborted <= len(ENGINE.aborted)  # their slots came back, or the run would have stalled
    # Nothing lost: each group served was trained, handed back for a retry, or is still buffered or in flight.
    served = {g[0].group_index for g in fn.data_source.served}
    accounted = {g[0].group_index for _, g in trained} | {g[0].group_index for g in fn.data_source.recycled}
    accounted |= {entry.group[0].group_index for entry in fn.buffer.buffered()}
    assert accounted <= served
    in_flight = served - accounted
    assert len(in_flight) <= IN_FLIGHT_GROUPS  # the worker's groups still generating or waiting at the end
    recycled = {g[0].group_index for g in fn.data_source.recycled}
    assert ENGINE.aborted <= recycled | in_flight  # handed back for a retry (or still on its way to put)


async def test_without_admission_the_same_run_throws_groups_away(
    nats_bus: NatsBus, miles_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTBUS_ADMISSION", "off")
    fn, trained = await _train(nats_bus, miles_env, 0, steps=12)
    assert all(s["used"] is None for s in ENGINE.starts)  # no gate at all
    assert all(version - min(int(x) for s in g for x in s.weight_versions) <= 0 for version, g in trained)
    assert sum(m.get("rollout/fully_async/stale_groups_filtered", 0) for m in fn.metrics) > 0


async def test_a_semaphore_smaller_than_the_samples_in_flight_is_refused(nats_bus: NatsBus, miles_env: str) -> None:
    await announce(nats_bus, miles_env, 1)
    source = ScriptedDataSource([], fresh=lambda i: make_group(i, [], status=Sample.Status.PENDING, n=N))
    with install_miles_helpers():
        fn = FullyAsyncRolloutFn(_args(1, sglang_server_concurrency=4), source, max_in_flight=IN_FLIGHT_GROUPS)
        try:
            with pytest.raises(ValueError, match="generate_fn_semaphore"):
                await fn(RolloutFnTrainInput(rollout_id=0, weight_version=1))
        finally:
            await fn.aclose()


async def test_without_the_buffer_the_generate_function_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightbus.integrations.miles import generate

    monkeypatch.setattr(miles_admission, "_active", None)
    with pytest.raises(RuntimeError, match="custom-async-data-buffer-path"):
        await generate(object())


async def test_a_group_shares_one_slot_and_a_failed_generation_returns_it() -> None:
    from weightbus.consumers.admission import Admission

    admission = MilesAdmission(Admission("bounded", current=3, max_staleness=0, batch=2))
    gate = admission.gate
    entered = asyncio.Event()

    async def sibling() -> None:
        async with admission.generating(7):
            entered.set()
            await asyncio.sleep(0.01)

    await asyncio.gather(sibling(), sibling())
    assert gate.running == 1  # two samples, one group, one slot
    slot, started = admission.finished(7)
    assert slot is not None and slot.open and started is not None
    slot.accept()
    assert (gate.running, gate.ready) == (0, 1)
    with pytest.raises(OSError):
        async with admission.generating(8):
            raise OSError("the engine went away")
    assert gate.running == 0 and gate.counts["aborted"] == 1
    assert admission.finished(8) == (None, None)  # nothing left to accept for the failed group
    async with admission.generating(8) as retry:  # miles retries the group: it waits for a slot of its own
        assert retry.open and gate.running == 1
    retried, _ = admission.finished(8)
    assert retried is retry and retried.open


async def test_a_shared_budget_is_kept_on_the_bus_and_returned_at_close(
    nats_bus: NatsBus, miles_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightbus.bus.history import read_subject_history
    from weightbus.schemas import AdmissionLedger

    monkeypatch.setenv("WEIGHTBUS_ADMISSION_SHARED", "1")
    fn, trained = await _train(nats_bus, miles_env, 1, steps=3)
    assert len(trained) == 3 * BATCH
    history = await read_subject_history(nats_bus, subjects.admission(miles_env))
    ledgers = [env.event for env in history.events if isinstance(env.event, AdmissionLedger)]
    mine = [ledger for ledger in ledgers if ledger.writer.startswith(fn.buffer.consumer)]
    assert mine and any(ledger.holders for ledger in mine)  # slots were held through the bus
    assert all(sum(h.slots for h in ledger.holders.values()) <= ledger.total for ledger in ledgers)
    assert len({ledger.writer for ledger in mine}) == 1  # one budget for the process, not one per first sample
    assert not any(holder.startswith(fn.buffer.consumer) for holder in ledgers[-1].holders)  # given back


async def test_a_put_cancelled_while_the_buffer_is_full_returns_its_slot(nats_bus: NatsBus, miles_env: str) -> None:
    from tests.integrations.miles.miles_standin import DataBufferConstructorInput, DataBufferInput
    from weightbus.integrations.miles import WeightbusDataBuffer

    await announce(nats_bus, miles_env, 1)
    args = _args(1, async_data_buffer_capacity_factor=0.25)  # room for one group
    buffer = WeightbusDataBuffer(DataBufferConstructorInput(args=args, unused_handler_fn=lambda group: None))
    try:
        admission = await buffer.admission()
        assert admission is not None
        first, second = make_group(1, ["1"], n=N), make_group(2, ["1"], n=N)
        for group in (first, second):
            async with admission.generating(group[0].group_index):
                pass
        await buffer.put(DataBufferInput(prompt_group=first, group=first))
        assert (admission.gate.running, admission.gate.ready) == (1, 1)
        blocked = asyncio.create_task(buffer.put(DataBufferInput(prompt_group=second, group=second)))
        await wait_until(lambda: buffer._cond is not None and has_waiters(buffer._cond), 5, "the put to wait for room")
        assert not blocked.done()  # the buffer is full
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert admission.gate.running == 0 and admission.gate.counts["aborted"] == 1  # not held for ever
    finally:
        await buffer.aclose()


@pytest.mark.parametrize("shared", [False, True])
async def test_admission_inside_miles_survives_a_nats_restart(
    tmp_path: Any, policy: str, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    # The server is this test's own: killed mid-run and restarted on its store. Meanwhile the tracker cannot
    # say what is current, so the gate falls back to the version miles passed (a lower bound), and the shared
    # budget cannot renew its lease: training may slow, but must go on, and stay within the bound.
    from weightbus.bus import connect
    from weightbus.embedded.server import EmbeddedNats
    from weightbus.errors import BusError

    server = EmbeddedNats(store_dir=tmp_path / "store").start()
    monkeypatch.setenv("WEIGHTBUS_NATS", server.url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    monkeypatch.setenv("WEIGHTBUS_GENERATE_FUNCTION", f"{__name__}.engine_generate")
    if shared:
        monkeypatch.setenv("WEIGHTBUS_ADMISSION_SHARED", "1")
    global ENGINE
    ENGINE = Engine()
    bus = await connect(server.url, publish_timeout=1.0, publish_attempts=2)
    bound, steps, restart_after = 1, 10, 4
    source = ScriptedDataSource([], fresh=lambda i: make_group(i, [], status=Sample.Status.PENDING, n=N))
    trained: list[tuple[int, list[Any]]] = []

    async def announce_until_stored(version: int) -> None:
        for _ in range(100):
            try:
                await announce(bus, policy, version)
                return
            except BusError:
                await asyncio.sleep(0.1)
        raise AssertionError(f"v{version} was never stored")

    try:
        await announce_until_stored(1)
        with install_miles_helpers():
            fn = FullyAsyncRolloutFn(_args(bound), source, max_in_flight=IN_FLIGHT_GROUPS)
            try:
                for step in range(steps):
                    version = step + 1
                    out = await asyncio.wait_for(fn(RolloutFnTrainInput(rollout_id=step, weight_version=version)), 60)
                    trained += [(version, group) for group in out.samples]
                    ENGINE.version = version + 1
                    if step == restart_after:
                        server.kill()
                        await asyncio.sleep(1.0)  # the outage: down a while, as a restart is
                        await asyncio.to_thread(server.start)
                    await announce_until_stored(version + 1)
            finally:
                await fn.aclose()
    finally:
        await bus.aclose()
        server.stop()
    assert len(trained) == steps * BATCH  # training went on through the restart
    for version, group in trained:
        oldest = min(int(label) for sample in group for label in sample.weight_versions)
        assert version - oldest <= bound, (version, group)
    starts = [s for s in ENGINE.starts if s["used"] is not None]
    assert starts and [s for s in starts if s["used"] > s["allowance"]] == []
    served = {g[0].group_index for g in fn.data_source.served}
    accounted = {g[0].group_index for _, g in trained} | {g[0].group_index for g in fn.data_source.recycled}
    accounted |= {entry.group[0].group_index for entry in fn.buffer.buffered()}
    assert accounted <= served and len(served - accounted) <= IN_FLIGHT_GROUPS
