"""A stand-in for miles' trainer side, written from ``shared/reference/miles-fully-async.md`` §11 (miles main@31f1ca9).

No miles code: miles' module paths, class and method names, signatures and call order, so that
``weightbus.integrations.miles.install`` finds what it patches where miles has it and is driven the
way miles drives it:

* **Ray-like handles.** ``ActorHandle`` wraps an object; ``handle.method.remote(...)`` runs the call on
  the actor's own thread (one call at a time, as a Ray actor) and returns an ``ObjectRef``;
  ``ray.get`` waits and raises ``RayTaskError`` for a failed call.
* **Engines.** ``SGLangEngine`` is miles' engine actor: each method is one HTTP call to a reference
  engine (``weightbus.refengine``, served over real HTTP), with miles' payloads; the fork-only routes
  (``begin/end_weight_update``, ``pull_weights``, ``load_lora_adapter_from_{distributed,tensors}``)
  are recorded here or mapped onto the reference engine's path load. A handle of a node other than
  0 answers None, as miles' does.
* **Ranks.** ``World`` runs one cell's ranks as threads in this process; the stand-in
  ``torch.distributed`` (``dist``) answers ``get_rank`` per thread and implements ``barrier`` and
  ``broadcast_object_list`` over the world.
* **The updaters**, under their miles module paths (``install_miles_trainer``):
  ``DistBucketedWeightUpdateMixin`` with ``UpdateWeightFromDistributed`` (NCCL broadcast; buckets
  carry ``weight_version``) and ``UpdateWeightP2P`` (no label on the push), single- and multi-LoRA
  (``--multi-lora``: each adapter is loaded under its controller slot's engine name,
  ``miles.utils.multi_lora.slot_lora_name``: ``__miles_slot_<n>``);
  ``UpdateWeightFromDiskDelta`` (baseline first, then per update: the delta files written under
  ``--update-weight-disk-dir`` by every publishing rank, then ``pull_weights`` on every engine, then the
  pause and the reload; the engines' host-local checkpoints apply the chain checksum-verified, and
  ``replay_chain`` is a host that replays it from the base); the colocated ``UpdateWeightFromTensor``
  (base buckets labelled, LoRA not); each with ``weight_version = 0`` at construction and ``+= 1`` per update.
* **The actor and the group.** ``MegatronTrainRayActor.init`` sets the cell's indep-DP group (miles'
  ``ParallelState.indep_dp``: its alive rank, and the quorum id in ``debug_info``), calls
  ``args.custom_megatron_init_path``, then builds its updater; ``reconfigure_indep_dp`` replaces that
  group and marks the engine connection stale; ``update_weights(info)`` connects engines when needed,
  runs the updater, then rank 0 calls ``rollout_manager.set_weight_version.remote(updater.weight_version)``;
  with ``--ci-test`` (not LoRA) every rank then compares the engines' ``get_weight_version`` with its
  updater's counter and raises ``Weight version mismatch!`` (miles compares one engine at random).
  ``Cell`` is miles' ``RayTrainCell`` (alive, errored, stopped, pending; a failed ``execute`` stops the
  cell; a healed cell gets new actors, with a training run of their own). ``RayTrainGroup`` is miles'
  group: ``update_weights`` runs ``_execute_first_alive`` (the lowest-index alive cell) under miles'
  ``retry`` (30 attempts, then "No alive cells, therefore cannot heal anymore"); ``train`` first
  refreshes the cells (quorum id + 1, heal pending cells, reconfigure alive ones with their new
  ``IndepDPInfo``). ``ray.get_runtime_context().get_job_id()`` answers the cell's driver job.
  ``RolloutManager.set_weight_version`` warns on a regression under ``--indep-dp`` and asserts
  otherwise, and records every version it was given.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
import threading
import types
import uuid
from argparse import Namespace
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.integrations.ray_standin import ActorHandle, get, put

__all__ = [
    "ActorHandle",
    "AdapterRun",
    "ChecksumMismatch",
    "LocalCheckpoint",
    "EnginesAndLock",
    "FakeModel",
    "IndepDPInfo",
    "MegatronTrainRayActor",
    "RayActorError",
    "RayTrainGroup",
    "RolloutManager",
    "SGLangEngine",
    "World",
    "dist",
    "get_parallel_state",
    "install_miles_trainer",
    "make_trainer_args",
    "chain_files",
    "ray",
    "replay_chain",
    "slot_lora_name",
]

log = logging.getLogger("tests.miles_trainer_standin")

LORA_ADAPTER_NAME = "miles_lora"

# -- ray (the handles and refs: tests.integrations.ray_standin) ----------------------------------------------


class _RuntimeContext:
    """``ray.get_runtime_context()``: the job of the driver that made the actor (one per driver run)."""

    def get_job_id(self) -> str:
        world = _world()
        return world.job_id if world is not None else DEFAULT_JOB_ID


#: The Ray job id every stand-in actor belongs to unless its ``World`` says otherwise (another driver).
DEFAULT_JOB_ID = "01000000"

ray = types.ModuleType("ray")
ray.get = get  # type: ignore[attr-defined]
ray.put = put  # type: ignore[attr-defined]
ray.get_runtime_context = _RuntimeContext  # type: ignore[attr-defined]


# -- torch.distributed, one world of thread ranks per cell -------------------------------------------------

_local = threading.local()


class World:
    """One cell's ranks as threads of this process (``dist`` answers per thread)."""

    def __init__(self, size: int, *, job_id: str | None = None) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=20)
        self._slot: list[Any] = []
        self._gathered: list[Any] = [None] * size
        self.broadcasts = 0
        self.job_id = job_id or DEFAULT_JOB_ID
        # miles' process-global ParallelState (``set_parallel_state`` in init and at each reconfigure):
        # one per cell here, as each cell's ranks are processes of their own in miles.
        self.parallel_state: ParallelState | None = None

    @contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        saved = getattr(_local, "world", None), getattr(_local, "rank", None)
        _local.world, _local.rank = self, rank
        try:
            yield
        finally:
            _local.world, _local.rank = saved

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on every rank at once; the results by rank; the first failure (by rank) is raised."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def one(rank: int) -> None:
            with self.as_rank(rank):
                try:
                    results[rank] = fn(rank)
                except BaseException as exc:
                    errors[rank] = exc
                    self._barrier.abort()  # the others fail instead of waiting for this rank

        threads = [threading.Thread(target=one, args=(r,), name=f"rank-{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self._barrier.reset()
        for exc in errors:
            if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
                raise exc
        for exc in errors:
            if exc is not None:
                raise exc
        return results

    def barrier(self) -> None:
        self._barrier.wait()

    def all_gather(self, value: Any, rank: int) -> list[Any]:
        self._barrier.wait()
        self._gathered[rank] = value
        self._barrier.wait()
        out = list(self._gathered)
        self._barrier.wait()
        return out

    def broadcast(self, box: list[Any], src: int, rank: int) -> None:
        if rank == src:
            self._slot = list(box)
            self.broadcasts += 1
        self._barrier.wait()
        if rank != src:
            box[:] = self._slot
        self._barrier.wait()


def _world() -> World | None:
    return getattr(_local, "world", None)


def _get_rank() -> int:
    return getattr(_local, "rank", 0) or 0


def _barrier(group: Any = None) -> None:
    world = _world()
    if world is not None and world.size > 1:
        world.barrier()


def _broadcast_object_list(object_list: list[Any], src: int = 0, group: Any = None) -> None:
    world = _world()
    if world is not None and world.size > 1:
        world.broadcast(object_list, src, _get_rank())


def _all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    world = _world()
    if world is not None and world.size > 1:
        object_list[:] = world.all_gather(obj, _get_rank())
    else:
        object_list[:] = [obj]


dist = types.ModuleType("torch.distributed")
dist.get_rank = _get_rank  # type: ignore[attr-defined]
dist.get_world_size = lambda: _world().size if _world() else 1  # type: ignore[attr-defined, union-attr]
dist.is_initialized = lambda: True  # type: ignore[attr-defined]
dist.barrier = _barrier  # type: ignore[attr-defined]
dist.broadcast_object_list = _broadcast_object_list  # type: ignore[attr-defined]
dist.all_gather_object = _all_gather_object  # type: ignore[attr-defined]


def get_gloo_group() -> str:
    """``miles.utils.distributed_utils.get_gloo_group``."""
    return "gloo"


# -- independent DP: the cell's place in its group ----------------------------------------------------------


@dataclass(frozen=True)
class IndepDPInfo:
    """``miles/utils/ft_utils/indep_dp.py``: what the group tells a cell at init and at each reconfigure."""

    cell_index: int
    num_cells: int
    alive_rank: int
    alive_size: int
    quorum_id: int
    alive_cell_indices: list[int]

    def __post_init__(self) -> None:
        assert self.alive_rank == self.alive_cell_indices.index(self.cell_index)
        assert self.alive_size == len(self.alive_cell_indices)


@dataclass
class GroupInfo:
    """``miles/utils/ft_utils/process_group_utils.py`` ``GroupInfo`` (the fields the stand-in needs)."""

    rank: int
    size: int
    group: Any = None
    debug_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParallelState:
    """``miles/backends/training_utils/parallel.py`` ``ParallelState`` (its ``indep_dp`` group only)."""

    indep_dp: GroupInfo


def create_indep_dp_group(info: IndepDPInfo) -> GroupInfo:
    """``miles/backends/megatron_utils/ft/indep_dp.py`` ``create_indep_dp_group``: rank, size and the quorum."""
    if info.alive_size <= 1:
        return GroupInfo(rank=0, size=1, debug_info={"quorum": info.quorum_id})
    return GroupInfo(rank=info.alive_rank, size=info.alive_size, group="torchft", debug_info={"quorum": info.quorum_id})


def get_parallel_state() -> ParallelState:
    """``miles.backends.training_utils.parallel.get_parallel_state`` (per cell here; see ``World``)."""
    world = _world()
    state = world.parallel_state if world is not None else None
    assert state is not None, "ParallelState not initialized. Call set_parallel_state() first."
    return state


# -- the engine actor ---------------------------------------------------------------------------------------


class SGLangEngine:
    """miles' engine actor (``miles/backends/sglang_utils/sglang_engine.py``) in front of one reference engine.

    Attributes:
        calls: every method called, in order, with its keyword arguments.
        pulls: the ``target_version`` of every ``pull_weights`` (the disk-delta file chain).
        local: the host-local checkpoint ``pull_weights`` brings to a version of the chain (checksum-verified)
            and ``update_weights_from_disk`` reloads.
    """

    def __init__(self, url: str, *, node_rank: int = 0, delta_dir: str | Path | None = None) -> None:
        self.url = url
        self.node_rank = node_rank
        self._http = httpx.Client(base_url=url, timeout=10.0)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.pulls: list[int] = []
        self.delta_dir = delta_dir  # the engine's --update-weight-disk-dir (the shared filesystem)
        self.local = LocalCheckpoint()  # the host-local checkpoint pull_weights patches
        self.sessions = 0  # begin_weight_update without its end_weight_update
        self.on_continue: Callable[[], None] | None = None  # runs before the engine resumes (assertions)

    def close(self) -> None:
        self._http.close()

    def _record(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))

    def _make_request(self, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        if self.node_rank != 0:
            return None
        response = self._http.post(f"/{endpoint}", json=payload or {})
        if response.status_code >= 400:
            raise RuntimeError(f"{endpoint} failed with {response.status_code}: {response.text}")
        return response.json()

    def get_weight_version(self) -> str | None:
        self._record("get_weight_version")
        if self.node_rank != 0:
            return None
        response = self._http.get("/model_info")
        response.raise_for_status()
        return response.json()["weight_version"]

    def update_weight_version(self, weight_version: str) -> Any:
        self._record("update_weight_version", weight_version=weight_version)
        return self._make_request("update_weight_version", {"new_version": weight_version, "abort_all_requests": False})

    def pause_generation(self, mode: str = "retract") -> Any:
        self._record("pause_generation", mode=mode)
        response = self._http.post("/pause_generation", json={"mode": mode})
        response.raise_for_status()
        return response.status_code

    def continue_generation(self) -> Any:
        self._record("continue_generation")
        if self.on_continue is not None:
            self.on_continue()
        response = self._http.post("/continue_generation", json={})
        response.raise_for_status()
        return response.status_code

    def flush_cache(self) -> Any:
        self._record("flush_cache")
        if self.node_rank != 0:
            return None
        for _ in range(60):
            if self._http.get("/flush_cache").status_code == 200:
                return None
        raise TimeoutError("flush_cache did not succeed")

    def begin_weight_update(self, selector: str = "all") -> Any:
        self._record("begin_weight_update", selector=selector)
        self.sessions += 1

    def end_weight_update(self) -> Any:
        self._record("end_weight_update")
        self.sessions -= 1

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool = False,
        weight_version: str | None = None,
        selector: str = "all",
    ) -> Any:
        self._record("update_weights_from_distributed", names=names, weight_version=weight_version)
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": [str(d) for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "selector": selector,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_distributed", payload)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
        selector: str = "all",
    ) -> Any:
        self._record("update_weights_from_tensor", weight_version=weight_version)
        payload: dict[str, Any] = {"serialized_named_tensors": serialized_named_tensors, "flush_cache": flush_cache}
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_tensor", payload)

    def _load_adapter(self, lora_name: str, digest: str, upsert: bool) -> Any:
        if upsert:
            self._http.post("/unload_lora_adapter", json={"lora_name": lora_name})
        return self._make_request("load_lora_adapter", {"lora_name": lora_name, "lora_path": f"adapter:{digest}"})

    def load_lora_adapter_from_distributed(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        pinned: bool = False,
        added_tokens_config: Any = None,
        upsert: bool = False,
    ) -> Any:
        self._record("load_lora_adapter_from_distributed", lora_name=lora_name, upsert=upsert)
        return self._load_adapter(lora_name, _digest(names), upsert)

    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_tensors: Any = None,
        serialized_named_tensors: Any = None,
        load_format: str | None = None,
        pinned: bool = False,
        added_tokens_config: Any = None,
        upsert: bool = False,
        expected_checksums: Any = None,
    ) -> Any:
        self._record("load_lora_adapter_from_tensors", lora_name=lora_name)
        return self._load_adapter(lora_name, _digest(serialized_named_tensors or serialized_tensors or []), upsert)

    def unload_lora_adapter(self, lora_name: str) -> Any:
        self._record("unload_lora_adapter", lora_name=lora_name)
        return self._make_request("unload_lora_adapter", {"lora_name": lora_name})

    def pull_weights(self, target_version: int) -> Any:
        """The fork's ``/pull_weights``: bring the host-local checkpoint to ``target_version`` of the chain.

        0 materialises the base (the HF checkpoint); a higher version applies every delta after the
        local one, in order, each tensor verified against the checksum its file carries.
        """
        self._record("pull_weights", target_version=target_version)
        self.pulls.append(target_version)
        try:
            if self.delta_dir is not None:
                self.local.sync(Path(self.delta_dir), target_version)
        except (ChecksumMismatch, OSError, ValueError) as exc:
            return {"success": False, "error_message": f"pull_weights({target_version}): {exc}"}
        return {"success": True, "message": f"pulled {target_version}"}

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> Any:
        self._record("update_weights_from_disk", model_path=model_path, weight_version=weight_version)
        if self.delta_dir is not None and self.local.version is not None:
            model_path = f"{model_path}@{self.local.digest()}"  # the reference engine's weights: what was reloaded
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_disk", payload)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def _digest(parts: Any) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def _check_weight_sync_results(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, dict) and result.get("success") is False:
            raise RuntimeError(f"weight sync failed: {result}")


