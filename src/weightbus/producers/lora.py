"""Load a LoRA adapter on every engine of a fleet, re-pushing a name that is already loaded, all or nothing.

A loaded name is unloaded and loaded again (SGLang refuses duplicates); on any refusal it is unloaded where this call
loaded it. ``weight_version`` never changes; push inside a paused update (a replaced adapter is briefly absent).
"""

from __future__ import annotations

import asyncio
import logging

from weightbus.engines.sglang import SGLangClient
from weightbus.errors import EngineError
from weightbus.producers.fleet import EngineFleet

__all__ = ["push_lora_adapter"]

log = logging.getLogger("weightbus.producers")

_ALREADY_LOADED = "already exists"


async def _load_one(client: SGLangClient, name: str, path: str, *, pinned: bool, replace: bool) -> None:
    try:
        await client.load_lora_adapter(name, path, pinned=pinned)
        return
    except EngineError as exc:
        if not (replace and exc.status is not None and _ALREADY_LOADED in exc.message):
            raise
    log.info("LoRA adapter already loaded; replacing it", extra={"engine": client.url, "adapter": name})
    await client.unload_lora_adapter(name)
    await client.load_lora_adapter(name, path, pinned=pinned)


async def push_lora_adapter(
    fleet: EngineFleet, name: str, path: str, *, pinned: bool = False, replace: bool = True
) -> None:
    """Load adapter ``name`` from ``path`` on every engine of ``fleet``; see the module docstring.

    Args:
        fleet: the engines.
        name: the adapter name requests use (``lora_path`` in a generate request).
        path: where each engine loads it from.
        pinned: keep the adapter resident (SGLang's ``pinned``).
        replace: unload and reload an engine that already serves ``name`` (else its refusal is an error).

    Raises:
        EngineError: an engine refused or did not answer; the engines that loaded in this call were unloaded.
    """
    clients = fleet.clients
    results = await asyncio.gather(
        *(_load_one(c, name, path, pinned=pinned, replace=replace) for c in clients), return_exceptions=True
    )
    errors: list[EngineError] = []
    for result in results:
        if isinstance(result, EngineError):
            errors.append(result)
        elif isinstance(result, BaseException):
            raise result
    if not errors:
        return
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"load_lora_adapter also failed on {other.url}: {other}")
    loaded = [c for c, r in zip(clients, results, strict=True) if r is None]
    undo = await asyncio.gather(*(c.unload_lora_adapter(name) for c in loaded), return_exceptions=True)
    for client, outcome in zip(loaded, undo, strict=True):
        if isinstance(outcome, BaseException):
            first.add_note(f"and unloading {name!r} from {client.url} afterwards failed too: {outcome}")
        else:
            first.add_note(f"{name!r} was unloaded again from {client.url}")
    raise first
