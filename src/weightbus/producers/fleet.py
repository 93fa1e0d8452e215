"""Engine fleets: the SGLang workers of one policy, paused, resumed, loaded, relabelled and stamped together.

Workers, not routers. Only an engine reading ``expect`` is stamped, and it counts only when it reads back ``str(v)``;
engines are addressed concurrently, every failure reported (the first raised, the others as notes), none retried.
A fleet built from URLs gives each engine its own small pool of the lean keep-alive client (``KeepAliveHttp``: one
TLS context for all, about a tenth of httpx's CPU per request), never one pool for hundreds of engines (httpcore
scans its whole pool on every request); at most ``max_in_flight`` engine requests of the fleet are in flight at
once (a larger fleet is addressed in waves).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import httpx

from weightbus.engines.keepalive import KeepAliveHttp
from weightbus.engines.router import discover_workers
from weightbus.engines.sglang import PauseMode, SGLangClient
from weightbus.errors import EngineError, EngineOutOfSyncError

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "EngineFleet", "EngineStamp", "first_with_notes"]

log = logging.getLogger("weightbus.producers")

#: The most engine requests a fleet has in flight at once (each holds one connection): one per engine up to this.
DEFAULT_MAX_IN_FLIGHT: Final = 256
#: Each engine's pool in a fleet built from URLs: the fleet's request, and one beside it (the trainer's push through
#: ``fleet.clients``, a status read); one connection is kept alive between the steps of an update.
_ENGINE_CONNECTIONS: Final = 2

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
            ``aclose``), or worker URLs (a client is created for each; see ``http`` and ``max_in_flight``).
        http: a shared ``httpx.AsyncClient`` for the clients created from URLs (borrowed), e.g. one with
            event hooks or a mock transport. Without it, each engine gets its own ``KeepAliveHttp``. One httpx
            pool for many engines is slow with httpcore 1.0 (each request scans the pool: 256 engines on one
            client took seconds per step here) and can close a connection under a queued request
            (encode/httpcore#1110): for more than a few dozen engines, leave it out.
        api_key: bearer token for the clients created from URLs.
        timeout: per-request seconds for the clients created from URLs.
        max_in_flight: the most engine requests the fleet's own steps (pause, resume, relabel, read,
            stamp, load) have in flight at once; more engines than this are addressed in waves. Without
            ``http``, each engine's client keeps at most 2 connections (1 alive between requests), all
            sharing one TLS context; ``aclose`` closes them.

    Raises:
        ValueError: no engines, the same URL twice, or ``max_in_flight`` below 1.
    """

    def __init__(
        self,
        engines: Sequence[SGLangClient | str],
        *,
        http: httpx.AsyncClient | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if not engines:
            raise ValueError("an engine fleet needs at least one engine")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._slots = asyncio.Semaphore(max_in_flight)
        self._owned_http: list[KeepAliveHttp] = []
        tls = None
        if http is None and any(isinstance(engine, str) for engine in engines):
            # One TLS context for the fleet: building one costs ~20 ms and ~1 MiB (256 engines: 6 s, 210 MiB).
            tls = httpx.create_ssl_context()
        clients: list[SGLangClient] = []
        for engine in engines:
            if isinstance(engine, str) and http is None:
                lean = KeepAliveHttp(engine, timeout=timeout, ssl=tls, max_connections=_ENGINE_CONNECTIONS)
                self._owned_http.append(lean)
                clients.append(SGLangClient(lean.url, http=lean, api_key=api_key))
            elif isinstance(engine, str):
                clients.append(SGLangClient(engine, http=http, api_key=api_key, timeout=timeout))
            else:
                # An SGLangClient, or an object with its engine surface (an RL framework's engine handles).
                clients.append(engine)
        urls = [c.url for c in clients]
        if len(set(urls)) != len(urls):
            # The clients made above opened no connection: dropping them unclosed leaks nothing.
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
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> EngineFleet:
        """The workers listed by a router's ``GET /workers``; the router itself is never sent weight routes.

        Raises:
            EngineError: the router failed or lists no workers.
        """
        urls = await discover_workers(router_url, http=http, timeout=timeout)
        return cls(urls, http=http, api_key=api_key, timeout=timeout, max_in_flight=max_in_flight)

    @property
    def urls(self) -> tuple[str, ...]:
        """The engines' base URLs, in fleet order."""
        return tuple(c.url for c in self.clients)

    def __repr__(self) -> str:
        return f"EngineFleet({list(self.urls)!r})"

    async def aclose(self) -> None:
        """Close the HTTP clients this fleet created for its URLs."""
        owned, self._owned_http = self._owned_http, []
        await asyncio.gather(*(client.aclose() for client in owned))

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
        results = await asyncio.gather(*(self._limited(call, c) for c in clients), return_exceptions=True)
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

    async def _limited(self, call: Callable[[SGLangClient], Awaitable[_T]], client: SGLangClient) -> _T:
        """``call(client)`` once one of the fleet's ``max_in_flight`` slots is free."""
        async with self._slots:
            return await call(client)

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
        undo = await asyncio.gather(
            *(self._limited(lambda c: c.continue_generation(), c) for c in paused), return_exceptions=True
        )
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
        undo = await asyncio.gather(
            *(self._limited(lambda c: c.unload_lora_adapter(name), c) for c in loaded), return_exceptions=True
        )
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

        labels = await asyncio.gather(*(self._limited(_read, c) for c in clients))
        if before_stamp is not None and any(label != expected for label in labels):
            await before_stamp()
        before = dict(zip((c.url for c in clients), labels, strict=True))

        async def _stamp(client: SGLangClient) -> EngineStamp:
            return await _one(client, before[client.url])

        return list(await asyncio.gather(*(self._limited(_stamp, c) for c in clients)))


def first_with_notes(errors: list[EngineError], op: str) -> EngineError:
    """The first of ``errors``, with the others attached as notes (``op`` also failed on ...)."""
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"{op} also failed on {other.url}: {other}")
    return first