# -- the disk-delta file chain (miles ``delta.py`` writes it, the fork's ``/pull_weights`` applies it) -----------


class ChecksumMismatch(ValueError):
    """A tensor of the chain does not have the checksum its delta file says it must have after the apply."""


def hf_tensor(name: str) -> bytes:
    """A tensor of the HF checkpoint (``--hf-checkpoint``): the base every host materialises at ``pull_weights(0)``."""
    return hashlib.blake2b(f"hf:{name}".encode(), digest_size=16).digest()


def tensor_checksum(value: bytes) -> str:
    return hashlib.blake2b(value, digest_size=8).hexdigest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def version_dir(root: Path | str, version: int) -> Path:
    """``weight_v000002``: one version of the chain (miles' ``_encode_delta``)."""
    return Path(root) / f"weight_v{version:06d}"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass
class LocalCheckpoint:
    """A host-local checkpoint dir (``--update-weight-local-checkpoint-dir``) as the fork's pull keeps it."""

    tensors: dict[str, bytes] = field(default_factory=dict)
    version: int | None = None

    def sync(self, root: Path, target: int) -> None:
        """``/pull_weights(target)``: the base at 0, else each version after the local one applied in order.

        Raises:
            ChecksumMismatch: a tensor after its apply is not what its file's checksum says.
            OSError, ValueError: a version of the chain is missing or unreadable.
        """
        if target == 0:
            self.tensors, self.version = {}, 0
            return
        if self.version is None:
            self.tensors, self.version = {}, 0  # a host that never pulled: the base first
        if target < self.version:
            raise ValueError(f"the local checkpoint is at {self.version}, past {target}")
        for version in range(self.version + 1, target + 1):
            self.apply(root, version)

    def apply(self, root: Path, version: int) -> None:
        where = version_dir(root, version)
        index = json.loads((where / "model.safetensors.index.json").read_text())
        if index["metadata"]["base_version"] != f"{version - 1:06d}":
            raise ValueError(f"{where.name} is not a delta from {version - 1}")
        patched = dict(self.tensors)
        for fname in sorted(set(index["weight_map"].values())):
            shard = json.loads((where / fname).read_text())
            for name, diff in shard["tensors"].items():
                new = _xor(patched.get(name, hf_tensor(name)), bytes.fromhex(diff))
                if tensor_checksum(new) != shard["__metadata__"][name]:
                    raise ChecksumMismatch(f"{where.name}/{fname}: {name} does not verify")
                patched[name] = new
        self.tensors, self.version = patched, version

    def digest(self) -> str:
        return _digest(sorted(self.tensors.items()))


