"""The install machinery every host drop-in uses: check the host it finds, then wrap its updaters' ``update_weights``.

All or nothing: anything the patches rely on that is missing or different raises ``InstallError`` (a silent bus
``BusConnectError``) before anything is patched; ``Installer.uninstall`` restores every method. A host names its
targets (``Target``: a class, the methods and signatures it must have, whether its ``update_weights`` is wrapped)
and how its module globals become a ``Runtime``; the rest is here once.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, TypeVar

from weightbus.errors import InstallError
from weightbus.integrations.host.identity import Host
from weightbus.integrations.host.runtime import Runtime
from weightbus.integrations.host.settings import DropInSettings
from weightbus.integrations.host.trainer import HostTrainer

__all__ = ["ImportHook", "Installer", "Target", "globals_runtime"]

_T = TypeVar("_T", bound=HostTrainer)

#: Reads a patched module's globals into a ``Runtime``, or the lines saying what is missing.
RuntimeOf = Callable[[ModuleType], tuple[Runtime | None, list[str]]]


@dataclass(frozen=True, slots=True)
class Target:
    """One host class the install relies on: what must exist, and whether its ``update_weights`` is wrapped.

    Attributes:
        module, name: where the class is.
        kind: what the host's ``plan`` reads (``HostTrainer.update``'s ``kind``; ``trainer.DELTA`` for a disk delta).
        wrap: its own ``update_weights`` is wrapped.
        methods: each method that must exist, with its parameter names.
        inherits: a class of the same install whose ``update_weights`` this one must inherit.
        lazy: the host imports the module only when the updater is selected (a dependency it lacks skips it).
    """

    module: str
    name: str
    kind: str
    wrap: bool
    methods: tuple[tuple[str, tuple[str, ...]], ...]
    inherits: str | None = None
    lazy: bool = False


@dataclass(slots=True)
class _Found:
    target: Target
    cls: type
    runtime: Runtime | None  # for the classes whose update_weights is wrapped


class Installer(Generic[_T]):
    """One host's install in this process: its trainer, the methods it patched, its import hook.

    Args:
        host: the host.
        trainer: the host's ``HostTrainer`` subclass.
        settings: the host's ``DropInSettings`` subclass.
        runtime_of: how a wrapped class's module globals become a ``Runtime``.
    """

    def __init__(self, host: Host, trainer: type[_T], settings: type[DropInSettings], runtime_of: RuntimeOf) -> None:
        self.host = host
        self._trainer = trainer
        self._settings = settings
        self._runtime_of = runtime_of
        self._lock = threading.Lock()
        self._state: _T | None = None
        self._patched: list[tuple[type, Callable[..., Any]]] = []
        self._hook: ImportHook | None = None

    def installed(self) -> _T | None:
        """The process' installed integration, or None."""
        return self._state

    def install(self, args: Any, targets: Sequence[Target], *, connect: bool = True) -> _T:
        """Check every target, connect rank 0 (``connect``), then wrap every target's ``update_weights``.

        A second call in the same process returns the first install (for the same policy).

        Raises:
            InstallError: a class, method, signature or module global the patches rely on is missing or
                different (nothing was patched).
            ValueError: no policy, a setting that is not valid, or another policy already installed.
            BusConnectError: rank 0 could not reach NATS within the connect timeout (nothing was patched).
        """
        with self._lock:
            settings = self._settings.from_args(args)
            found, problems = self._inspect(targets)
            if problems:
                raise InstallError(self.host.name, self.host.checked, problems)
            state = self._state
            if state is None:
                state = self._trainer(args, settings)
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
                    item.cls.update_weights = self._wrap(original, item.target.kind, item.runtime)  # type: ignore[attr-defined]
                    self._patched.append((item.cls, original))
                state.found(item.target.name, item.cls)
            self._state = state
            self.host.log.info(
                f"weightbus is in charge of the weight updates of {self.host.name}",
                extra={"policy": settings.policy, "classes": [f"{f.cls.__module__}.{f.cls.__name__}" for f in found]},
            )
            return state

    def install_on_import(self, module: str, then: Callable[[], Any]) -> None:
        """Run ``then()`` right after ``module`` is imported (now, if it already is)."""
        if module in sys.modules:
            then()
            return
        with self._lock:
            if self._hook is None:
                self._hook = ImportHook(module, then)
                sys.meta_path.insert(0, self._hook)

    def uninstall(self) -> None:
        """Restore every patched method, remove the import hook, and close the bus (tests, notebooks)."""
        with self._lock:
            for cls, original in reversed(self._patched):
                cls.update_weights = original
            self._patched.clear()
            if self._hook is not None and self._hook in sys.meta_path:
                sys.meta_path.remove(self._hook)
            self._hook = None
            state, self._state = self._state, None
        if state is not None:
            state.close()

    def _inspect(self, targets: Sequence[Target]) -> tuple[list[_Found], list[str]]:
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
                    # The host imports this updater only when it is selected; a dependency it lacks (the disk
                    # delta's zstandard) makes that updater unusable for the host too: nothing to patch.
                    self.host.log.warning(
                        "%s cannot be imported here (%s); that updater is not patched and %s cannot build it",
                        target.name,
                        exc,
                        self.host.name,
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
                    problems.append(
                        f"method {where}.{method} has the signature {_show(have)}, expected {_show(params)}"
                    )
            if target.inherits is not None:
                base = classes.get(target.inherits)
                if base is not None and not issubclass(cls, base):
                    problems.append(f"class {where} no longer derives from {target.inherits}")
                elif "update_weights" in vars(cls):
                    problems.append(f"class {where} defines its own update_weights (expected {target.inherits}'s)")
            runtime: Runtime | None = None
            if target.wrap:
                runtime, missing = self._runtime_of(module)
                problems.extend(f"module {target.module}: {m}" for m in missing)
            found.append(_Found(target, cls, runtime))
        return found, problems

    def _wrap(self, original: Callable[..., Any], kind: str, runtime: Runtime) -> Callable[..., Any]:
        installer = self

        @functools.wraps(original)
        def update_weights(self: Any) -> None:
            state = installer._state
            if state is None:
                raise RuntimeError(
                    f"weightbus' {installer.host.name} integration was uninstalled; its patch should be gone too"
                )
            state.update(self, original, kind, runtime)

        update_weights.__weightbus_original__ = original  # type: ignore[attr-defined]
        return update_weights


def _show(params: Sequence[str]) -> str:
    return f"({', '.join(params)})"


def globals_runtime(module: ModuleType, lora_name: str) -> tuple[Runtime | None, list[str], dict[str, Any]]:
    """A host module's ``dist`` (torch.distributed), ``get_gloo_group`` and ``ray`` as a ``Runtime``.

    Returns:
        The runtime (None when something is missing), one line per missing global, and the module's globals
        (for what a host reads on top: its adapter name, its parallel state).
    """
    names = vars(module)
    missing: list[str] = []
    # The host's module globals, untyped: each is checked below before it is used.
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
        return None, missing, names
    return Runtime(dist, gloo, ray.get, lora_name), [], names


class ImportHook(importlib.abc.MetaPathFinder):
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
