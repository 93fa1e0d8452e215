"""Worker discovery through an sglang-router or smg gateway.

Routers forward no weight, version, pause or LoRA route: list the workers, then address each; nothing is cached.
"""

from __future__ import annotations

from typing import TypeVar

import httpx
import msgspec

from weightbus.engines._http import httpx_request, normalize_url, server_message
from weightbus.errors import EngineError

__all__ = ["discover_workers"]

_T = TypeVar("_T")


class _Worker(msgspec.Struct, frozen=True):
    url: str
    id: str | None = None


class _WorkersResponse(msgspec.Struct, frozen=True):
    """``GET /workers`` on sglang-router >= 0.3 and smg."""

    workers: list[_Worker]


class _ListWorkersResponse(msgspec.Struct, frozen=True):
    """``GET /list_workers`` on older routers."""

    urls: list[str]


async def _get(http: httpx.AsyncClient, router: str, path: str) -> httpx.Response:
    return await httpx_request(http, router, "GET", path)


def _decode(response: httpx.Response, router: str, path: str, type_: type[_T]) -> _T:
    if not response.is_success:
        raise EngineError(router, response.status_code, server_message(response))
    try:
        return msgspec.json.decode(response.content, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EngineError(router, response.status_code, f"unexpected response body from {path}: {exc}") from exc


async def discover_workers(
    router_url: str,
    *,
    http: httpx.AsyncClient | None = None,
    timeout: float = 10.0,
) -> list[str]:
    """List the worker URLs behind a router, in the router's order, without duplicates.

    Tries ``GET /workers`` (``{"workers": [{"url", "id"}, ...]}``) and, only on a 404, the older
    ``GET /list_workers`` (``{"urls": [...]}``). Weight updates must then go to each worker directly, because
    routers do not forward the weight, version, pause or LoRA routes.

    Args:
        router_url: the router's base URL; a missing scheme means ``http``.
        http: a shared ``httpx.AsyncClient`` to borrow (not closed here).
        timeout: seconds per request when this function creates its own client.

    Returns:
        Normalised worker base URLs (scheme included, no trailing slash).

    Raises:
        EngineError: the router failed, did not answer, sent an unexpected body, or lists no workers.
    """
    router = normalize_url(router_url)
    client = http if http is not None else httpx.AsyncClient(timeout=timeout)
    try:
        response = await _get(client, router, "/workers")
        if response.status_code == 404:
            response = await _get(client, router, "/list_workers")
            urls = _decode(response, router, "/list_workers", _ListWorkersResponse).urls
        else:
            workers = _decode(response, router, "/workers", _WorkersResponse).workers
            urls = [worker.url for worker in workers]
    finally:
        if http is None:
            await client.aclose()
    normalized = list(dict.fromkeys(normalize_url(url) for url in urls if url.strip()))
    if not normalized:
        raise EngineError(router, 200, "the router lists no workers; start or register workers first")
    return normalized