def replay_chain(root: Path | str, target: int) -> LocalCheckpoint:
    """What a host that joins now does: the base, then every version of the chain up to ``target``, verified."""
    local = LocalCheckpoint()
    local.sync(Path(root), 0)
    local.sync(Path(root), target)
    return local


def chain_files(root: Path | str) -> dict[str, bytes]:
    """Every file under the shared delta dir, by relative path, byte for byte."""
    base = Path(root)
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


# -- the model and the updaters ------------------------------------------------------------------------------


@dataclass
class FakeModel:
    """What the updaters read from a Megatron model: bucket names per update, and the adapter's."""

    buckets: int = 2
    step: int = 0
    on_bucket: Callable[[int], None] | None = None  # fault injection between buckets
    lora_names: list[str] = field(default_factory=lambda: ["layers.0.q.lora_A", "layers.0.q.lora_B"])
    seed: str = "cell"  # the cell's own training run: two cells' weights differ at the same step

    def shard(self, rank: int) -> list[str]:
        """The HF tensors rank ``rank`` gathers and publishes (one pipeline stage each)."""
        return [f"layers.{rank}.mlp.weight", f"layers.{rank}.attn.weight"]

    def tensor(self, name: str) -> bytes:
        """The tensor ``name`` of this model now (it changes at every step)."""
        return hashlib.blake2b(f"{name}@{self.seed}:{self.step}".encode(), digest_size=16).digest()

    def hf_buckets(self) -> Iterator[list[str]]:
        for i in range(self.buckets):
            if self.on_bucket is not None:
                self.on_bucket(i)
            yield [f"layers.{i}.weight@{self.step}"]


def slot_lora_name(slot: int) -> str:
    """``miles.utils.multi_lora.slot_lora_name``: the engine-side adapter name of a controller slot."""
    return f"__miles_slot_{slot}"


def is_multi_lora_enabled(args: Any) -> bool:
    """``miles.utils.multi_lora.is_multi_lora_enabled``."""
    return getattr(args, "multi_lora", False)


@dataclass(frozen=True)
class AdapterRunConfig:
    rank: int = 4
    alpha: int = 8


@dataclass(frozen=True)
class AdapterRun:
    """``miles.utils.adapter_config.AdapterRun``: one adapter of a multi-LoRA run, in its controller slot."""

    name: str
    slot: int
    config: AdapterRunConfig = field(default_factory=AdapterRunConfig)


