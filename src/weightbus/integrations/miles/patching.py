"""``install(args)``: check the miles it finds, then patch every weight updater to run under weightbus.

All or nothing: anything the patches rely on that is missing or different raises ``InstallError`` (a silent bus
``BusConnectError``) before anything is patched; ``uninstall()`` restores every method.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

from weightbus.errors import (
    InstallError,
)
from weightbus.integrations.miles.config import MilesSettings
from weightbus.integrations.miles.trainer import LORA_NAME, Kind, MilesTrainer, Runtime

__all__ = ["FSDP_TARGETS", "MEGATRON_TARGETS", "MILES_COMMIT", "install", "install_fsdp", "installed", "uninstall"]

log = logging.getLogger("weightbus.integrations.miles")

#: The miles commit the patches were written against (main, 2026-08-21).
MILES_COMMIT: Final = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"

_UW: Final = "miles.backends.megatron_utils.update_weight"
_MIXIN: Final = f"{_UW}.update_weight_from_distributed.mixin"
_BROADCAST: Final = f"{_UW}.update_weight_from_distributed.broadcast"
_P2P: Final = f"{_UW}.update_weight_from_distributed.p2p"
_DELTA: Final = f"{_UW}.update_weight_from_distributed.delta"
_TENSOR: Final = f"{_UW}.update_weight_from_tensor"
_FSDP: Final = "miles.backends.fsdp_utils.update_weight_utils"

_CONNECT: Final = ("rollout_engines", "rollout_engine_lock", "engine_gpu_counts", "engine_gpu_offsets")


@dataclass(frozen=True, slots=True)
class _Target:
    """One miles class the install relies on: what must exist, and whether its ``update_weights`` is wrapped."""

    module: str
    name: str
    kind: Kind
    wrap: bool
    methods: tuple[tuple[str, tuple[str, ...]], ...]
    inherits: str | None = None  # a class of the same install whose update_weights this one must inherit
    lazy: bool = False  # miles imports the module only when the updater is selected


_SELF: Final = ("self",)

MEGATRON_TARGETS: Final = (
    _Target(
        _MIXIN,
        "DistBucketedWeightUpdateMixin",
        "mixin",
        True,
        (
            ("update_weights", _SELF),
            ("_pause_and_prepare_engines", _SELF),
            ("_finalize_and_resume_engines", _SELF),
            ("_update_lora_weights", _SELF),
            ("_update_multi_lora_weights", _SELF),
        ),
    ),
    _Target(
        _BROADCAST,
        "UpdateWeightFromDistributed",
        "mixin",
        False,
        (("connect_rollout_engines", ("self", *_CONNECT)),),
        inherits="DistBucketedWeightUpdateMixin",
    ),
    _Target(
        _P2P,
        "UpdateWeightP2P",
        "mixin",
        False,
        (("connect_rollout_engines", ("self", *_CONNECT)),),
        inherits="DistBucketedWeightUpdateMixin",
    ),
    _Target(
        _DELTA,
        "UpdateWeightFromDiskDelta",
        "delta",
        True,
        (
            ("update_weights", _SELF),
            ("_capture_baseline", _SELF),
            ("_reload_engines", _SELF),
            ("connect_rollout_engines", ("self", *_CONNECT)),
        ),
        lazy=True,
    ),
    _Target(
        _TENSOR,
        "UpdateWeightFromTensor",
        "tensor",
        True,
        (("update_weights", _SELF), ("connect_rollout_engines", ("self", *_CONNECT))),
    ),
)

FSDP_TARGETS: Final = (
    _Target(
        _FSDP,
        "UpdateWeight",
        "fsdp",
        True,
        (("update_weights", _SELF), ("connect_rollout_engines", ("self", *_CONNECT))),
    ),
    _Target(_FSDP, "UpdateWeightFromTensor", "fsdp", False, (), inherits="UpdateWeight"),
    _Target(_FSDP, "UpdateWeightFromDistributed", "fsdp", False, (), inherits="UpdateWeight"),
)


# A bus that does not answer is retried; a bus that answers "no" is not.
@dataclass(slots=True)
class _Found:
    target: _Target
    cls: type
    runtime: Runtime | None  # for the classes whose update_weights is wrapped


# -- the install -------------------------------------------------------------------------------------------


_LOCK = threading.Lock()
_STATE: MilesTrainer | None = None
_PATCHED: list[tuple[type, Callable[..., Any]]] = []
_HOOK: _ImportHook | None = None


def installed() -> MilesTrainer | None:
    """The process' installed integration, or None."""
    return _STATE


