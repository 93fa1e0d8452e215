"""discover_workers: both router listing shapes, the 404 fallback, and typed failures."""

from __future__ import annotations

import httpx
import pytest

from weightbus.engines import discover_workers
from weightbus.errors import EngineError

ROUTER = "http://router:8000"


def mock(routes: dict[str, httpx.Response]) -> tuple[httpx.AsyncClient, list[str]]:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return routes.get(request.url.path, httpx.Response(404, text="Not Found"))

    return httpx.AsyncClient(transport=httpx.MockTransport(handler)), seen


async def test_workers_shape() -> None:
    body = {
        "workers": [
            {"id": "w0", "url": "http://10.0.0.1:30000", "model_id": "m", "is_healthy": True},
            {"id": "w1", "url": "http://10.0.0.2:30000/"},
            {"id": "w1-dup", "url": "http://10.0.0.2:30000"},
        ],
        "total": 3,
    }
    http, seen = mock({"/workers": httpx.Response(200, json=body)})
    assert await discover_workers(ROUTER + "/", http=http) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert seen == ["GET /workers"]


async def test_list_workers_fallback_on_404() -> None:
    http, seen = mock({"/list_workers": httpx.Response(200, json={"urls": ["10.0.0.3:30000", "http://10.0.0.4:1"]})})
    assert await discover_workers(ROUTER, http=http) == ["http://10.0.0.3:30000", "http://10.0.0.4:1"]
    assert seen == ["GET /workers", "GET /list_workers"]


async def test_no_fallback_on_other_errors() -> None:
    http, seen = mock({"/workers": httpx.Response(500, json={"message": "boom"})})
    with pytest.raises(EngineError) as info:
        await discover_workers(ROUTER, http=http)
    assert (info.value.url, info.value.status, info.value.message) == (ROUTER, 500, "boom")
    assert seen == ["GET /workers"]


@pytest.mark.parametrize(
    "routes",
    [
        {"/workers": httpx.Response(200, json={"workers": []})},
        {"/list_workers": httpx.Response(200, json={"urls": []})},
    ],
)
async def test_empty_fleet_is_a_clear_error(routes: dict[str, httpx.Response]) -> None:
    http, _ = mock(routes)
    with pytest.raises(EngineError, match="no workers"):
        await discover_workers(ROUTER, http=http)


async def test_neither_route_is_an_error_with_404() -> None:
    http, _ = mock({})
    with pytest.raises(EngineError) as info:
        await discover_workers(ROUTER, http=http)
    assert info.value.status == 404


async def test_bad_body_and_transport_errors() -> None:
    http, _ = mock({"/workers": httpx.Response(200, json={"workers": "nope"})})
    with pytest.raises(EngineError, match="unexpected response body"):
        await discover_workers(ROUTER, http=http)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with pytest.raises(EngineError) as info:
        await discover_workers(ROUTER, http=httpx.AsyncClient(transport=httpx.MockTransport(refuse)))
    assert info.value.status is None
