"""A stand-in for slime's trainer side (THUDM/slime main@624b824a), its ranks real processes on real gloo.

No slime code: slime's module paths, class and method names, signatures and call order, so that
``weightbus.integrations.slime.install`` finds what it patches where slime has it and is driven the way slime
drives it:

* **Ranks.** A training job's ranks are processes (``forkserver``: torch is imported once, in the server), each
  with ``torch.distributed`` initialised on gloo (a free TCP port); slime's updater modules (registered by
  ``install_slime_modules`` under ``slime.backends.megatron_utils.update_weight.*``) get ``dist`` (the real
  ``torch.distributed``), ``ray`` (``tests.integrations.ray_standin``) and ``get_gloo_group`` (a gloo group made
  at init) as module globals.
* **Engines.** ``SGLangEngine`` is slime's engine actor (``slime/backends/sglang_utils/sglang_engine.py``) in
  front of one reference engine served over real HTTP by the test: ``pause_generation()`` (no mode),
  ``flush_cache``, ``continue_generation``, ``get_url`` (None off node 0), ``get_weight_version`` (read from
  ``/model_info``: the reference engine has no ``/get_weight_version``), the three loads with slime's
  payloads; no ``update_weight_version`` (slime's has none). The NCCL group and ``pull_weights`` are recorded,
  not run (no engine GPUs); the engines are external (``--rollout-external``): a restarted job finds them.
* **The updaters**, with slime's control flow: ``UpdateWeightFromDistributed.update_weights`` (``+= 1``, rank 0
  pauses and flushes, gloo barrier, ``_send_weights``: every rank joins a gather of each chunk, the PP source
  sends each bucket under ``rollout_engine_lock`` carrying ``weight_version=str(v)``, a barrier per pass;
  rank 0 resumes, barrier); ``UpdateWeightFromTensor`` (colocated: each engine loaded by its own rank through
  a gloo gather group, ``weight_version=str(v)``); ``UpdateWeightFromDiskDelta`` (baseline first, then the
  delta files written by every rank, ``pull_weights``, pause, flush, ``update_weights_from_disk``, resume).
* **The actor and the group.** ``MegatronTrainRayActor.init`` runs ``args.custom_megatron_init_path`` (as
  ``initialize.py:100-104``), picks the updater as ``actor.py:155-175`` does, and sets ``weight_version =
  args.update_weight_start_version`` (``actor.py:183``); ``update_weights`` asks the rollout manager for its
  engines and connects new ones first (``actor.py:596-640``). ``RayTrainGroup`` (the driver's) holds the
  rank processes; its ``update_weights`` runs every rank's and waits (``ray.get``), ``create`` hands
  ``update_weight_start_version`` over as ``actor_group.py:193``. ``train_async`` is ``train_async.py``'s loop:
  the initial ``update_weights()``, then ``update_weights_interval``, from ``args.start_rollout_id``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import multiprocessing
import os
import sys
import threading
import traceback
import types
from argparse import Namespace
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.integrations.ray_standin import ActorHandle, ObjectRef, get, put

__all__ = [
    "EngineInfo",
    "RayTrainGroup",
    "RolloutManager",
    "make_trainer_args",
    "should_run_periodic_action",
    "train_async",
]

ray = types.ModuleType("ray")
ray.get = get  # type: ignore[attr-defined]
ray.put = put  # type: ignore[attr-defined]

_UW = "slime.backends.megatron_utils.update_weight"


# -- the rank side: slime's modules, in each rank process ---------------------------------------------------


class SGLangEngine:
    """slime's engine actor in front of one reference engine (slime's method names and payloads)."""

    def __init__(self, url: str, *, node_rank: int = 0) -> None:
        self.url = url
        self.node_rank = node_rank
        self._http = httpx.Client(base_url=url, timeout=10.0)
        self.calls: list[str] = []

    def _make_request(self, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        if self.node_rank != 0:
            return None
        response = self._http.post(f"/{endpoint}", json=payload or {})
        if response.status_code >= 400:
            raise RuntimeError(f"{endpoint} failed with {response.status_code}: {response.text}")
        return response.json()

    def get_url(self) -> str | None:
        return None if self.node_rank != 0 else self.url

    def get_weight_version(self) -> str | None:
        self.calls.append("get_weight_version")
        if self.node_rank != 0:
            return None
        response = self._http.get("/model_info")
        response.raise_for_status()
        return str(response.json()["weight_version"])

    def pause_generation(self) -> Any:
        self.calls.append("pause_generation")
        if self.node_rank != 0:
            return None
        self._http.post("/pause_generation", json={}).raise_for_status()
        return None

    def continue_generation(self) -> Any:
        self.calls.append("continue_generation")
        if self.node_rank != 0:
            return None
        self._http.post("/continue_generation", json={}).raise_for_status()
        return None

    def flush_cache(self) -> None:
        self.calls.append("flush_cache")
        if self.node_rank != 0:
            return
        for _ in range(60):
            if self._http.get("/flush_cache").status_code == 200:
                return
        raise TimeoutError("Timeout while flushing cache.")

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> Any:
        self.calls.append("init_weights_update_group")  # the NCCL group to the engines' GPUs: none here
        return {"success": True}

    def destroy_weights_update_group(self, group_name: str) -> Any:
        self.calls.append("destroy_weights_update_group")
        return {"success": True}

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[Any],
        shapes: list[Any],
        group_name: str,
        flush_cache: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> Any:
        self.calls.append("update_weights_from_distributed")
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
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
    ) -> Any:
        self.calls.append("update_weights_from_tensor")
        payload: dict[str, Any] = {"serialized_named_tensors": serialized_named_tensors, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_tensor", payload)

    def pull_weights(self, target_version: int) -> Any:
        self.calls.append(f"pull_weights:{target_version}")  # the fork's host-local apply: recorded only
        return {"success": True}

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> Any:
        self.calls.append("update_weights_from_disk")
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_disk", payload)


class _Lock:
    """slime's ``rollout_engine_lock`` actor (``acquire``/``release``)."""

    def __init__(self) -> None:
        self._held = False

    def acquire(self) -> bool:
        if self._held:
            return False
        self._held = True
        return True

    def release(self) -> None:
        self._held = False


