"""A host's rollout engines as a weightbus ``EngineFleet``, reached from the Ray actor handles the host connected.

How a host's engine handle is reached is the host's ``EngineReach``: ``ray_engines`` calls the handle's own
label methods (miles' ``SGLangEngine`` has ``update_weight_version`` and ``pause_generation(mode=...)``);
``http_engines`` asks each handle for its URL (``get_url``) and talks to the engine with weightbus'
``SGLangClient`` (slime's ``SGLangEngine`` has no relabel method). Either way a handle that is not an engine's
node 0 (it answers None) is left out, every failure or timeout is an ``EngineError`` naming the engine,
blocking calls run in worker threads, and ``ray`` is never imported (the caller passes ``ray.get``).
See docs/integrations/miles.md#how-it-installs-and-when-it-refuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from weightbus.engines.sglang import PauseMode, SGLangClient
from weightbus.errors import EngineError
from weightbus.producers.fleet import EngineFleet

__all__ = ["EngineReach", "HandleFleet", "RayEngine", "engine_name", "http_engines", "ray_engines"]

log = logging.getLogger("weightbus.integrations")

_TIMEOUT: Final = 120.0

#: How a host's handles become the fleet's engines: ``(handles, ray_get, timeout, host name) -> engines`` (each
#: with the ``handle`` it came from; a handle that is not an engine's node 0 is left out).
EngineReach = Callable[[Sequence[Any], Callable[[Any], Any], float, str], Awaitable[list[Any]]]


def engine_name(handle: Any, index: int, host: str) -> str:
    """The engine's name on the bus: ``ray://<actor id>``, else ``<host>-engine-<index>``."""
    actor_id = getattr(handle, "_actor_id", None)
    hex_id = getattr(actor_id, "hex", None)
    if callable(hex_id):
        return f"ray://{hex_id()}"
    return f"{host}-engine-{index}"


class RayEngine:
    """One engine with the engine surface ``EngineFleet`` uses (``SGLangClient``'s label methods), by its handle.

    Args:
        handle: the engine's Ray actor handle (miles' ``SGLangEngine``).
        url: its name on the bus (``engine_name``).
        ray_get: ``ray.get`` as the host imports it.
        timeout: seconds one call may take.
    """

    def __init__(self, handle: Any, url: str, ray_get: Callable[[Any], Any], *, timeout: float = _TIMEOUT) -> None:
        self.handle = handle
        self.url = url
        self._get = ray_get
        self._timeout = timeout

    def __repr__(self) -> str:
        return f"RayEngine({self.url!r})"

    async def _call(self, method: str, **kwargs: Any) -> Any:
        return await _remote(self.handle, self.url, self._get, self._timeout, method, **kwargs)

    async def weight_version(self) -> str:
        """The engine's live ``weight_version`` (``get_weight_version``).

        Raises:
            EngineError: the call failed, or the handle is not an engine's node 0 (it answered None).
        """
        label = await self._call("get_weight_version")
        if label is None:
            raise EngineError(self.url, None, "get_weight_version answered None: not an engine's node 0")
        return str(label)

    async def update_weight_version(self, label: str, *, abort_all_requests: bool = False) -> None:
        """Relabel the engine (the handle's ``update_weight_version`` sends ``abort_all_requests: false``).

        Raises:
            ValueError: ``abort_all_requests`` (the handle cannot send it).
            EngineError: the call failed.
        """
        if abort_all_requests:
            raise ValueError("the engine handle's update_weight_version never aborts requests")
        await self._call("update_weight_version", weight_version=label)

    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        """Pause generation (``pause_generation(mode=...)``)."""
        await self._call("pause_generation", mode=mode)

    async def continue_generation(self) -> None:
        """Resume generation (``continue_generation()``)."""
        await self._call("continue_generation")

    async def aclose(self) -> None:
        """Nothing to close: the handle belongs to the host."""


async def _remote(
    handle: Any, url: str, ray_get: Callable[[Any], Any], timeout: float, method: str, **kwargs: Any
) -> Any:
    def run() -> Any:
        return ray_get(getattr(handle, method).remote(**kwargs))

    try:
        async with asyncio.timeout(timeout):
            return await asyncio.to_thread(run)
    except TimeoutError:
        raise EngineError(url, None, f"{method}: no answer within {timeout:g}s") from None
    except Exception as exc:  # a Ray task error carries the engine's HTTP failure
        raise EngineError(url, None, f"{method} failed: {type(exc).__name__}: {exc}") from exc