class DistBucketedWeightUpdateMixin:
    """``.../update_weight_from_distributed/mixin.py``: pause → buckets (or the adapter) → stamp → resume."""

    def _init_lora(
        self, *, args: Namespace, model: Any, model_name: str, quantization_config: Any, is_lora: bool
    ) -> None:
        self.is_lora = is_lora
        self.multi_lora_adapters: dict[str, AdapterRun] | None = None  # set by the actor before each update
        self._lora_loaded = False
        self._lora_config = {"r": 8}

    def _update_lora_weights(self) -> None:
        names = list(self.model.lora_names)
        if dist.get_rank() != 0:
            return
        if self._lora_loaded:
            ray.get([e.unload_lora_adapter.remote(lora_name=LORA_ADAPTER_NAME) for e in self.rollout_engines])
        self._update_lora_weight_implementation([(n, self.model.step) for n in names])
        self._lora_loaded = True

    def _update_multi_lora_weights(self) -> None:
        adapters = self.multi_lora_adapters
        assert adapters is not None, "actor must set multi_lora_adapters before update_weights"
        for name in sorted(adapters):
            adapter = adapters[name]
            if dist.get_rank() == 0:
                tensors = [(f"{adapter.name}.{n}", self.model.step) for n in self.model.lora_names]
                # the engines serve each adapter under its controller slot's name, not miles' name for it
                self._update_multi_lora_weight_implementation(
                    tensors, lora_name=slot_lora_name(adapter.slot), lora_config={"r": adapter.config.rank}
                )

    def _pause_and_prepare_engines(self) -> None:
        self._weight_update_selector = "all"
        if dist.get_rank() == 0:
            mode = self.args.pause_generation_mode
            ray.get([e.pause_generation.remote(mode=mode) for e in self.rollout_engines])
            if mode != "in_place":
                ray.get([e.flush_cache.remote() for e in self.rollout_engines])
            ray.get([e.begin_weight_update.remote(selector=self._weight_update_selector) for e in self.rollout_engines])

    def _finalize_and_resume_engines(self) -> None:
        if dist.get_rank() == 0:
            ray.get(
                [e.update_weight_version.remote(weight_version=str(self.weight_version)) for e in self.rollout_engines]
            )
            ray.get([e.end_weight_update.remote() for e in self.rollout_engines])
            ray.get([e.continue_generation.remote() for e in self.rollout_engines])

    def update_weights(self) -> None:
        self.weight_version += 1
        self.pushed_versions.append(self.weight_version)
        self._pause_and_prepare_engines()
        dist.barrier(group=get_gloo_group())
        if not self.is_lora:
            for bucket in self.model.hf_buckets():
                if self._is_source:
                    self._update_weight_implementation(bucket)
            dist.barrier(group=get_gloo_group())
        else:
            if is_multi_lora_enabled(self.args):
                self._update_multi_lora_weights()
            else:
                self._update_lora_weights()
            dist.barrier(group=get_gloo_group())
        self._finalize_and_resume_engines()
        dist.barrier(group=get_gloo_group())


class _Connects:
    """``connect_rollout_engines``, ``is_rollout_engines_fresh``, ``mark_engine_connection_stale``: every updater's."""

    def is_rollout_engines_fresh(self) -> bool:
        return self.rollout_engines is not None and not self._connection_stale

    def mark_engine_connection_stale(self) -> None:
        self._connection_stale = True

    def connect_rollout_engines(
        self,
        rollout_engines: Any,
        rollout_engine_lock: Any,
        engine_gpu_counts: Any = None,
        engine_gpu_offsets: Any = None,
    ) -> None:
        self.rollout_engines = rollout_engines
        self.rollout_engine_lock = rollout_engine_lock
        self._connection_stale = False


class UpdateWeightFromDistributed(_Connects, DistBucketedWeightUpdateMixin):
    """``broadcast.py``: NCCL broadcast; each bucket's load carries ``weight_version=str(self.weight_version)``."""

    def __init__(
        self,
        args: Namespace,
        model: Any,
        weights_getter: Callable[[], Any],
        *,
        model_name: str,
        quantization_config: Any,
        is_lora: bool = False,
    ) -> None:
        self.args = args
        self.model = model
        self.weight_version = 0
        self.rollout_engines: Any = None
        self._connection_stale = False
        self._group_name = "miles-pp_0"
        self.pushed_versions: list[int] = []
        self._init_lora(
            args=args, model=model, model_name=model_name, quantization_config=quantization_config, is_lora=is_lora
        )

    @property
    def _is_source(self) -> bool:
        return dist.get_rank() == 0

    def _update_weight_implementation(self, bucket: list[str]) -> None:
        refs = [
            e.update_weights_from_distributed.remote(
                names=bucket,
                dtypes=["bfloat16"] * len(bucket),
                shapes=[[4, 4]] * len(bucket),
                selector=self._weight_update_selector,
                group_name=self._group_name,
                weight_version=str(self.weight_version),
            )
            for e in self.rollout_engines
        ]
        ray.get(refs)

    def _update_lora_weight_implementation(self, named_tensors: list[Any]) -> None:
        names = [n for n, _ in named_tensors]
        refs = [
            e.load_lora_adapter_from_distributed.remote(
                lora_name=LORA_ADAPTER_NAME,
                config_dict=self._lora_config,
                names=names,
                dtypes=["bfloat16"] * len(names),
                shapes=[[8, 4]] * len(names),
                group_name=self._group_name,
            )
            for e in self.rollout_engines
        ]
        _check_weight_sync_results(ray.get(refs))

    def _update_multi_lora_weight_implementation(
        self, named_tensors: list[Any], *, lora_name: str, lora_config: dict[str, Any]
    ) -> None:
        names = [n for n, _ in named_tensors]
        refs = [
            e.load_lora_adapter_from_distributed.remote(
                lora_name=lora_name,
                config_dict=lora_config,
                names=names,
                dtypes=["bfloat16"] * len(names),
                shapes=[[4, 4]] * len(names),
                group_name=self._group_name,
                upsert=True,
            )
            for e in self.rollout_engines
        ]
        _check_weight_sync_results(ray.get(refs))


class UpdateWeightP2P(UpdateWeightFromDistributed):
    """``p2p.py``: RDMA writes; the push carries no label (the stamp in finalize is the only one); no LoRA."""

    def __init__(self, args: Namespace, model: Any, weights_getter: Callable[[], Any], **kwargs: Any) -> None:
        assert not kwargs.get("is_lora"), "LoRA weight sync is not supported for p2p (RDMA) weight transfer."
        super().__init__(args, model, weights_getter, **kwargs)

    def _update_weight_implementation(self, bucket: list[str]) -> None:
        ray.get([e.update_weights_from_tensor.remote(serialized_named_tensors=bucket) for e in self.rollout_engines])