class FakeModel:
    """A model's named parameters as slime's HF conversion yields them; each train step changes them."""

    def __init__(self) -> None:
        self.step = 0

    def named_params(self) -> list[tuple[str, str]]:
        """``(name, content)`` per parameter (the content changes at each step)."""
        names = ["model.embed_tokens.weight", "model.layers.0.mlp.weight", "lm_head.weight"]
        return [(n, hashlib.blake2b(f"{n}@{self.step}".encode(), digest_size=8).hexdigest()) for n in names]


def _torch() -> Any:
    import torch

    return torch


class UpdateWeightFromDistributed:
    """``update_weight_from_distributed.py``: NCCL broadcast from the PP source ranks (DP=TP=0)."""

    def __init__(
        self, args: Namespace, model: Any, weights_getter: Any, *, model_name: str, quantization_config: Any
    ) -> None:
        self.args = args
        self.model = model
        self.model_name = model_name
        self.quantization_config = quantization_config
        self.weight_version = 0
        self._model_update_groups: Any = None

    def connect_rollout_engines(
        self,
        rollout_engines: Any,
        rollout_engine_lock: Any,
        engine_gpu_counts: Any = None,
        engine_gpu_offsets: Any = None,
        engine_parallel_configs: Any = None,
    ) -> None:
        self.rollout_engines = rollout_engines
        self.rollout_engine_lock = rollout_engine_lock
        self._is_pp_src_rank = _g.dist.get_rank() == 0  # DP rank 0, TP rank 0 (one PP stage)
        self._group_name = "slime-pp_0"
        if self._is_pp_src_rank:
            refs = [
                e.init_weights_update_group.remote(
                    master_address="127.0.0.1",
                    master_port=0,
                    rank_offset=i + 1,
                    world_size=len(rollout_engines) + 1,
                    group_name=self._group_name,
                    backend="nccl",
                )
                for i, e in enumerate(rollout_engines)
            ]
            ray.get(refs)
            self._model_update_groups = object()

    def update_weights(self) -> None:
        dist, gloo = _g.dist, _g.get_gloo_group
        self.weight_version += 1
        if dist.get_rank() == 0:
            ray.get([engine.pause_generation.remote() for engine in self.rollout_engines])
            ray.get([engine.flush_cache.remote() for engine in self.rollout_engines])
        dist.barrier(group=gloo())
        self._send_weights(None)
        if dist.get_rank() == 0:
            ray.get([engine.continue_generation.remote() for engine in self.rollout_engines])
        dist.barrier(group=gloo())

    def _send_weights(self, pbar: Any) -> None:
        dist, gloo = _g.dist, _g.get_gloo_group
        params = self.model.named_params()
        for chunk in (params[:2], params[2:]):  # the non-expert pass, then the "expert" pass
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, [n for n, _ in chunk], group=gloo())  # every rank joins the gather
            if self._is_pp_src_rank:
                self._update_bucket_weights_from_distributed(chunk, pbar=pbar)
            dist.barrier(group=gloo())

    def _update_bucket_weights_from_distributed(self, chunk: list[tuple[str, str]], pbar: Any = None) -> None:
        while not ray.get(self.rollout_engine_lock.acquire.remote()):
            pass
        refs = [
            engine.update_weights_from_distributed.remote(
                names=[f"{name}#{content}" for name, content in chunk],  # the reference engine hashes the names
                dtypes=["bfloat16"] * len(chunk),
                shapes=[[4, 4]] * len(chunk),
                group_name=self._group_name,
                weight_version=str(self.weight_version),
                load_format=None,
            )
            for engine in self.rollout_engines
        ]
        ray.get(refs)
        ray.get(self.rollout_engine_lock.release.remote())


