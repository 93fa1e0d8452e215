"""miles' rollout engines as a weightbus ``EngineFleet``: each engine addressed through its Ray actor handle.

Only miles' own label calls; every failure or timeout is an ``EngineError`` naming the engine; blocking calls run in
worker threads; ``ray`` is never imported (the caller passes ``ray.get``).
See docs/integrations/miles.md#how-it-installs-and-when-it-refuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

from weightbus.engines.sglang import PauseMode
from weightbus.errors import EngineError
from weightbus.producers.fleet import EngineFleet

__all__ = ["MilesEngineFleet", "RayEngine", "engine_name"]

log = logging.getLogger("weightbus.integrations.miles")

_TIMEOUT: Final = 120.0


def engine_name(handle: Any, index: int) -> str:
    """The engine's name on the bus: ``ray://<actor id>``, else ``miles-engine-<index>``."""
    actor_id = getattr(handle, "_actor_id", None)
    hex_id = getattr(actor_id, "hex", None)
    if callable(hex_id):
        return f"ray://{hex_id()}"
    return f"miles-engine-{index}"


class RayEngine:
    """One miles engine with the engine surface ``EngineFleet`` uses (``SGLangClient``'s label methods).

    Args:
        handle: the engine's Ray actor handle (miles' ``SGLangEngine``).
        url: its name on the bus (``engine_name``).
        ray_get: ``ray.get`` as miles imports it.
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
        def run() -> Any:
            return self._get(getattr(self.handle, method).remote(**kwargs))

        try:
            async with asyncio.timeout(self._timeout):
                return await asyncio.to_thread(run)
        except TimeoutError:
            raise EngineError(self.url, None, f"{method}: no answer within {self._timeout:g}s") from None
        except Exception as exc:  # a Ray task error carries the engine's HTTP failure
            raise EngineError(self.url, None, f"{method} failed: {type(exc).__name__}: {exc}") from exc

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
        """Relabel the engine (miles' ``update_weight_version`` sends ``abort_all_requests: false``).

        Raises:
            ValueError: ``abort_all_requests`` (miles' handle cannot send it).
            EngineError: the call failed.
        """
        if abort_all_requests:
            raise ValueError("miles' update_weight_version never aborts requests")
        await self._call("update_weight_version", weight_version=label)

    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        """Pause generation (``pause_generation(mode=...)``)."""
        await self._call("pause_generation", mode=mode)

    async def continue_generation(self) -> None:
        """Resume generation (``continue_generation()``)."""
        await self._call("continue_generation")

    async def aclose(self) -> None:
        """Nothing to close: the handle belongs to miles."""


class MilesEngineFleet(EngineFleet):
    """An ``EngineFleet`` over miles' engine handles that follows miles' reconnects (``retarget``).

    Args:
        engines: the ``RayEngine`` of each engine's node 0.
    """

    def __init__(self, engines: Sequence[RayEngine]) -> None:
        super().__init__(list(engines))  # type: ignore[arg-type]  # RayEngine has the surface the fleet uses
        self.handles: tuple[Any, ...] = tuple(e.handle for e in engines)
        self.given: tuple[Any, ...] = self.handles  # the handles miles gave, followers included

    @classmethod
    async def build(
        cls, handles: Sequence[Any], ray_get: Callable[[Any], Any], *, timeout: float = _TIMEOUT
    ) -> MilesEngineFleet:
        """The fleet of ``handles``; a handle whose ``get_weight_version`` answers None (not node 0) is left out.

        Raises:
            EngineError: an engine did not answer, or no handle is an engine's node 0.
            ValueError: no handles.
        """
        fleet = cls(await _node_zero(handles, ray_get, timeout))
        fleet.given = tuple(handles)
        return fleet

    async def retarget(
        self, handles: Sequence[Any], ray_get: Callable[[Any], Any], *, timeout: float = _TIMEOUT
    ) -> None:
        """Point the fleet at ``handles`` (miles reconnected its engines); between updates only.

        Raises:
            EngineError, ValueError: as ``build``.
        """
        if tuple(handles) == self.given:
            return
        engines = await _node_zero(handles, ray_get, timeout)
        self.clients = tuple(engines)  # type: ignore[arg-type]
        self.handles = tuple(e.handle for e in engines)
        self.given = tuple(handles)
        log.info("the engine fleet follows miles' reconnect", extra={"engines": [e.url for e in engines]})


async def _node_zero(handles: Sequence[Any], ray_get: Callable[[Any], Any], timeout: float) -> list[RayEngine]:
    if not handles:
        raise ValueError("miles has no rollout engines connected to this updater")
    engines = [RayEngine(h, engine_name(h, i), ray_get, timeout=timeout) for i, h in enumerate(handles)]
    labels = await asyncio.gather(*(e._call("get_weight_version") for e in engines))
    kept = [e for e, label in zip(engines, labels, strict=True) if label is not None]
    if not kept:
        raise EngineError(",".join(e.url for e in engines), None, "no engine handle is an engine's node 0")
    return kept
