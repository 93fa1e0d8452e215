"""A stand-in for the miles side of the fully-async rollout, written from ``shared/reference/miles-fully-async.md``.

No miles code: miles' class, method and field names and its call order, so that a weightbus buffer
loaded with ``--custom-async-data-buffer-path`` is driven the way miles drives it:

* ``FullyAsyncRolloutFn`` builds the buffer from ``args.custom_async_data_buffer_path`` with a
  ``DataBufferConstructorInput(args, unused_handler_fn)`` (``_recycle`` under
  ``--async-unused-samples-handler retry``, a drop otherwise);
* its worker starts on the first train call and runs miles' loop (main@31f1ca9,
  ``FullyAsyncRolloutFn._worker_loop``): while fewer than ``max_in_flight`` groups are pending it
  submits ``data_source.get_samples(1)`` → ``generate_and_rm_group``; it waits for the first to finish
  and awaits ``DataBuffer.put(DataBufferInput(prompt_group, group))`` for each finished one in the loop
  itself, so a blocked ``put`` stops further submissions;
* with ``args.custom_generate_function_path`` set, ``generate_and_rm_group`` is miles': one task per
  sample, each calling ``GenerateState.generate_function`` (loaded with ``load_generate_function``) with a
  ``GenerateFnInput(state, sample, sampling_params, evaluation)`` under the ``generate_fn_semaphore``
  (``sglang_server_concurrency`` permits), skipping samples already completed, siblings cancelled when
  one raises;
* each train call drains: ``rollout_batch_size`` × ``DataBuffer.get(current_version=input.weight_version)``,
  each group checked for ``n_samples_per_prompt`` samples, sorted by the first sample's ``index``,
  then ``DataBuffer.get_metrics()`` once → ``RolloutFnTrainOutput(samples, metrics)``;
* a dead worker fails the next train call at once, even with groups buffered.

``install_miles_helpers`` registers the miles helpers weightbus imports: to load a dynamic filter
(``miles.utils.misc.load_function``, ``miles.rollout.filter_hub.base_types``) and a generate function
(``miles.rollout.inference_rollout.compatibility.load_generate_function``), and miles' default generate
function (``miles.rollout.generate_hub.single_turn.generate``: here, it completes the sample as is).
Kept small and reusable: the trainer half (``RolloutManager.set_weight_version``, the updaters) is
for a later stand-in to add.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
from argparse import Namespace
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "DataBufferConstructorInput",
    "DataBufferInput",
    "DynamicFilterOutput",
    "FullyAsyncRolloutFn",
    "GenerateFnInput",
    "GenerateFnOutput",
    "GenerateState",
    "RolloutFnTrainInput",
    "RolloutFnTrainOutput",
    "Sample",
    "ScriptedDataSource",
    "install_miles_helpers",
    "load_function",
    "make_args",
    "make_group",
]


@dataclass
class Sample:
    """``miles.utils.types.Sample``: the fields the data buffer reads, and ``reset_for_retry``."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    weight_versions: list[str] = field(default_factory=list)
    status: Status = Status.PENDING
    response: str = ""
    reward: float | None = None

    def update_from_meta_info(self, meta_info: dict[str, Any]) -> None:
        """One generate call's answer: its ``weight_version`` is appended (one label per call or turn)."""
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])

    def reset_for_retry(self) -> None:
        """Back to a fresh prompt: no response, no versions, pending."""
        self.response = ""
        self.reward = None
        self.weight_versions = []
        self.status = Sample.Status.PENDING


@dataclass(frozen=True)
class DataBufferConstructorInput:
    args: Namespace
    unused_handler_fn: Callable[[list[Sample]], None]


@dataclass
class DataBufferInput:
    prompt_group: list[Sample]
    group: list[Any]  # list[Sample] or, multi-agent, list[list[Sample]]


@dataclass(frozen=True)
class RolloutFnTrainInput:
    rollout_id: int
    weight_version: int | None = None


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Any]]
    metrics: dict[str, float]


class GenerateState:
    """``GenerateState``: the arguments, the generate function and the semaphore its calls run under."""

    def __init__(self, args: Namespace) -> None:
        self.args = args
        self.generate_fn_semaphore = asyncio.Semaphore(getattr(args, "sglang_server_concurrency", 64))
        path = getattr(args, "custom_generate_function_path", None)
        self.generate_function = load_function(path) if path else single_turn_generate


@dataclass(frozen=True)
class GenerateFnInput:
    state: GenerateState
    sample: Sample
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Namespace:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    samples: Sample | list[Sample]


async def single_turn_generate(input: GenerateFnInput) -> GenerateFnOutput:
    """miles' default generate function, standing in: the sample completes as it is."""
    await asyncio.sleep(0)
    input.sample.status = Sample.Status.COMPLETED
    return GenerateFnOutput(samples=input.sample)