class UpdateWeightFromTensor:
    """``update_weight_from_tensor.py``, colocated: rank ``i`` loads engine ``i`` through its gloo gather group."""

    def __init__(
        self, args: Namespace, model: Any, weights_getter: Any, *, model_name: str, quantization_config: Any
    ) -> None:
        self.args = args
        self.model = model
        self.rank = _g.dist.get_rank()
        self.weight_version = 0
        self._ipc_gather_group: Any = None
        self._ipc_gather_src: int | None = None
        self._ipc_engine: Any = None

    def connect_rollout_engines(
        self,
        rollout_engines: Any,
        rollout_engine_lock: Any,
        engine_gpu_counts: Any = None,
        engine_gpu_offsets: Any = None,
        engine_parallel_configs: Any = None,
    ) -> None:
        dist = _g.dist
        self.rollout_engines = rollout_engines
        self.use_distribute = False
        if self._ipc_gather_group is None:
            for i in range(len(rollout_engines)):
                group = dist.new_group(ranks=[i], backend="gloo")  # every rank makes every group
                if self.rank == i:
                    self._ipc_gather_group, self._ipc_gather_src = group, i
        for i, engine in enumerate(self.rollout_engines):
            if i == self.rank:
                self._ipc_engine = engine

    def update_weights(self) -> None:
        dist, gloo = _g.dist, _g.get_gloo_group
        self.weight_version += 1
        if self.rank == 0:
            ray.get([engine.pause_generation.remote() for engine in self.rollout_engines])
            ray.get([engine.flush_cache.remote() for engine in self.rollout_engines])
        dist.barrier(group=gloo())
        serialized = [base64.b64encode(json.dumps(self.model.named_params()).encode()).decode()]
        gathered: list[Any] = [None]
        dist.gather_object(
            serialized, object_gather_list=gathered, dst=self._ipc_gather_src, group=self._ipc_gather_group
        )
        refs = [
            self._ipc_engine.update_weights_from_tensor.remote(
                serialized_named_tensors=gathered[0],
                load_format="flattened_bucket",
                weight_version=str(self.weight_version),
            )
        ]
        ray.get(refs)
        dist.barrier(group=gloo())
        if self.rank == 0:
            ray.get([engine.continue_generation.remote() for engine in self.rollout_engines])
        dist.barrier(group=gloo())