def install(args: Any) -> MilesTrainer:
    """miles' ``--custom-megatron-init-path`` entry point: put weightbus in charge of every Megatron updater.

    Call once per training actor (miles does); a second call in the same process returns the first
    install. Rank 0 connects to the bus here, so an unreachable bus fails the actor's init.

    Args:
        args: miles' argument namespace (settings: ``weightbus.integrations.miles.config``).

    Returns:
        The installed integration.

    Raises:
        InstallError: a class, method, signature or module global the patches rely on is missing or
            different (nothing was patched).
        ValueError: no policy, or a setting that is not valid.
        BusConnectError: rank 0 could not reach NATS within the connect timeout (nothing was patched).
    """
    return _install(args, MEGATRON_TARGETS)


def install_fsdp(args: Any = None) -> None:
    """The FSDP equivalent of ``install``, for a ``sitecustomize`` or launcher (FSDP actors have no init hook).

    ``import weightbus.integrations.miles as wb; wb.install_fsdp()`` patches miles' FSDP updater now
    if its module is imported, else right after it is (an import hook; the import raises
    ``InstallError`` if it does not fit). Settings come from the environment (``args`` None) or
    ``args``; the bus is connected by rank 0's first update, not at import.

    Raises:
        InstallError, ValueError: as ``install``, when the module is already imported.
    """
    global _HOOK
    MilesSettings.from_args(args)  # a missing policy fails here, in the launcher, not in the actor
    if _FSDP in sys.modules:
        _install(args, FSDP_TARGETS, connect=False)
        return
    with _LOCK:
        if _HOOK is None:
            _HOOK = _ImportHook(_FSDP, lambda: _install(args, FSDP_TARGETS, connect=False))
            sys.meta_path.insert(0, _HOOK)


def uninstall() -> None:
    """Restore every patched method, remove the FSDP import hook, and close the bus (tests, notebooks)."""
    global _STATE, _HOOK
    with _LOCK:
        for cls, original in reversed(_PATCHED):
            cls.update_weights = original
        _PATCHED.clear()
        if _HOOK is not None and _HOOK in sys.meta_path:
            sys.meta_path.remove(_HOOK)
        _HOOK = None
        state, _STATE = _STATE, None
    if state is not None:
        state.close()


def _install(args: Any, targets: Sequence[_Target], *, connect: bool = True) -> MilesTrainer:
    global _STATE
    with _LOCK:
        settings = MilesSettings.from_args(args)
        found, problems = _inspect(targets)
        if problems:
            raise InstallError("miles", f"miles main@{MILES_COMMIT[:9]}", problems)
        state = _STATE
        if state is None:
            state = MilesTrainer(args, settings)
        elif state.settings.policy != settings.policy:
            raise ValueError(
                f"weightbus is already installed for policy {state.settings.policy!r}, not {settings.policy!r}"
            )
        runtimes = [f.runtime for f in found if f.runtime is not None]
        if connect and runtimes:
            state.connect_if_rank0(runtimes[0])  # before patching: a dead bus patches nothing
        for item in found:
            if item.runtime is not None and not hasattr(vars(item.cls)["update_weights"], "__weightbus_original__"):
                original = vars(item.cls)["update_weights"]
                item.cls.update_weights = _wrap(original, item.target.kind, item.runtime)  # type: ignore[attr-defined]
                _PATCHED.append((item.cls, original))
            if item.target.name == "UpdateWeightFromDistributed":
                state.labelling.add(item.cls)
        _STATE = state
        log.info(
            "weightbus is in charge of miles' weight updates",
            extra={"policy": settings.policy, "classes": [f"{f.cls.__module__}.{f.cls.__name__}" for f in found]},
        )
        return state