class UpdateWeightFromDiskDelta(_Connects, DistBucketedWeightUpdateMixin):
    """``delta.py``: baseline first (no version), then per update: publish the delta files, pull, reload.

    The files are a real chain under ``--update-weight-disk-dir``: each version's dir holds one shard per
    publishing rank (the XOR of each changed tensor against the previous sync, with the checksum of its
    new value) and rank 0's index (``version``, ``base_version``, ``weight_map``). miles writes them
    before it touches an engine (``_publish``), then every engine pulls them (``pull_weights``, before
    the pause), then reloads the patched local checkpoint (``_reload_engines``).
    """

    def __init__(
        self,
        args: Namespace,
        model: Any,
        weights_getter: Callable[[], Any],
        *,
        model_name: str,
        quantization_config: Any,
        is_lora: bool = False,
    ) -> None:
        assert not is_lora, "LoRA weight sync is not supported for disk-delta weight transfer."
        self.args = args
        self.model = model
        self.weight_version = 0
        self.rollout_engines: Any = None
        self._connection_stale = False
        self.delta_dir = args.update_weight_disk_dir
        os.makedirs(self.delta_dir, exist_ok=True)
        self._snapshot: dict[str, bytes] = {}
        self._baseline_captured = False
        self.pushed_versions: list[int] = []
        self._init_lora(
            args=args, model=model, model_name=model_name, quantization_config=quantization_config, is_lora=False
        )

    def update_weights(self) -> None:
        if not self._baseline_captured:
            self._capture_baseline()
            self._baseline_captured = True
            return
        self.weight_version += 1
        self.pushed_versions.append(self.weight_version)
        self._publish()
        self._reload_engines()

    def _capture_baseline(self) -> None:
        pulls = []
        if dist.get_rank() == 0:
            shutil.rmtree(self.delta_dir, ignore_errors=True)  # a prior run's versions: start the dir clean
            os.makedirs(self.delta_dir, exist_ok=True)
            pulls = [e.pull_weights.remote(target_version=0) for e in self.rollout_engines]
        dist.barrier(group=get_gloo_group())
        self._snapshot = {name: hf_tensor(name) for name in self.model.shard(dist.get_rank())}
        if dist.get_rank() == 0:
            _check_weight_sync_results(ray.get(pulls))
            if self.args.check_weight_update_equal:
                results = ray.get(
                    [
                        e.update_weights_from_disk.remote(
                            model_path=self.args.update_weight_local_checkpoint_dir,
                            weight_version=str(self.weight_version),
                        )
                        for e in self.rollout_engines
                    ]
                )
                _check_weight_sync_results(results)

    def _publish(self) -> None:
        self._encode_delta()
        self._write_delta_files()

    def _encode_delta(self) -> None:
        self._version_dir = version_dir(self.delta_dir, self.weight_version)
        self._version_dir.mkdir(parents=True, exist_ok=True)
        self._delta: dict[str, str] = {}
        self._checksums: dict[str, str] = {}
        for name in self.model.shard(dist.get_rank()):
            new = self.model.tensor(name)
            old = self._snapshot[name]
            if new != old:
                self._delta[name] = _xor(new, old).hex()
                self._checksums[name] = tensor_checksum(new)
            self._snapshot[name] = new  # the next sync's base

    def _write_delta_files(self) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        counts: list[Any] = [None] * world
        dist.all_gather_object(counts, int(bool(self._delta)), group=get_gloo_group())
        offset, total = sum(counts[:rank]), sum(counts)
        fname = None
        if self._delta:
            fname = f"model-{offset:05d}-of-{total:05d}.safetensors"
            shard = {"__metadata__": self._checksums, "tensors": self._delta}
            _atomic_write(self._version_dir / fname, json.dumps(shard).encode())
        maps: list[Any] = [None] * world
        dist.all_gather_object(maps, {name: fname for name in self._delta}, group=get_gloo_group())
        if rank == 0:
            index = {
                "metadata": {"version": f"{self.weight_version:06d}", "base_version": f"{self.weight_version - 1:06d}"},
                "weight_map": {name: f for m in maps for name, f in m.items()},
            }
            _atomic_write(self._version_dir / "model.safetensors.index.json", json.dumps(index).encode())
        dist.barrier(group=get_gloo_group())

    def _reload_engines(self) -> None:
        dist.barrier(group=get_gloo_group())
        if dist.get_rank() == 0:
            _check_weight_sync_results(
                ray.get([e.pull_weights.remote(self.weight_version) for e in self.rollout_engines])
            )
            mode = self.args.pause_generation_mode
            ray.get([e.pause_generation.remote(mode=mode) for e in self.rollout_engines])
            if mode != "in_place":
                ray.get([e.flush_cache.remote() for e in self.rollout_engines])
            results = ray.get(
                [
                    e.update_weights_from_disk.remote(
                        model_path=self.args.update_weight_local_checkpoint_dir,
                        weight_version=str(self.weight_version),
                    )
                    for e in self.rollout_engines
                ]
            )
            _check_weight_sync_results(results)
            ray.get([e.continue_generation.remote() for e in self.rollout_engines])
        dist.barrier(group=get_gloo_group())


class UpdateWeightFromTensor(_Connects):
    """``update_weight_from_tensor.py`` (colocated): base buckets carry the label; the LoRA load carries none."""

    def __init__(
        self,
        args: Namespace,
        model: Any,
        weights_getter: Callable[[], Any],
        *,
        model_name: str,
        quantization_config: Any,
        is_lora: bool = False,
    ) -> None:
        self.args = args
        self.model = model
        self.weight_version = 0
        self.is_lora = is_lora
        self.rollout_engines: Any = None
        self._connection_stale = False
        self.pushed_versions: list[int] = []

    def update_weights(self) -> None:
        self.weight_version += 1
        self.pushed_versions.append(self.weight_version)
        rank = dist.get_rank()
        skip_base_sync = self.is_lora
        if rank == 0:
            mode = self.args.pause_generation_mode
            ray.get([e.pause_generation.remote(mode=mode) for e in self.rollout_engines])
            ray.get([e.flush_cache.remote() for e in self.rollout_engines])
            if not skip_base_sync:
                ray.get([e.begin_weight_update.remote(selector="all") for e in self.rollout_engines])
        dist.barrier(group=get_gloo_group())
        if rank == 0 and not skip_base_sync:
            for bucket in self.model.hf_buckets():
                results = ray.get(
                    [
                        e.update_weights_from_tensor.remote(
                            serialized_named_tensors=bucket,
                            load_format="flattened_bucket",
                            flush_cache=False,
                            weight_version=str(self.weight_version),
                        )
                        for e in self.rollout_engines
                    ]
                )
                _check_weight_sync_results(results)
        if rank == 0 and self.is_lora:
            tensors = [f"{n}@{self.model.step}" for n in self.model.lora_names]
            results = ray.get(
                [
                    e.load_lora_adapter_from_tensors.remote(
                        lora_name=LORA_ADAPTER_NAME, config_dict={"r": 8}, serialized_named_tensors=tensors, upsert=True
                    )
                    for e in self.rollout_engines
                ]
            )
            _check_weight_sync_results(results)
        dist.barrier(group=get_gloo_group())
        if rank == 0:
            if not skip_base_sync:
                ray.get([e.end_weight_update.remote() for e in self.rollout_engines])
            ray.get([e.continue_generation.remote() for e in self.rollout_engines])
        dist.barrier(group=get_gloo_group())