class UpdateWeightFromDiskDelta(UpdateWeightFromDistributed):
    """``update_weight_from_disk_delta.py``: a baseline first, then each version's delta files, pull, reload."""

    def __init__(
        self, args: Namespace, model: Any, weights_getter: Any, *, model_name: str, quantization_config: Any
    ) -> None:
        super().__init__(args, model, weights_getter, model_name=model_name, quantization_config=quantization_config)
        self.delta_dir = args.update_weight_disk_dir
        os.makedirs(self.delta_dir, exist_ok=True)
        self._snapshot: dict[str, str] = {}
        self._baseline_captured = False

    def connect_rollout_engines(
        self,
        rollout_engines: Any,
        rollout_engine_lock: Any,
        engine_gpu_counts: Any = None,
        engine_gpu_offsets: Any = None,
        engine_parallel_configs: Any = None,
    ) -> None:
        self.rollout_engines = rollout_engines
        self._is_pp_src_rank = _g.dist.get_rank() == 0

    def update_weights(self) -> None:
        if not self._baseline_captured:
            self._capture_baseline()
            self._baseline_captured = True
            return
        self.weight_version += 1
        self._publish()
        self._reload_engines()

    def _capture_baseline(self) -> None:
        dist, gloo = _g.dist, _g.get_gloo_group
        pulls = []
        if dist.get_rank() == 0:
            import shutil

            shutil.rmtree(self.delta_dir, ignore_errors=True)
            os.makedirs(self.delta_dir, exist_ok=True)
            pulls = [engine.pull_weights.remote(target_version=0) for engine in self.rollout_engines]
        dist.barrier(group=gloo())
        self._snapshot = dict(self.model.named_params())
        if dist.get_rank() == 0:
            ray.get(pulls)

    def _publish(self) -> None:
        dist, gloo = _g.dist, _g.get_gloo_group
        self._version_dir = os.path.join(self.delta_dir, f"weight_v{self.weight_version:06d}")
        os.makedirs(self._version_dir, exist_ok=True)
        now = dict(self.model.named_params())
        delta = {name: value for name, value in now.items() if self._snapshot.get(name) != value}
        self._snapshot = now
        dist.barrier(group=gloo())
        counts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(counts, int(bool(delta)), group=gloo())
        rank = dist.get_rank()
        if delta and rank == 0:  # one writing rank here (the others hold replicas)
            Path(self._version_dir, f"model-{rank:05d}.json").write_text(json.dumps(delta))
        if rank == 0:
            Path(self._version_dir, "model.safetensors.index.json").write_text(
                json.dumps({"version": self.weight_version})
            )
        dist.barrier(group=gloo())

    def _reload_engines(self) -> None:
        dist, gloo = _g.dist, _g.get_gloo_group
        dist.barrier(group=gloo())
        if dist.get_rank() == 0:
            ray.get([engine.pull_weights.remote(self.weight_version) for engine in self.rollout_engines])
            ray.get([engine.pause_generation.remote() for engine in self.rollout_engines])
            ray.get([engine.flush_cache.remote() for engine in self.rollout_engines])
            ray.get(
                [
                    engine.update_weights_from_disk.remote(
                        model_path=f"{self.args.update_weight_local_checkpoint_dir}@{self._version_dir}",
                        weight_version=str(self.weight_version),
                    )
                    for engine in self.rollout_engines
                ]
            )
            ray.get([engine.continue_generation.remote() for engine in self.rollout_engines])
        dist.barrier(group=gloo())


class _Globals:
    """The rank process' ``dist`` and ``get_gloo_group``, as slime's modules import them."""

    dist: Any = None
    gloo_group: Any = None

    def get_gloo_group(self) -> Any:
        return self.gloo_group


_g = _Globals()


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def install_slime_modules(dist: Any, gloo_group: Any) -> None:
    """Register slime's updater modules (their globals: ``dist``, ``ray``, ``get_gloo_group``) in this process."""
    _g.dist, _g.gloo_group = dist, gloo_group
    runtime = {"dist": dist, "ray": ray, "get_gloo_group": _g.get_gloo_group}
    modules = [
        _module(
            f"{_UW}.update_weight_from_distributed", UpdateWeightFromDistributed=UpdateWeightFromDistributed, **runtime
        ),
        _module(f"{_UW}.update_weight_from_tensor", UpdateWeightFromTensor=UpdateWeightFromTensor, **runtime),
        _module(f"{_UW}.update_weight_from_disk_delta", UpdateWeightFromDiskDelta=UpdateWeightFromDiskDelta, **runtime),
    ]
    for parent in ("slime", "slime.backends", "slime.backends.megatron_utils", _UW):
        sys.modules.setdefault(parent, _module(parent, __path__=[]))
    for m in modules:
        sys.modules[m.__name__] = m