def _inspect(targets: Sequence[_Target]) -> tuple[list[_Found], list[str]]:
    """Every target resolved, or one line per thing that is missing or different."""
    problems: list[str] = []
    found: list[_Found] = []
    classes: dict[str, type] = {}
    for target in targets:
        where = f"{target.module}.{target.name}"
        try:
            module = importlib.import_module(target.module)
        except ImportError as exc:
            missing_module = (
                isinstance(exc, ModuleNotFoundError)
                and exc.name is not None
                and (target.module == exc.name or target.module.startswith(f"{exc.name}."))
            )
            if target.lazy and not missing_module:
                # miles imports this updater only when it is selected; a dependency it lacks (the disk
                # delta's zstandard) makes that updater unusable for miles too: nothing to patch.
                log.warning(
                    "miles' %s cannot be imported here (%s); that updater is not patched and miles cannot build it",
                    target.name,
                    exc,
                )
                continue
            problems.append(f"module {target.module} (for {target.name}) cannot be imported: {exc}")
            continue
        cls = getattr(module, target.name, None)
        if not isinstance(cls, type):
            problems.append(f"class {where} is missing")
            continue
        classes[target.name] = cls
        for method, params in target.methods:
            fn = inspect.getattr_static(cls, method, None)
            fn = getattr(fn, "__weightbus_original__", fn)
            if not callable(fn):
                problems.append(f"method {where}.{method}{_show(params)} is missing")
                continue
            have = tuple(inspect.signature(fn).parameters)
            if have != params:
                problems.append(f"method {where}.{method} has the signature {_show(have)}, expected {_show(params)}")
        if target.inherits is not None:
            base = classes.get(target.inherits)
            if base is not None and not issubclass(cls, base):
                problems.append(f"class {where} no longer derives from {target.inherits}")
            elif "update_weights" in vars(cls):
                problems.append(f"class {where} defines its own update_weights (expected {target.inherits}'s)")
        runtime: Runtime | None = None
        if target.wrap:
            runtime, missing = _runtime(module)
            problems.extend(f"module {target.module}: {m}" for m in missing)
        found.append(_Found(target, cls, runtime))
    return found, problems


def _show(params: Sequence[str]) -> str:
    return f"({', '.join(params)})"


def _runtime(module: ModuleType) -> tuple[Runtime | None, list[str]]:
    names = vars(module)
    missing: list[str] = []
    # miles' module globals, untyped: each is checked below before it is used.
    dist: Any = names.get("dist")
    gloo: Any = names.get("get_gloo_group")
    ray: Any = names.get("ray")
    for attr in ("get_rank", "broadcast_object_list"):
        if not callable(getattr(dist, attr, None)):
            missing.append(f"the global dist (torch.distributed) has no {attr}()")
    if not callable(gloo):
        missing.append("the global get_gloo_group() is missing")
    if not callable(getattr(ray, "get", None)):
        missing.append("the global ray has no get()")
    if missing:
        return None, missing
    lora = names.get("LORA_ADAPTER_NAME")
    # Optional: where miles' group put the cell (only a cell miles picked again claims again once fenced).
    state, context = names.get("get_parallel_state"), getattr(ray, "get_runtime_context", None)
    return Runtime(
        dist,
        gloo,
        ray.get,
        lora if isinstance(lora, str) else LORA_NAME,
        parallel_state=state if callable(state) else None,
        runtime_context=context if callable(context) else None,
    ), []


def _wrap(original: Callable[..., Any], kind: Kind, runtime: Runtime) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_weights(self: Any) -> None:
        state = _STATE
        if state is None:
            raise RuntimeError("weightbus' miles integration was uninstalled; its patch should be gone too")
        state.update(self, original, kind, runtime)

    update_weights.__weightbus_original__ = original  # type: ignore[attr-defined]
    return update_weights


class _ImportHook(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after module ``name`` has executed (its import raises what ``then`` raises)."""

    def __init__(self, name: str, then: Callable[[], Any]) -> None:
        self._name = name
        self._then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self._name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader, then = spec.loader, self._then

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                sys.modules[fullname] = module  # the install imports it by name
                then()

        spec.loader = _Loader()
        return spec