async def ray_engines(handles: Sequence[Any], ray_get: Callable[[Any], Any], timeout: float, host: str) -> list[Any]:
    """``RayEngine`` of each handle that is an engine's node 0 (its ``get_weight_version`` answers a label)."""
    engines = [RayEngine(h, engine_name(h, i, host), ray_get, timeout=timeout) for i, h in enumerate(handles)]
    labels = await asyncio.gather(*(e._call("get_weight_version") for e in engines))
    return [e for e, label in zip(engines, labels, strict=True) if label is not None]


async def http_engines(handles: Sequence[Any], ray_get: Callable[[Any], Any], timeout: float, host: str) -> list[Any]:
    """weightbus' ``SGLangClient`` at each handle's ``get_url()`` (None: not an engine's node 0, left out)."""
    names = [engine_name(h, i, host) for i, h in enumerate(handles)]
    urls = await asyncio.gather(
        *(_remote(h, n, ray_get, timeout, "get_url") for h, n in zip(handles, names, strict=True))
    )
    return [_HttpEngine(h, str(u), timeout) for h, u in zip(handles, urls, strict=True) if u is not None]


class _HttpEngine(SGLangClient):
    """An ``SGLangClient`` that remembers the handle it was reached from (the fleet follows handles)."""

    def __init__(self, handle: Any, url: str, timeout: float) -> None:
        super().__init__(url, timeout=timeout)
        self.handle = handle


class HandleFleet(EngineFleet):
    """An ``EngineFleet`` over a host's engine handles that follows the host's reconnects (``retarget``).

    Args:
        engines: the engines ``reach`` made (each with the ``handle`` it came from).
        reach: how the host's handles become engines (``ray_engines``, ``http_engines``).
        host: the host's name (engine names, log lines).
    """

    def __init__(self, engines: Sequence[Any], reach: EngineReach, host: str) -> None:
        super().__init__(list(engines))
        self._reach = reach
        self._host = host
        self._mine = [e for e in engines if isinstance(e, _HttpEngine)]
        self.handles: tuple[Any, ...] = tuple(e.handle for e in engines)
        self.given: tuple[Any, ...] = self.handles  # the handles the host gave, followers included

    @classmethod
    async def build(
        cls,
        handles: Sequence[Any],
        ray_get: Callable[[Any], Any],
        *,
        reach: EngineReach,
        host: str,
        timeout: float = _TIMEOUT,
    ) -> HandleFleet:
        """The fleet of ``handles``; a handle that is not an engine's node 0 is left out.

        Raises:
            EngineError: an engine did not answer, or no handle is an engine's node 0.
            ValueError: no handles.
        """
        fleet = cls(await _node_zero(handles, ray_get, timeout, reach, host), reach, host)
        fleet.given = tuple(handles)
        return fleet

    async def retarget(
        self, handles: Sequence[Any], ray_get: Callable[[Any], Any], *, timeout: float = _TIMEOUT
    ) -> None:
        """Point the fleet at ``handles`` (the host reconnected its engines); between updates only.

        Raises:
            EngineError, ValueError: as ``build``.
        """
        if tuple(handles) == self.given:
            return
        engines = await _node_zero(handles, ray_get, timeout, self._reach, self._host)
        old, self._mine = self._mine, [e for e in engines if isinstance(e, _HttpEngine)]
        self.clients = tuple(engines)
        self.handles = tuple(e.handle for e in engines)
        self.given = tuple(handles)
        for client in old:
            await client.aclose()
        log.info(
            "the engine fleet follows the host's reconnect",
            extra={"host": self._host, "engines": [e.url for e in engines]},
        )

    async def aclose(self) -> None:
        """Close the HTTP clients this fleet made (the handles belong to the host)."""
        mine, self._mine = self._mine, []
        for client in mine:
            await client.aclose()
        await super().aclose()


async def _node_zero(
    handles: Sequence[Any], ray_get: Callable[[Any], Any], timeout: float, reach: EngineReach, host: str
) -> list[Any]:
    if not handles:
        raise ValueError(f"{host} has no rollout engines connected to this updater")
    kept = await reach(handles, ray_get, timeout, host)
    if not kept:
        names = ",".join(engine_name(h, i, host) for i, h in enumerate(handles))
        raise EngineError(names, None, "no engine handle is an engine's node 0")
    return kept