class FsdpUpdateWeight(_Connects):
    """``miles/backends/fsdp_utils/update_weight_utils.py`` ``UpdateWeight``: pause, buckets, end, resume."""

    def __init__(self, args: Namespace, model: Any) -> None:
        self.args = args
        self.model = model
        self.weight_version = 0
        self.rollout_engines: Any = None
        self._connection_stale = False

    def update_weights(self) -> None:
        self.weight_version += 1
        if dist.get_rank() == 0:
            futures = [e.pause_generation.remote() for e in self.rollout_engines]
            futures.extend([e.flush_cache.remote() for e in self.rollout_engines])
            ray.get(futures)
            ray.get([e.begin_weight_update.remote() for e in self.rollout_engines])
        dist.barrier(group=get_gloo_group())
        for bucket in self.model.hf_buckets():
            self.update_bucket_weights(bucket, weight_version=self.weight_version)
        dist.barrier(group=get_gloo_group())
        if dist.get_rank() == 0:
            ray.get([e.end_weight_update.remote() for e in self.rollout_engines])
            ray.get([e.continue_generation.remote() for e in self.rollout_engines])
        dist.barrier(group=get_gloo_group())

    def update_bucket_weights(self, named_tensors: list[str], weight_version: int | None = None) -> None:
        if dist.get_rank() == 0:
            refs = [
                e.update_weights_from_tensor.remote(
                    serialized_named_tensors=named_tensors, weight_version=str(weight_version)
                )
                for e in self.rollout_engines
            ]
            _check_weight_sync_results(ray.get(refs))


class FsdpUpdateWeightFromTensor(FsdpUpdateWeight):
    """FSDP's ``UpdateWeightFromTensor``."""


class FsdpUpdateWeightFromDistributed(FsdpUpdateWeight):
    """FSDP's ``UpdateWeightFromDistributed``."""


FSDP_MODULE = "miles.backends.fsdp_utils.update_weight_utils"


def write_fsdp_package(root: Any) -> None:
    """An importable ``miles.backends.fsdp_utils.update_weight_utils`` under ``root`` (for the import hook)."""
    pkg = root / "miles" / "backends" / "fsdp_utils"
    pkg.mkdir(parents=True)
    for d in (root / "miles", root / "miles" / "backends", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "update_weight_utils.py").write_text(
        "from tests.integrations.miles.miles_trainer_standin import dist, ray, get_gloo_group\n"
        "from tests.integrations.miles import miles_trainer_standin as _s\n"
        "class UpdateWeight(_s.FsdpUpdateWeight):\n"
        "    update_weights = _s.FsdpUpdateWeight.update_weights\n"
        "class UpdateWeightFromTensor(UpdateWeight):\n    pass\n"
        "class UpdateWeightFromDistributed(UpdateWeight):\n    pass\n"
    )


# -- the rollout manager, the actor, the group ------------------------------------------------------------------


class RolloutManager:
    """``miles/ray/rollout/rollout_manager.py``: holds the version the trainer pushes (None until the first)."""

    def __init__(self, args: Namespace, rollout_fn: Any = None) -> None:
        self.args = args
        self.weight_version: int | None = None
        self.versions: list[int] = []
        self.regressions: list[tuple[int, int]] = []
        self.rollout_fn = rollout_fn

    def set_weight_version(self, weight_version: int) -> None:
        if self.weight_version is not None and weight_version < self.weight_version:
            self.regressions.append((self.weight_version, weight_version))
            if not self.args.indep_dp:
                raise AssertionError(f"weight version went back: {self.weight_version} -> {weight_version}")
            log.warning("weight version went back %s -> %s (indep_dp)", self.weight_version, weight_version)
        self.weight_version = weight_version
        self.versions.append(weight_version)


@dataclass(frozen=True)
class EnginesAndLock:
    rollout_engines: list[Any]
    rollout_engine_lock: Any = None
    has_new_engines: bool = False
    engine_gpu_counts: list[int] | None = None
    engine_gpu_offsets: list[int] | None = None


_UPDATERS = {
    "broadcast": "UpdateWeightFromDistributed",
    "p2p": "UpdateWeightP2P",
    "disk-delta": "UpdateWeightFromDiskDelta",
    "tensor": "UpdateWeightFromTensor",
}
_UPDATER_MODULES = {
    "UpdateWeightFromDistributed": "broadcast",
    "UpdateWeightP2P": "p2p",
    "UpdateWeightFromDiskDelta": "delta",
}


