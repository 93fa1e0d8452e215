"""Ray as the host stand-ins use it: actor handles whose ``method.remote(...)`` returns an ``ObjectRef``, and
``get``/``put``.

``ActorHandle`` wraps an object and runs each call on the actor's own thread (one call at a time, as a Ray actor);
a handle answers only its public methods (as the stand-ins' actors expose them); ``get`` raises ``RayTaskError``
for a failed call, its cause chained. Shared by the miles and slime stand-ins.
"""

from __future__ import annotations

import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["ActorHandle", "ObjectRef", "RayTaskError", "get", "put"]


class RayTaskError(RuntimeError):
    """What ``ray.get`` raises for a task that failed (the cause is chained)."""


class ObjectRef:
    def __init__(self, future: Future[Any]) -> None:
        self.future = future


class _ActorId:
    def __init__(self) -> None:
        self._hex = uuid.uuid4().hex[:16]

    def hex(self) -> str:
        return self._hex


class _ActorMethod:
    def __init__(self, actor: ActorHandle, name: str) -> None:
        self._actor, self._name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> ObjectRef:
        fn = getattr(self._actor._obj, self._name)
        return ObjectRef(self._actor._executor.submit(fn, *args, **kwargs))

    def options(self, **_: Any) -> _ActorMethod:
        return self


class ActorHandle:
    """A Ray actor handle: ``handle.method.remote(...)`` runs on the actor's thread, one call at a time."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._actor_id = _ActorId()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"actor-{type(obj).__name__}")

    def __getattr__(self, name: str) -> _ActorMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _ActorMethod(self, name)

    def kill(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def get(refs: Any, timeout: float | None = 30.0) -> Any:
    """``ray.get``: wait for ``refs`` (one or a list); a failed task raises ``RayTaskError``."""
    if isinstance(refs, list):
        return [get(r, timeout) for r in refs]
    try:
        return refs.future.result(timeout)
    except Exception as exc:
        raise RayTaskError(f"the task failed: {type(exc).__name__}: {exc}") from exc


def put(value: Any) -> ObjectRef:
    """``ray.put``: a ref that is ready."""
    future: Future[Any] = Future()
    future.set_result(value)
    return ObjectRef(future)