async def generate_and_rm_group(state: GenerateState, group: list[Sample]) -> list[Sample]:
    """miles' ``generate_and_rm_group``: one task per sample under the semaphore; siblings cancelled on an error."""

    async def one(sample: Sample) -> Sample:
        if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
            return sample
        async with state.generate_fn_semaphore:
            out = await state.generate_function(GenerateFnInput(state, sample, {}, False))
        return out.samples  # type: ignore[return-value]

    tasks = [asyncio.create_task(one(sample)) for sample in group]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclass(frozen=True)
class DynamicFilterOutput:
    """``miles.rollout.filter_hub.base_types.DynamicFilterOutput``."""

    keep: bool
    reason: str | None = None


def call_dynamic_filter(fn: Callable[..., Any], args: Namespace, group: list[Any]) -> DynamicFilterOutput:
    """miles' wrapper: a filter may return a bool or a ``DynamicFilterOutput``."""
    out = fn(args, group)
    return out if isinstance(out, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(out))


def load_function(path: str) -> Any:
    """``miles.utils.misc.load_function``: ``"package.module.name"`` → the object."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@contextmanager
def install_miles_helpers() -> Iterator[None]:
    """Make ``miles.utils.misc`` and ``miles.rollout.filter_hub.base_types`` importable (this module's stand-ins)."""
    names = ["miles", "miles.utils", "miles.utils.misc", "miles.rollout", "miles.rollout.filter_hub"]
    names.append("miles.rollout.filter_hub.base_types")
    names += ["miles.rollout.inference_rollout", "miles.rollout.inference_rollout.compatibility"]
    names += ["miles.rollout.generate_hub", "miles.rollout.generate_hub.single_turn"]
    saved = {n: sys.modules.get(n) for n in names}
    modules = {n: types.ModuleType(n) for n in names}
    modules["miles.utils.misc"].load_function = load_function  # type: ignore[attr-defined]
    modules["miles.rollout.inference_rollout.compatibility"].load_generate_function = load_function  # type: ignore[attr-defined]
    modules["miles.rollout.generate_hub.single_turn"].generate = single_turn_generate  # type: ignore[attr-defined]
    base_types = modules["miles.rollout.filter_hub.base_types"]
    base_types.call_dynamic_filter = call_dynamic_filter  # type: ignore[attr-defined]
    base_types.DynamicFilterOutput = DynamicFilterOutput  # type: ignore[attr-defined]
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def make_args(**overrides: Any) -> Namespace:
    """miles' arguments the fully-async path reads, with its test defaults (``make_args`` in miles' tests)."""
    base: dict[str, Any] = dict(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        async_data_buffer_capacity_factor=2.0,
        async_unused_samples_handler="drop",
        max_weight_staleness=None,
        dynamic_sampling_filter_path=None,
        custom_async_data_buffer_path="weightbus.integrations.miles.WeightbusDataBuffer",
    )
    base.update(overrides)
    return Namespace(**base)


def make_group(
    group_index: int, labels: list[str], *, status: Sample.Status = Sample.Status.COMPLETED, n: int = 2
) -> list[Sample]:
    """``n`` samples with ``index = group_index * 10 + i``, each labelled ``labels`` (miles' tests' ``make_group``)."""
    return [
        Sample(group_index=group_index, index=group_index * 10 + i, weight_versions=list(labels), status=status)
        for i in range(n)
    ]


class ScriptedDataSource:
    """The data source: recycled prompt groups first, then the scripted ones, then ``fresh(i)`` forever.

    ``fresh`` None: nothing more after the script (``get_samples`` returns nothing).
    """

    def __init__(self, scripted: list[list[Sample]], fresh: Callable[[int], list[Sample]] | None = None) -> None:
        self._scripted = deque(scripted)
        self._fresh = fresh
        self._next = 1001
        self.recycled: list[list[Sample]] = []
        self.served: list[list[Sample]] = []
        self._retry: deque[list[Sample]] = deque()

    def get_samples(self, n: int) -> list[list[Sample]]:
        out: list[list[Sample]] = []
        while len(out) < n:
            if self._retry:
                out.append(self._retry.popleft())
            elif self._scripted:
                out.append(self._scripted.popleft())
            elif self._fresh is not None:
                out.append(self._fresh(self._next))
                self._next += 1
            else:
                break
        self.served.extend(out)
        return out

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.recycled.extend(groups)
        self._retry.extend(groups)


async def echo_generate(args: Namespace, prompt_group: list[Sample]) -> list[Sample]:
    """The fake ``generate_and_rm_group`` of miles' tests: the generated group is the prompt group."""
    await asyncio.sleep(0)
    return prompt_group


class FullyAsyncRolloutFn:
    """miles' ``FullyAsyncRolloutFn`` (train path): one worker feeding the buffer, one drain per train call.

    Args:
        args: miles' arguments (``make_args``).
        data_source: serves prompt groups (``get_samples``) and takes recycled ones (``add_samples``).
        generate_and_rm_group: ``(args, prompt_group) -> group``.
        max_in_flight: groups generated at once (miles: ``rollout_batch_size``).
    """

    def __init__(
        self,
        args: Namespace,
        data_source: ScriptedDataSource,
        generate_and_rm_group: Callable[[Namespace, list[Sample]], Awaitable[list[Any]]] = echo_generate,
        *,
        max_in_flight: int | None = None,
    ) -> None:
        self.args = args
        self.data_source = data_source
        self.generate_and_rm_group = generate_and_rm_group
        self.max_in_flight = max_in_flight or args.rollout_batch_size
        # miles' own generate_and_rm_group (per-sample generate function calls) when a generate function is set.
        self.state = GenerateState(args) if getattr(args, "custom_generate_function_path", None) else None
        self.dropped: list[list[Sample]] = []
        handler = self._recycle if args.async_unused_samples_handler == "retry" else self._drop
        cls = load_function(args.custom_async_data_buffer_path)
        self.buffer = cls(DataBufferConstructorInput(args=args, unused_handler_fn=handler))
        self._worker: asyncio.Task[None] | None = None
        self.weight_version: int | None = None

    def set_weight_version(self, version: int) -> None:
        """``RolloutManager.set_weight_version``: the number miles' actor passes after each push (its own
        counter, which a failover restarts at 1); the engines now serve weights labelled ``str(version)``."""
        self.weight_version = version

    async def train(self, rollout_id: int) -> RolloutFnTrainOutput:
        """miles' train loop step: drain against the version last passed to ``set_weight_version``."""
        return await self(RolloutFnTrainInput(rollout_id=rollout_id, weight_version=self.weight_version))

    async def engine_generate(self, args: Namespace, prompt_group: list[Sample]) -> list[Sample]:
        """Generation on engines that serve the last pushed weights: each sample is labelled with them."""
        await asyncio.sleep(0)
        for sample in prompt_group:
            sample.weight_versions = [str(self.weight_version)]
            sample.status = Sample.Status.COMPLETED
        return prompt_group

    def _recycle(self, prompt_group: list[Sample]) -> None:
        for sample in prompt_group:
            sample.reset_for_retry()
        self.data_source.add_samples([prompt_group])

    def _drop(self, prompt_group: list[Sample]) -> None:
        self.dropped.append(prompt_group)

    async def _generate(self, prompt_group: list[Sample]) -> DataBufferInput:
        if self.state is not None:
            group = await generate_and_rm_group(self.state, prompt_group)
        else:
            group = await self.generate_and_rm_group(self.args, prompt_group)
        return DataBufferInput(prompt_group=prompt_group, group=group)

    async def _run_worker(self) -> None:
        active: set[asyncio.Task[DataBufferInput]] = set()
        try:
            while True:
                while len(active) < self.max_in_flight:
                    got = self.data_source.get_samples(1)
                    if not got:
                        break
                    active.add(asyncio.create_task(self._generate(got[0])))
                if not active:
                    await asyncio.sleep(0.01)  # nothing to generate yet: ask the data source again
                    continue
                done, active = await asyncio.wait(active, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        for other in done:
                            if not other.cancelled():
                                other.exception()  # retrieved: one error ends the worker, the others go with it
                    await self.buffer.put(task.result())  # an error ends the worker (the next drain raises it)
        finally:
            for task in active:
                task.cancel()

    async def __call__(self, input: RolloutFnTrainInput) -> RolloutFnTrainOutput:
        """One train call: drain ``rollout_batch_size`` groups judged against ``input.weight_version``."""
        if self._worker is None:
            self._worker = asyncio.create_task(self._run_worker(), name="miles-standin-worker")
        groups: list[list[Any]] = []
        while len(groups) < self.args.rollout_batch_size:
            groups.append(await self._next_group(input.weight_version))
        for group in groups:
            assert len(group) == self.args.n_samples_per_prompt, group
        groups.sort(key=lambda g: _first(g).index)
        return RolloutFnTrainOutput(samples=groups, metrics=self.buffer.get_metrics())

    async def _next_group(self, current_version: int | None) -> list[Any]:
        worker = self._worker
        assert worker is not None
        if worker.done():
            worker.result()  # the worker's error, even with groups buffered
        get = asyncio.ensure_future(self.buffer.get(current_version=current_version))
        await asyncio.wait({get, worker}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            await asyncio.gather(get, return_exceptions=True)
            worker.result()
            raise RuntimeError("the worker stopped")
        return get.result().group

    async def aclose(self) -> None:
        """Stop the worker, then close the buffer (weightbus' buffer publishes its last reports)."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        close = getattr(self.buffer, "aclose", None)
        if close is not None:
            await close()


def _first(group: list[Any]) -> Sample:
    item = group[0]
    return item[0] if isinstance(item, list) else item