def load_function(path: str) -> Any:
    """``miles.utils.misc.load_function``."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class RayActorError(RuntimeError):
    """``ray.exceptions.RayActorError``: the actor died (a crash, a kill, a lost node)."""


class MegatronTrainRayActor:
    """``miles/backends/megatron_utils/actor.py``: one rank of one cell."""

    def __init__(self, world: World, rank: int, rollout_manager: ActorHandle) -> None:
        self.world = world
        self.rank = rank
        self.rollout_manager = rollout_manager
        self.model = FakeModel()
        self.weight_updater: Any = None
        self.trained: list[int] = []

    def init(self, args: Namespace, indep_dp_info: IndepDPInfo | None = None) -> None:
        self.args = args
        # miles' initialize.init: the indep-DP group (its quorum, the cell's alive rank) is set before the hook.
        info = indep_dp_info or IndepDPInfo(0, 1, 0, 1, 0, [0])
        self.world.parallel_state = ParallelState(indep_dp=create_indep_dp_group(info))
        if getattr(args, "custom_megatron_init_path", None):  # end of Megatron's initialisation
            load_function(args.custom_megatron_init_path)(args)
        name = _UPDATERS[args.update_weight_transfer_mode]
        module = _UPDATER_MODULES.get(name)
        path = f"{_DIST}.{module}" if module else _TENSOR
        cls = getattr(importlib.import_module(path), name)
        self.weight_updater = cls(
            args, self.model, lambda: {}, model_name="qwen", quantization_config=None, is_lora=bool(args.lora_rank)
        )

    def train(self, rollout_id: int) -> None:
        self.model.step += 1
        self.trained.append(rollout_id)

    def reconfigure_indep_dp(self, indep_dp_info: IndepDPInfo) -> None:
        """``actor.py:864-872``: a new indep-DP group for the new quorum; the engine connection goes stale."""
        self.world.parallel_state = ParallelState(indep_dp=create_indep_dp_group(indep_dp_info))
        self.weight_updater.mark_engine_connection_stale()

    def update_weights(self, info: EnginesAndLock) -> None:
        if info.has_new_engines or not self.weight_updater.is_rollout_engines_fresh():
            self.weight_updater.connect_rollout_engines(
                info.rollout_engines,
                info.rollout_engine_lock,
                engine_gpu_counts=info.engine_gpu_counts,
                engine_gpu_offsets=info.engine_gpu_offsets,
            )
            dist.barrier(group=get_gloo_group())
        self.weight_updater.update_weights()
        if dist.get_rank() == 0:
            ray.get(self.rollout_manager.set_weight_version.remote(self.weight_updater.weight_version))
        if self.args.ci_test and info.rollout_engines and not self.args.lora_rank:
            # miles (actor.py:789-795), on every rank, with one engine at random: here every engine
            for engine in info.rollout_engines:
                engine_version = ray.get(engine.get_weight_version.remote())
                updater_version = self.weight_updater.weight_version
                if str(engine_version) != str(updater_version):
                    raise RuntimeError(f"Weight version mismatch! Engine: {engine_version}, Updater: {updater_version}")


class Cell:
    """``miles/ray/train/cell.py`` ``RayTrainCell``: the actors of one training cell and its state.

    States as miles': alive (with its ``IndepDPInfo``), errored, stopped, pending. ``execute`` runs a
    method on every actor of the cell; a failure marks the cell errored and stops it (miles kills its
    actors), then raises. A pending cell gets new actors at the group's next refresh (``heal``): a new
    incarnation, with new processes in miles (here: a new ``World``, new actors, new updaters). The
    actors of a stopped incarnation keep running here (``stale``): a partitioned zombie that miles
    gave up on, which miles itself never calls again.
    """

    def __init__(
        self, args: Namespace, rollout_manager: ActorHandle, *, world_size: int = 1, job_id: str | None = None
    ) -> None:
        self.args = args
        self.rollout_manager = rollout_manager
        self.world_size = world_size
        self.job_id = job_id
        self.index = 0
        self.state = "alive"
        self.indep_dp_info: IndepDPInfo | None = None
        self.stale: list[list[MegatronTrainRayActor]] = []  # stopped incarnations (zombies if still running)
        self._crash: dict[str, BaseException] = {}
        self._allocate(None)

    def _allocate(self, info: IndepDPInfo | None) -> None:
        self.world = World(self.world_size, job_id=self.job_id)
        self.actors = [MegatronTrainRayActor(self.world, r, self.rollout_manager) for r in range(self.world_size)]
        seed = uuid.uuid4().hex[:8]  # new actors: a training run of their own
        for actor in self.actors:
            actor.model.seed = seed
        self.world.run(lambda r: self.actors[r].init(self.args, info))
        self.indep_dp_info = info

    @property
    def updater(self) -> Any:
        return self.actors[0].weight_updater

    @property
    def alive(self) -> bool:
        return self.state == "alive"

    @alive.setter
    def alive(self, value: bool) -> None:
        """``False``: the cell died and miles stopped it (what ``stop_cell`` and a failed ``execute`` do)."""
        if value:
            raise ValueError("a stopped cell comes back through start_cell and the group's next refresh")
        self.stop()

    def crash(self, fn_name: str, error: BaseException | None = None) -> None:
        """The next ``execute(fn_name)`` fails as a dead actor does (before the method runs)."""
        self._crash[fn_name] = error or RayActorError(f"The actor died unexpectedly before finishing {fn_name}")

    def execute(self, fn_name: str, *args: Any) -> list[Any]:
        """``RayTrainCell.execute``: every actor runs ``fn_name``; a failure marks the cell errored and stops it."""
        assert self.state in ("alive", "errored", "uninitialized"), f"cell {self.index} is {self.state}"
        try:
            crash = self._crash.pop(fn_name, None)
            if crash is not None:
                raise crash
            return self.world.run(lambda r: getattr(self.actors[r], fn_name)(*args))
        except Exception:
            self.state = "errored"
            self.stop()
            raise

    def stop(self) -> None:
        """``RayTrainCell.stop``: kill the actors (here they keep running: see ``stale``)."""
        if self.state == "stopped":
            return
        self.stale.append(self.actors)
        self.state = "stopped"

    def mark_as_pending(self) -> None:
        if self.state == "stopped":
            self.state = "pending"

    def heal(self, info: IndepDPInfo) -> None:
        """``prepare_indep_dp_mode_healing``: new actors, initialised with the group's new ``IndepDPInfo``."""
        assert self.state == "pending"
        self.state = "uninitialized"
        try:
            self._allocate(info)
        except Exception:
            self.state = "errored"
            self.stop()
            raise
        self.state = "alive"

    def reconfigure(self, info: IndepDPInfo) -> None:
        """``prepare_indep_dp_mode_alive``: the new quorum reaches every actor of the cell."""
        self.execute("reconfigure_indep_dp", info)
        self.indep_dp_info = info

    def update_weights(self, info: EnginesAndLock) -> None:
        """The actors' ``update_weights`` called directly (not through the group: a stale driver)."""
        self.world.run(lambda r: self.actors[r].update_weights(info))

    def run_stale(self, fn_name: str, *args: Any, incarnation: int = -1) -> list[Any]:
        """A stopped incarnation's actors run ``fn_name`` anyway: a partitioned zombie miles no longer calls."""
        actors = self.stale[incarnation]
        world = actors[0].world
        return world.run(lambda r: getattr(actors[r], fn_name)(*args))


class RayTrainGroup:
    """``miles/ray/train/group.py``: the cells, their quorum, and which cell runs what.

    ``update_weights`` runs ``_execute_first_alive`` under miles' ``retry`` (30 attempts): the cell
    with the lowest index among those alive; a cell that fails is stopped, so the next attempt
    picks the next one, and with none left miles asserts "No alive cells, therefore cannot heal
    anymore". ``train`` first refreshes the cells (``_refresh_cells``): if a cell is pending or the
    alive set changed, the quorum id goes up by one, pending cells are healed (new actors) and every
    alive cell is reconfigured with its new ``IndepDPInfo``; then every alive cell trains.
    """

    RETRY_MAX_ATTEMPTS = 30

    def __init__(self, cells: list[Cell]) -> None:
        self.cells = cells
        self.quorum_id = 0
        alive = list(range(len(cells)))
        for index, cell in enumerate(cells):
            cell.index = index
            # What miles' group.init passes to every cell's init (all alive, quorum 0).
            info = self._info(index, alive)
            cell.world.run(lambda r, c=cell, i=info: _set_indep_dp(c.actors[r], i))
            cell.indep_dp_info = info
        self.attempts: list[tuple[str, int]] = []  # (method, cell index) of every attempt

    def _info(self, index: int, alive: list[int]) -> IndepDPInfo:
        return IndepDPInfo(index, len(self.cells), alive.index(index), len(alive), self.quorum_id, alive)

    @staticmethod
    def _retry(fn: Callable[[int], Any], max_attempts: int) -> Any:
        """``miles.utils.retry_utils.retry`` (without its back-off sleeps)."""
        attempt = 0
        while True:
            try:
                return fn(attempt)
            except Exception:
                attempt += 1
                if attempt >= max_attempts:
                    raise
                log.warning("retry: attempt %s failed, retrying", attempt, exc_info=True)

    def _execute_first_alive(self, fn_name: str, *args: Any) -> Any:
        alive_cells = [c for c in self.cells if c.alive]
        assert alive_cells, "No alive cells, therefore cannot heal anymore"
        self.attempts.append((fn_name, alive_cells[0].index))
        return alive_cells[0].execute(fn_name, *args)

    def update_weights(self, info: EnginesAndLock) -> None:
        self._retry(lambda _: self._execute_first_alive("update_weights", info), self.RETRY_MAX_ATTEMPTS)

    def train(self, rollout_id: int) -> None:
        def attempt(_: int) -> None:
            self._refresh_cells()
            alive = [c for c in self.cells if c.alive]
            assert alive, "No alive cells"
            failed = 0
            for cell in alive:
                try:
                    cell.execute("train", rollout_id)
                except Exception:
                    failed += 1
            if failed == len(alive):
                raise RuntimeError("All cells failed in this training attempt")

        self._retry(attempt, self.RETRY_MAX_ATTEMPTS)

    def stop_cell(self, index: int) -> None:
        self.cells[index].stop()

    def start_cell(self, index: int) -> None:
        """Mark a stopped cell as pending; it is healed at the next ``train``."""
        self.cells[index].mark_as_pending()

    def _refresh_cells(self) -> None:
        pending = [c.index for c in self.cells if c.state == "pending"]
        alive = [c.index for c in self.cells if c.alive]
        will_alive = sorted(set(pending + alive))
        assert alive, "Cannot recover when all cells are dead"
        changed = any(self.cells[i].indep_dp_info.alive_cell_indices != will_alive for i in alive)  # type: ignore[union-attr]
        if not pending and not changed:
            return
        self.quorum_id += 1
        for index in will_alive:
            cell = self.cells[index]
            try:
                if index in alive:
                    cell.reconfigure(self._info(index, will_alive))
                else:
                    cell.heal(self._info(index, will_alive))
            except Exception:
                log.exception("refresh: cell %s failed to prepare", index)