def load_function(path: str) -> Any:
    """``slime.utils.misc.load_function``."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class EngineInfo:
    """What ``rollout_manager.get_updatable_engines_and_lock`` answers, as the driver hands it to the ranks.

    ``generation`` changes when an engine is replaced (the ranks then make new handles, as new Ray actors).
    """

    urls: tuple[str, ...]
    num_new_engines: int
    generation: int


class MegatronTrainRayActor:
    """``slime/backends/megatron_utils/actor.py``: one rank of the training job."""

    def __init__(self) -> None:
        self.model = FakeModel()
        self.weight_updater: Any = None
        self._handles: tuple[int, list[ActorHandle], ActorHandle] | None = None

    def init(self, args: Namespace) -> int:
        self.args = args
        if getattr(args, "custom_megatron_init_path", None):  # initialize.py:100-104, on every rank
            load_function(args.custom_megatron_init_path)(args)
        if args.update_weight_mode == "delta":
            cls = importlib.import_module(f"{_UW}.update_weight_from_disk_delta").UpdateWeightFromDiskDelta
        elif args.colocate:
            cls = importlib.import_module(f"{_UW}.update_weight_from_tensor").UpdateWeightFromTensor
        else:
            cls = importlib.import_module(f"{_UW}.update_weight_from_distributed").UpdateWeightFromDistributed
        self.weight_updater = cls(args, self.model, lambda: {}, model_name="qwen3", quantization_config=None)
        self.weight_updater.weight_version = getattr(self.args, "update_weight_start_version", 0)  # actor.py:183
        return args.start_rollout_id

    def train(self, rollout_id: int) -> None:
        self.model.step = rollout_id + 1

    def _engines(self, info: EngineInfo) -> tuple[list[ActorHandle], ActorHandle]:
        if self._handles is None or self._handles[0] != info.generation:
            self._handles = (info.generation, [ActorHandle(SGLangEngine(u)) for u in info.urls], ActorHandle(_Lock()))
        return self._handles[1], self._handles[2]

    def update_weights(self, info: EngineInfo) -> int:
        dist, gloo = _g.dist, _g.get_gloo_group
        engines, lock = self._engines(info)  # ray.get(rollout_manager.get_updatable_engines_and_lock.remote())
        if info.num_new_engines > 0:
            self.weight_updater.connect_rollout_engines(engines, lock, engine_gpu_counts=None, engine_gpu_offsets=None)
            dist.barrier(group=gloo())
        self.weight_updater.update_weights()
        return int(self.weight_updater.weight_version)

    def engine_calls(self) -> list[list[str]]:
        """What this rank's engine handles were asked, per engine (the test reads it)."""
        handles = self._handles[1] if self._handles is not None else []
        return [list(h._obj.calls) for h in handles]


def rank_main(rank: int, world: int, port: int, conn: Any, env: dict[str, str], path: list[str]) -> None:
    """A rank process: gloo on ``port``, slime's modules, then the actor's calls from the driver until EOF.

    ``env`` and ``path`` are the driver's environment and ``sys.path`` when it started the rank (what a spawned
    process inherits): a process forked from the fork server would otherwise see the server's.
    """
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    install_slime_modules(dist, dist.new_group(backend="gloo"))
    actor = MegatronTrainRayActor()
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        try:
            conn.send(("ok", getattr(actor, method)(*args)))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# -- the driver side, in the test process ------------------------------------------------------------------


#: What every rank imports before it starts: loaded once, in the fork server, instead of once per rank.
_RANK_PRELOAD = ("torch.distributed", __name__)


