"""Engine handles whose calls go through an update: rank 0's handles for the length of a host's ``update_weights``.

``proxied`` swaps the updater's ``rollout_engines`` (and ``distributed_rollout_engines``) for proxies
and puts the real handles back afterwards, whatever happens; a proxy hands the calls named in
``names`` to the interceptor (``.remote`` and ``.options(...).remote``), passes every other attribute
through, and pickles as the real handle (Ray never ships a proxy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

__all__ = ["EngineProxy", "Interceptor", "ProxyMethod", "proxied", "real_handle"]


class Interceptor(Protocol):
    """What a proxied call does instead: ``handle.<name>.remote(*args, **kwargs)`` becomes ``intercept(...)``."""

    def intercept(self, name: str, handle: Any, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class EngineProxy:
    """An engine handle whose calls named in ``names`` go through ``session``; pickles as the real handle."""

    def __init__(self, handle: Any, session: Interceptor, names: frozenset[str]) -> None:
        self._handle = handle
        self._session = session
        self._names = names

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._handle, name)
        if name in self._names:
            return ProxyMethod(self._handle, name, attr, self._session)
        return attr

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return (_identity, (self._handle,))


class ProxyMethod:
    """One intercepted method of an ``EngineProxy``: ``remote`` goes to the interceptor."""

    def __init__(self, handle: Any, name: str, method: Any, session: Interceptor) -> None:
        self._handle, self._name, self._method, self._session = handle, name, method, session

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._session.intercept(self._name, self._handle, self._method, args, kwargs)

    def options(self, **options: Any) -> ProxyMethod:
        return ProxyMethod(self._handle, self._name, self._method.options(**options), self._session)


def _identity(value: Any) -> Any:
    return value


def real_handle(handle: Any) -> Any:
    """The real engine handle behind ``handle`` (``handle`` itself when it is not a proxy)."""
    return handle._handle if isinstance(handle, EngineProxy) else handle


@contextmanager
def proxied(updater: Any, session: Interceptor | None, names: frozenset[str]) -> Iterator[None]:
    """Rank 0's engine handles as proxies for the length of the host's update (other ranks: unchanged)."""
    if session is None:
        yield
        return
    attrs = [a for a in ("rollout_engines", "distributed_rollout_engines") if getattr(updater, a, None) is not None]
    saved = {a: getattr(updater, a) for a in attrs}
    for a in attrs:
        setattr(updater, a, [EngineProxy(h, session, names) for h in saved[a]])
    try:
        yield
    finally:
        for a in attrs:
            setattr(updater, a, saved[a])