def _set_indep_dp(actor: MegatronTrainRayActor, info: IndepDPInfo) -> None:
    actor.world.parallel_state = ParallelState(indep_dp=create_indep_dp_group(info))


def make_trainer_args(**overrides: Any) -> Namespace:
    """miles' trainer arguments the weight update reads."""
    base: dict[str, Any] = dict(
        custom_megatron_init_path="weightbus.integrations.miles.install",
        update_weight_transfer_mode="broadcast",
        pause_generation_mode="retract",
        lora_rank=0,
        indep_dp=True,
        check_weight_update_equal=False,
        update_weight_local_checkpoint_dir="/ckpt/local",
        update_weight_disk_dir=None,
        multi_lora=False,
        ci_test=False,
    )
    base.update(overrides)
    return Namespace(**base)


_MIXIN_METHODS = (
    "update_weights",
    "_pause_and_prepare_engines",
    "_finalize_and_resume_engines",
    "_update_lora_weights",
    "_update_multi_lora_weights",
)

# -- the modules, under miles' paths --------------------------------------------------------------------------

_UW = "miles.backends.megatron_utils.update_weight"
_DIST = f"{_UW}.update_weight_from_distributed"
_TENSOR = f"{_UW}.update_weight_from_tensor"
_MULTI_LORA = "miles.utils.multi_lora"


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@contextmanager
def install_miles_trainer(
    *, drop: dict[str, str] | None = None, replace: dict[str, Any] | None = None
) -> Iterator[dict[str, types.ModuleType]]:
    """Register the stand-in updater modules under miles' import paths; removed again on exit.

    Args:
        drop: ``{"module suffix": "Class.method" or "Class" or "global"}`` to delete (a miles without it).
        replace: ``{"module suffix:Class.method": fn}`` to replace (a miles with another signature).
    """
    runtime = {"dist": dist, "ray": ray, "get_gloo_group": get_gloo_group, "get_parallel_state": get_parallel_state}
    # Fresh subclasses per install, whose methods are their own attributes: a patch or a drop never
    # outlives the context, and the install patches this context's classes only.
    mixin = type("DistBucketedWeightUpdateMixin", (DistBucketedWeightUpdateMixin,), {})
    for name in _MIXIN_METHODS:
        setattr(mixin, name, getattr(DistBucketedWeightUpdateMixin, name))
    broadcast = type("UpdateWeightFromDistributed", (UpdateWeightFromDistributed, mixin), {})
    p2p = type("UpdateWeightP2P", (UpdateWeightP2P, mixin), {})
    delta = type("UpdateWeightFromDiskDelta", (UpdateWeightFromDiskDelta, mixin), {})
    for name in ("update_weights", "_capture_baseline", "_reload_engines"):
        setattr(delta, name, getattr(UpdateWeightFromDiskDelta, name))
    tensor = type(
        "UpdateWeightFromTensor", (UpdateWeightFromTensor,), {"update_weights": UpdateWeightFromTensor.update_weights}
    )
    multi_lora = _module(_MULTI_LORA, slot_lora_name=slot_lora_name, is_multi_lora_enabled=is_multi_lora_enabled)
    modules = {
        "mixin": _module(
            f"{_DIST}.mixin", DistBucketedWeightUpdateMixin=mixin, LORA_ADAPTER_NAME=LORA_ADAPTER_NAME, **runtime
        ),
        "broadcast": _module(f"{_DIST}.broadcast", UpdateWeightFromDistributed=broadcast, **runtime),
        "p2p": _module(f"{_DIST}.p2p", UpdateWeightP2P=p2p, **_without(runtime, "get_parallel_state", "ray")),
        "delta": _module(f"{_DIST}.delta", UpdateWeightFromDiskDelta=delta, **runtime),
        "tensor": _module(_TENSOR, UpdateWeightFromTensor=tensor, **runtime),
    }
    for suffix, what in (drop or {}).items():
        module = modules[suffix]
        cls_name, _, method = what.partition(".")
        if method:
            setattr(getattr(module, cls_name), method, _Missing())  # how a removed method looks
        else:
            delattr(module, cls_name)
    for key, fn in (replace or {}).items():
        suffix, _, what = key.partition(":")
        cls_name, _, method = what.partition(".")
        setattr(getattr(modules[suffix], cls_name), method, fn)
    parents = ["miles", "miles.utils", "miles.backends", "miles.backends.megatron_utils", _UW, _DIST]
    names = [*parents, _MULTI_LORA, *(m.__name__ for m in modules.values())]
    saved = {n: sys.modules.get(n) for n in names}
    for n in parents:
        sys.modules[n] = sys.modules.get(n) or _module(n, __path__=[])  # packages: finders are asked
    for m in modules.values():
        sys.modules[m.__name__] = m
    sys.modules[_MULTI_LORA] = multi_lora
    try:
        yield modules
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _without(names: dict[str, Any], *drop: str) -> dict[str, Any]:
    """miles' p2p module imports neither ``ray`` nor ``get_parallel_state`` (its mixin's module does)."""
    return {k: v for k, v in names.items() if k not in drop}


class _Missing:
    """A class attribute that is not a method (how a removed method looks to ``install``)."""


def engines_info(handles: list[ActorHandle], *, new: bool = False) -> EnginesAndLock:
    return EnginesAndLock(rollout_engines=handles, has_new_engines=new)