def _rank_context() -> Any:
    """The rank processes' start method: ``forkserver``, its server preloading torch and this module.

    Each rank is still a new process of its own with no process group (the server only imports), but forking it
    from the server that already imported torch takes a fraction of a second, where a spawned one imports torch
    again every time (seconds on two cores).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_RANK_PRELOAD))
    return ctx


class _RankProcess:
    """One rank's process as a Ray actor handle: ``actor.<method>.remote(*args)`` returns an ``ObjectRef``."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        ctx = _rank_context()
        self._conn, child = ctx.Pipe()
        env, path = dict(os.environ), list(sys.path)
        self.process = ctx.Process(target=rank_main, args=(rank, world, port, child, env, path), daemon=True)
        self.process.start()
        child.close()
        self._lock = threading.Lock()
        self._pending: list[Future[Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                status, value = self._conn.recv()
            except (EOFError, OSError):
                with self._lock:
                    for future in self._pending:
                        future.set_exception(RuntimeError("the rank process died"))
                    self._pending.clear()
                return
            with self._lock:
                future = self._pending.pop(0)
            if status == "ok":
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(value))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        proc = self

        class _Method:
            def remote(self, *args: Any) -> ObjectRef:
                future: Future[Any] = Future()
                with proc._lock:
                    proc._pending.append(future)
                    proc._conn.send((name, args))
                return ObjectRef(future)

        return _Method()

    def kill(self) -> None:
        self._conn.close()
        self.process.kill()
        self.process.join(10)


class RolloutManager:
    """The driver's rollout manager, as far as the weight update reads it: its (external) engines.

    ``generate`` records, per rollout, the label each engine serves then (what its samples' ``weight_versions``
    would say).
    """

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self.num_new_engines = len(urls)  # a new driver connects every engine first
        self.generation = 0
        self.generated: list[tuple[int, list[str]]] = []

    def replace_engine(self) -> None:
        """An engine came back from a restart: the next update reconnects (new handles)."""
        self.num_new_engines = 1
        self.generation += 1

    def get_updatable_engines_and_lock(self) -> EngineInfo:
        return EngineInfo(tuple(self.urls), self.num_new_engines, self.generation)

    def clear_updatable_num_new_engines(self) -> None:
        self.num_new_engines = 0

    def generate(self, rollout_id: int) -> int:
        labels = [str(httpx.get(f"{u}/model_info", timeout=10).json()["weight_version"]) for u in self.urls]
        self.generated.append((rollout_id, labels))
        return rollout_id


class RayTrainGroup:
    """``slime/ray/actor_group.py``: the driver's group of rank processes (its weight-update part)."""

    def __init__(self, args: Namespace, world_size: int, rollout_manager: RolloutManager) -> None:
        self.args = args
        self.world_size = world_size
        self._rollout_manager = rollout_manager
        self._disk_weight_version = getattr(args, "update_weight_start_version", 0)
        self._actor_handlers: list[_RankProcess] = []
        self.versions: list[list[int]] = []  # every rank's updater count after each update

    def create(self) -> Any:
        if self._actor_handlers:
            return None
        from weightbus.embedded.server import free_port

        self.args.update_weight_start_version = self._disk_weight_version  # actor_group.py:193
        port = free_port()
        self._actor_handlers = [_RankProcess(rank, self.world_size, port) for rank in range(self.world_size)]
        return ray.get([a.init.remote(self.args) for a in self._actor_handlers], timeout=120)

    def async_train(self, rollout_id: int, rollout_data_ref: Any) -> list[ObjectRef]:
        return [a.train.remote(rollout_id) for a in self._actor_handlers]

    def update_weights(self) -> None:
        info = self._rollout_manager.get_updatable_engines_and_lock()
        self.versions.append(ray.get([a.update_weights.remote(info) for a in self._actor_handlers], timeout=60))
        if info.num_new_engines:
            self._rollout_manager.clear_updatable_num_new_engines()  # rank 0 does, once connected

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        return None

    def engine_calls(self) -> list[list[str]]:
        """Rank 0's engine handles' calls (per engine)."""
        return ray.get(self._actor_handlers[0].engine_calls.remote())

    def kill(self) -> None:
        for actor in self._actor_handlers:
            actor.kill()
        self._actor_handlers = []


def should_run_periodic_action(
    rollout_id: int, interval: int | None, num_rollout_per_epoch: Any = None, num_rollout: Any = None
) -> bool:
    """``slime.utils.misc.should_run_periodic_action`` (the save/eval cadence)."""
    return interval is not None and (rollout_id + 1) % interval == 0


def train_async(args: Namespace, actor_model: RayTrainGroup, rollout_manager: RolloutManager) -> None:
    """``train_async.py``'s ``train`` (no critic, no eval): the initial push, then every ``update_weights_interval``."""
    rm = ActorHandle(rollout_manager)
    actor_model.create()
    actor_model.update_weights()  # "Always push actor weights to rollout once weights are loaded."
    rollout_data_next_future: ObjectRef | None = rm.generate.remote(args.start_rollout_id)
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        if rollout_data_next_future is not None:
            rollout_data_curr_ref = ray.get(rollout_data_next_future)
        if rollout_id + 1 < args.num_rollout:
            rollout_data_next_future = rm.generate.remote(rollout_id + 1)
        ray.get(actor_model.async_train(rollout_id, rollout_data_curr_ref), timeout=60)
        if should_run_periodic_action(rollout_id, args.save_interval):
            actor_model.save_model(rollout_id)
        if (rollout_id + 1) % args.update_weights_interval == 0:
            rollout_data_curr_ref = ray.get(x) if (x := rollout_data_next_future) is not None else None
            rollout_data_next_future = None
            actor_model.update_weights()


def make_trainer_args(**overrides: Any) -> Namespace:
    """slime's arguments the trainer side reads."""
    base: dict[str, Any] = dict(
        custom_megatron_init_path="weightbus.integrations.slime.install",
        update_weight_mode="full",
        update_weight_transport="nccl",
        update_weight_disk_dir=None,
        update_weight_local_checkpoint_dir="/ckpt/local",
        colocate=False,
        start_rollout_id=0,
        num_rollout=2,
        update_weights_interval=1,
        save_interval=None,
        check_weight_update_equal=False,
        enable_lora=False,
    )
    base.update(overrides)
    return Namespace(**base)
