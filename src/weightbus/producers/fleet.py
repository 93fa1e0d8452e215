"""Engine fleets: the SGLang workers of one policy, paused, resumed, loaded, relabelled and stamped together.

Workers, not routers. Only an engine reading ``expect`` is stamped, and it counts only when it reads back ``str(v)``;
engines are addressed concurrently, every failure reported (the first raised, the others as notes), none retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx

from weightbus.engines.router import discover_workers
from weightbus.engines.sglang import PauseMode, SGLangClient
from weightbus.errors import EngineError, EngineOutOfSyncError

__all__ = ["EngineFleet", "EngineStamp", "first_with_notes"]

log = logging.getLogger("weightbus.producers")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class EngineStamp:
    """One engine's outcome of a stamp.

    Attributes:
        engine: the engine URL.
        expected: the label it was stamped with (``str(version)``).
        read_back: its ``/model_info`` ``weight_version`` after the stamp, or None if it did not answer.
        error: the engine error when the stamp or the read-back failed.
        before: its label before the stamp (None if it did not answer).
        stamped: whether ``update_weight_version`` was sent (False when it already carried the label).
    """

    engine: str
    expected: str
    read_back: str | None
    error: EngineError | None = None
    before: str | None = None
    stamped: bool = True

    @property
    def ok(self) -> bool:
        """Whether the engine serves the stamped version."""
        return self.error is None and self.read_back == self.expected


class EngineFleet:
    """The SGLang workers of one policy, addressed together.

    Args:
        engines: ``SGLangClient`` objects, or objects with the same methods (borrowed, not closed by
            ``aclose``), or worker URLs (a client is created for each and closed by ``aclose``).
        http: a shared ``httpx.AsyncClient`` for the clients created from URLs (borrowed).
        api_key: bearer token for the clients created from URLs.
        timeout: per-request seconds for the clients created from URLs.

    Raises:
        ValueError: no engines, or the same URL twice.
    """

    def __init__(
        self,
        engines: Sequence[SGLangClient | str],
        *,
        http: httpx.AsyncClient | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        if not engines:
            raise ValueError("an engine fleet needs at least one engine")
        self._owned: list[SGLangClient] = []
        clients: list[SGLangClient] = []
        for engine in engines:
            if isinstance(engine, str):
                client = SGLangClient(engine, http=http, api_key=api_key, timeout=timeout)
                self._owned.append(client)
                clients.append(client)
            else:
                # An SGLangClient, or an object with its engine surface (an RL framework's engine handles).
                clients.append(engine)
        urls = [c.url for c in clients]
        if len(set(urls)) != len(urls):
            raise ValueError(f"an engine appears twice in the fleet: {urls}")
        self.clients: tuple[SGLangClient, ...] = tuple(clients)

    @classmethod
    async def from_router(
        cls,
        router_url: str,
        *,
        http: httpx.AsyncClient | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
    ) -> EngineFleet:
        """The workers listed by a router's ``GET /workers``; the router itself is never sent weight routes.

        Raises:
            EngineError: the router failed or lists no workers.
        """
        urls = await discover_workers(router_url, http=http, timeout=timeout)
        return cls(urls, http=http, api_key=api_key, timeout=timeout)

    @property
    def urls(self) -> tuple[str, ...]:
        """The engines' base URLs, in fleet order."""
        return tuple(c.url for c in self.clients)

    def __repr__(self) -> str:
        return f"EngineFleet({list(self.urls)!r})"

    async def aclose(self) -> None:
        """Close the clients this fleet created from URLs."""
        for client in self._owned:
            await client.aclose()

    async def __aenter__(self) -> EngineFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _subset(self, engines: Collection[str] | None) -> tuple[SGLangClient, ...]:
        if engines is None:
            return self.clients
        unknown = set(engines) - set(self.urls)
        if unknown:
            raise ValueError(f"not engines of this fleet: {sorted(unknown)}")
        return tuple(c for c in self.clients if c.url in engines)

    async def _each(
        self, op: str, call: Callable[[SGLangClient], Awaitable[_T]], clients: Sequence[SGLangClient] | None = None
    ) -> list[_T | EngineError]:
        clients = self.clients if clients is None else clients
        results = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
        out: list[_T | EngineError] = []
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, EngineError):
                log.warning("engine %s failed", op, extra={"engine": client.url, "op": op, "error": str(result)})
                out.append(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                out.append(result)
        return out

    async def _all(self, op: str, call: Callable[[SGLangClient], Awaitable[object]]) -> None:
        errors = [r for r in await self._each(op, call) if isinstance(r, EngineError)]
        if errors:
            raise first_with_notes(errors, op)

    async def pause(self, mode: PauseMode = "retract") -> None:
        """Pause generation on every engine; if any refuses, the ones that paused are resumed.

        Raises:
            EngineError: an engine refused or did not answer (others are listed as notes).
        """
        results = await self._each("pause", lambda c: c.pause_generation(mode))
        errors = [r for r in results if isinstance(r, EngineError)]
        if not errors:
            return
        paused = [c for c, r in zip(self.clients, results, strict=True) if not isinstance(r, EngineError)]
        first = first_with_notes(errors, "pause")
        undo = await asyncio.gather(*(c.continue_generation() for c in paused), return_exceptions=True)
        for client, result in zip(paused, undo, strict=True):
            if isinstance(result, BaseException):
                first.add_note(f"and resuming {client.url} after the failed pause failed too: {result}")
        raise first

    async def resume(self) -> None:
        """Resume generation on every engine (all are tried even if one fails).

        Raises:
            EngineError: an engine refused or did not answer (others are listed as notes).
        """
        await self._all("resume", lambda c: c.continue_generation())

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Load LoRA adapter ``name`` from ``path`` on every engine. Loading never changes a version: stamp next.

        A load refused by some engines is undone on the others (unloaded), so the fleet never serves
        an adapter on only part of its engines.

        Raises:
            EngineError: an engine refused (e.g. the name is already loaded) or did not answer.
        """
        results = await self._each("load_lora_adapter", lambda c: c.load_lora_adapter(name, path, pinned=pinned))
        errors = [r for r in results if isinstance(r, EngineError)]
        if not errors:
            return
        first = first_with_notes(errors, "load_lora_adapter")
        loaded = [c for c, r in zip(self.clients, results, strict=True) if not isinstance(r, EngineError)]
        undo = await asyncio.gather(*(c.unload_lora_adapter(name) for c in loaded), return_exceptions=True)
        for client, result in zip(loaded, undo, strict=True):
            if isinstance(result, BaseException):
                first.add_note(f"and unloading the partial load from {client.url} failed too: {result}")
        raise first

    async def load_base(self, path: str, *, engines: Collection[str] | None = None) -> None:
        """Load the weights at ``path`` from disk on ``engines`` (default: all), without a version: stamp next.

        Raises:
            EngineError: an engine refused or did not answer (others are listed as notes).
            ValueError: ``engines`` names an engine that is not in the fleet.
        """
        clients = self._subset(engines)
        errors = [
            r
            for r in await self._each("load_base", lambda c: c.update_weights_from_disk(path), clients)
            if isinstance(r, EngineError)
        ]
        if errors:
            raise first_with_notes(errors, "load_base")

    async def unload_lora_adapter(self, name: str, *, missing_ok: bool = False) -> None:
        """Unload LoRA adapter ``name`` from every engine.

        Args:
            name: the adapter name.
            missing_ok: an engine that answers that it has no such adapter is not an error.

        Raises:
            EngineError: an engine refused or did not answer.
        """
        results = await self._each("unload_lora_adapter", lambda c: c.unload_lora_adapter(name))
        errors = [
            r
            for r in results
            if isinstance(r, EngineError) and not (missing_ok and r.status is not None and 400 <= r.status < 500)
        ]
        if errors:
            raise first_with_notes(errors, "unload_lora_adapter")

    async def relabel(
        self, label: str, *, timeout: float | None = None, engines: Collection[str] | None = None
    ) -> dict[str, EngineError | None]:
        """Set every engine's label to ``label`` without aborting requests; errors are returned, not raised.

        Used to quarantine engines whose weights may not match any version (``quarantine:<v>``), and
        to mark engines whose push is under way (``pending:<v>``).

        Args:
            label: the new label.
            timeout: seconds each engine may take (a hung engine must not hold up the cleanup).
            engines: the URLs to relabel (default: every engine).

        Raises:
            ValueError: ``engines`` names an engine that is not in the fleet.
        """

        async def _one(client: SGLangClient) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await client.update_weight_version(label, abort_all_requests=False)
            except TimeoutError:
                raise EngineError(client.url, None, f"no answer to the relabel within {timeout:g}s") from None

        clients = self._subset(engines)
        results = await self._each("relabel", _one, clients)
        return {c.url: (r if isinstance(r, EngineError) else None) for c, r in zip(clients, results, strict=True)}

    async def read_versions(self) -> dict[str, str | EngineError]:
        """Each engine's live ``weight_version`` (or the error reading it), keyed by URL; read-only."""
        results = await self._each("read_version", lambda c: c.weight_version())
        return dict(zip(self.urls, results, strict=True))

    async def stamp(
        self,
        version: int,
        *,
        before_stamp: Callable[[], Awaitable[None]] | None = None,
        engines: Collection[str] | None = None,
        expect: str | None = None,
    ) -> list[EngineStamp]:
        """Stamp every engine with ``str(version)`` and read each one back; raises nothing for engine faults.

        Every label is read first; an engine that already carries ``str(version)`` is not stamped again.

        Args:
            version: the version to stamp.
            before_stamp: awaited once, after the reads and before the first stamp, only if some
                engine needs one (the publisher's ownership check); what it raises propagates and
                no engine is stamped.
            engines: the URLs to stamp (default: every engine); the others are not touched.
            expect: stamp only an engine that reads this label (or already ``str(version)``); any
                other label means someone relabelled it since, and it is not stamped (an error).

        Returns:
            One ``EngineStamp`` per engine stamped, in fleet order; check ``ok``.

        Raises:
            ValueError: ``engines`` names an engine that is not in the fleet.
        """
        expected = str(version)
        clients = self._subset(engines)

        async def _read(client: SGLangClient) -> str | EngineError:
            try:
                return await client.weight_version()
            except EngineError as exc:
                return exc

        async def _one(client: SGLangClient, before: str | EngineError) -> EngineStamp:
            if isinstance(before, EngineError):
                return EngineStamp(client.url, expected, None, before)
            if before == expected:
                return EngineStamp(client.url, expected, before, before=before, stamped=False)
            if expect is not None and before != expect:
                # Relabelled by another update during the push, or not reached by a push that labels.
                error = EngineOutOfSyncError(client.url, expect, before)
                error.add_note(f"{client.url} was not stamped {expected!r}: its label changed under the push")
                return EngineStamp(client.url, expected, before, error, before=before, stamped=False)
            try:
                await client.update_weight_version(expected, abort_all_requests=False)
                read_back = await client.weight_version()
            except EngineError as exc:
                return EngineStamp(client.url, expected, None, exc, before=before)
            return EngineStamp(client.url, expected, read_back, before=before)

        labels = await asyncio.gather(*(_read(c) for c in clients))
        if before_stamp is not None and any(label != expected for label in labels):
            await before_stamp()
        return list(await asyncio.gather(*(_one(c, label) for c, label in zip(clients, labels, strict=True))))


def first_with_notes(errors: list[EngineError], op: str) -> EngineError:
    """The first of ``errors``, with the others attached as notes (``op`` also failed on ...)."""
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"{op} also failed on {other.url}: {other}")
    return first
