"""The lean keep-alive client against servers that misbehave on purpose: each is a real TCP server on 127.0.0.1.

What is asserted is what the servers recorded (connections accepted, requests read, peak connections) and the
answers the client returned: no request ever gets another request's answer, nothing hangs, every failure is typed.
Every test runs on asyncio's own loop and on uvloop, which the weightbus processes use (their transports differ):
see ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from weightbus.engines.keepalive import KeepAliveHttp
from weightbus.engines.sglang import SGLangClient
from weightbus.errors import EngineError, EngineTransportError
from weightbus.producers import EngineFleet
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine


@dataclass
class Request:
    line: str
    headers: dict[str, str]
    body: bytes
    connection: int


@dataclass
class Server:
    """What a scripted server saw."""

    url: str = ""
    accepted: int = 0
    open_now: int = 0
    peak: int = 0
    requests: list[Request] = field(default_factory=list)


Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Handler = Callable[[Reader, Writer, int, Server], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader, conn: int, server: Server) -> Request | None:
    """One request off ``reader`` (None at the end of the connection), logged in ``server.requests``."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    request = Request(lines[0], headers, body, conn)
    server.requests.append(request)
    return request


def answer(body: bytes, *, status: str = "200 OK", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def echo(request: Request) -> bytes:
    """An answer that names its request, so that a misdelivered answer is seen."""
    return answer(request.line.encode() + b"|" + request.body)


async def serve_echo(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
    while (request := await read_request(reader, conn, server)) is not None:
        writer.write(echo(request))
        await writer.drain()


@asynccontextmanager
async def scripted(handler: Handler, *, tls: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    server = Server()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.accepted += 1
        server.open_now += 1
        server.peak = max(server.peak, server.open_now)
        try:
            await handler(reader, writer, server.accepted, server)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # The client closed first: what the test records is in ``server``.
        finally:
            server.open_now -= 1
            writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        yield server
    finally:
        listener.close()


async def test_sequential_requests_share_one_connection_and_each_gets_its_own_answer() -> None:
    async with scripted(serve_echo) as server, KeepAliveHttp(server.url + "/base") as http:
        replies = [await http.request("POST", f"/r{i}", content=f"b{i}".encode()) for i in range(10)]
    assert [r.content for r in replies] == [f"POST /base/r{i} HTTP/1.1|b{i}".encode() for i in range(10)]
    assert server.accepted == 1
    first = server.requests[0]
    assert first.headers["host"] == server.url.removeprefix("http://")
    assert first.headers["content-length"] == "2"


async def test_a_post_without_a_body_sends_a_zero_length_and_a_query_string_is_encoded() -> None:
    async with scripted(serve_echo) as server, KeepAliveHttp(server.url) as http:
        reply = await http.request("POST", "/flush_cache", params={"timeout": "1.5"})
    assert reply.content == b"POST /flush_cache?timeout=1.5 HTTP/1.1|"
    assert server.requests[0].headers["content-length"] == "0"


async def test_a_chunked_answer_with_extensions_and_trailers_is_read_whole_and_the_connection_reused() -> None:
    async def chunked(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        while await read_request(reader, conn, server) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"4;ext=1\r\nWiki\r\n5\r\npedia\r\n0\r\nX-Trailer: t\r\n\r\n"
            )
            await writer.drain()

    async with scripted(chunked) as server, KeepAliveHttp(server.url) as http:
        assert (await http.request("GET", "/a")).content == b"Wikipedia"
        assert (await http.request("GET", "/b")).content == b"Wikipedia"
    assert server.accepted == 1


@pytest.mark.parametrize(
    "status_line, extra",
    [("HTTP/1.1 200 OK", "Connection: close\r\n"), ("HTTP/1.0 200 OK", "")],
    ids=["connection-close", "http-1.0"],
)
async def test_an_answer_that_ends_its_connection_is_not_reused(status_line: str, extra: str) -> None:
    async def once(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        request = await read_request(reader, conn, server)
        assert request is not None
        body = echo(request).split(b"\r\n\r\n", 1)[1]
        writer.write(f"{status_line}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)
        await writer.drain()

    async with scripted(once) as server, KeepAliveHttp(server.url) as http:
        assert (await http.request("GET", "/1")).content == b"GET /1 HTTP/1.1|"
        assert (await http.request("GET", "/2")).content == b"GET /2 HTTP/1.1|"
    assert server.accepted == 2


async def test_an_unframed_answer_runs_to_the_end_of_its_connection() -> None:
    async def unframed(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        await read_request(reader, conn, server)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart one, ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"part two")
        writer.close()

    async with scripted(unframed) as server, KeepAliveHttp(server.url) as http:
        assert (await http.request("GET", "/")).content == b"part one, part two"
        assert (await http.request("GET", "/")).content == b"part one, part two"
        assert http.open_connections == 0
    assert server.accepted == 2


async def test_an_idle_connection_the_server_closed_is_replaced_without_a_failed_request() -> None:
    async def one_each(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        # Answers one request, then drops the idle connection, as uvicorn does after its keep-alive timeout.
        request = await read_request(reader, conn, server)
        assert request is not None
        writer.write(echo(request))
        await writer.drain()

    async with scripted(one_each) as server, KeepAliveHttp(server.url) as http:
        for i in range(3):
            assert (await http.request("GET", f"/{i}")).content == f"GET /{i} HTTP/1.1|".encode()
            await asyncio.sleep(0.05)
    assert server.accepted == 3
    assert len(server.requests) == 3


async def test_a_request_racing_the_servers_keepalive_close_is_sent_once_more_on_a_new_connection() -> None:
    async def drop_second(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        # The first connection answers one request, then reads the next and closes without answering: the close
        # the client cannot see coming, because it crossed the request on the wire.
        first = await read_request(reader, conn, server)
        assert first is not None
        writer.write(echo(first))
        await writer.drain()
        if conn == 1:
            await read_request(reader, conn, server)
            return
        while (request := await read_request(reader, conn, server)) is not None:
            writer.write(echo(request))
            await writer.drain()

    async with scripted(drop_second) as server, KeepAliveHttp(server.url) as http:
        await http.request("POST", "/pause_generation", content=b"{}")
        reply = await http.request("POST", "/continue_generation", content=b"{}")
    assert reply.content == b"POST /continue_generation HTTP/1.1|{}"
    assert [(r.line, r.connection) for r in server.requests] == [
        ("POST /pause_generation HTTP/1.1", 1),
        ("POST /continue_generation HTTP/1.1", 1),
        ("POST /continue_generation HTTP/1.1", 2),
    ]


async def test_a_server_that_never_answers_is_tried_at_most_twice_then_a_typed_error() -> None:
    async def mute(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        if conn == 1:
            request = await read_request(reader, conn, server)
            assert request is not None
            writer.write(echo(request))
            await writer.drain()
        await read_request(reader, conn, server)

    async with scripted(mute) as server, KeepAliveHttp(server.url) as http:
        await http.request("GET", "/ok")
        with pytest.raises(EngineTransportError, match="closed the connection without answering"):
            await http.request("POST", "/update_weights_from_disk", content=b"{}")
        with pytest.raises(EngineTransportError, match="closed the connection without answering"):
            await http.request("POST", "/update_weights_from_disk", content=b"{}")
    loads = [r for r in server.requests if r.line.startswith("POST")]
    # Twice for the request on the reused connection (it may have been the keep-alive race), once on a fresh one.
    assert len(loads) == 3
    assert server.accepted == 3


async def test_stray_bytes_after_an_answer_never_become_the_next_requests_answer() -> None:
    async def doubled(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        while (request := await read_request(reader, conn, server)) is not None:
            writer.write(echo(request))
            await writer.drain()
            await asyncio.sleep(0.02)
            # An answer to nothing, arriving while the connection waits in the pool.
            writer.write(answer(b"STRAY"))
            await writer.drain()

    async def together(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        while (request := await read_request(reader, conn, server)) is not None:
            writer.write(echo(request) + answer(b"STRAY"))  # in the same segment as the real answer
            await writer.drain()

    for handler in (doubled, together):
        async with scripted(handler) as server, KeepAliveHttp(server.url) as http:
            for i in range(4):
                reply = await http.request("GET", f"/{i}")
                assert reply.content == f"GET /{i} HTTP/1.1|".encode(), handler.__name__
                await asyncio.sleep(0.05)
        assert server.accepted == 4, handler.__name__


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_request_abandoned_mid_answer_closes_its_connection_so_its_late_answer_reaches_nobody(
    how: str,
) -> None:
    async def late_first(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        while (request := await read_request(reader, conn, server)) is not None:
            if request.line.startswith("GET /slow"):
                await asyncio.sleep(0.3)
            writer.write(echo(request))
            await writer.drain()

    async with scripted(late_first) as server, KeepAliveHttp(server.url, timeout=5) as http:
        await http.request("GET", "/warm")
        if how == "timeout":
            with pytest.raises(EngineTransportError, match="GET /slow timed out"):
                await http.request("GET", "/slow", timeout=0.1)
        else:
            task = asyncio.ensure_future(http.request("GET", "/slow"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert http.open_connections == 0
        replies = [await http.request("GET", f"/after{i}") for i in range(3)]
        await asyncio.sleep(0.3)
    assert [r.content for r in replies] == [f"GET /after{i} HTTP/1.1|".encode() for i in range(3)]
    assert server.accepted == 2


async def test_concurrent_requests_never_open_more_than_max_connections_and_keep_one() -> None:
    async def slow_echo(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        while (request := await read_request(reader, conn, server)) is not None:
            await asyncio.sleep(0.03)
            writer.write(echo(request))
            await writer.drain()

    async with scripted(slow_echo) as server, KeepAliveHttp(server.url, max_connections=2) as http:
        replies = await asyncio.gather(*(http.request("GET", f"/{i}") for i in range(10)))
        assert http.open_connections == 1
    assert [r.content for r in replies] == [f"GET /{i} HTTP/1.1|".encode() for i in range(10)]
    assert server.peak <= 2
    assert server.accepted >= 2


async def test_waiting_for_a_connection_counts_against_the_deadline() -> None:
    async def stall(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        await read_request(reader, conn, server)
        await asyncio.sleep(5)

    async with scripted(stall) as server, KeepAliveHttp(server.url, max_connections=1, timeout=0.2) as http:
        results = await asyncio.wait_for(
            asyncio.gather(http.request("GET", "/a"), http.request("GET", "/b"), return_exceptions=True), 2
        )
    assert all(isinstance(r, EngineTransportError) and "timed out" in str(r) for r in results), results
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed inside the answer's body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunked body"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, "headers are longer than"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "two different Content-Length"),
        (b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 20", "closed inside the answer's headers"),
    ],
    ids=["not-http", "bad-length", "truncated", "bad-chunk", "huge-head", "two-lengths", "bad-header", "cut-head"],
)
async def test_a_malformed_answer_is_a_typed_error_and_an_engine_error_through_the_client(
    raw: bytes, message: str
) -> None:
    async def broken(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        while await read_request(reader, conn, server) is not None:
            writer.write(raw)
            await writer.drain()
            writer.close()
            return

    async with scripted(broken) as server:
        async with KeepAliveHttp(server.url) as http:
            with pytest.raises(EngineTransportError, match=message) as info:
                await SGLangClient(server.url, http=http).model_info()
            assert http.open_connections == 0
    assert isinstance(info.value, EngineError)
    assert info.value.url == server.url
    assert info.value.status is None
    assert "GET /model_info failed" in str(info.value)


async def test_a_refused_connection_and_a_closed_client_are_typed() -> None:
    async with scripted(serve_echo) as server:
        url = server.url
    http = KeepAliveHttp(url)
    with pytest.raises(EngineTransportError, match="cannot connect"):
        await http.request("GET", "/")
    await http.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await http.request("GET", "/")
    with pytest.raises(ValueError, match="CR or LF"):
        await KeepAliveHttp(url).request("GET", "/", headers={"Authorization": "Bearer x\r\nX-Evil: 1"})
    with pytest.raises(ValueError, match="another URL|cannot serve"):
        SGLangClient("http://127.0.0.1:1", http=KeepAliveHttp("http://127.0.0.1:2"))


async def test_tls_with_a_ca_made_here_is_verified_and_an_untrusted_certificate_refused(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    async with scripted(serve_echo, tls=server_ctx) as server:
        async with KeepAliveHttp(server.url, ssl=trusting) as http:
            assert (await http.request("GET", "/a")).content == b"GET /a HTTP/1.1|"
            assert (await http.request("GET", "/b")).content == b"GET /b HTTP/1.1|"
        assert server.accepted == 1
        async with KeepAliveHttp(server.url) as http:
            with pytest.raises(EngineTransportError, match="TLS"):
                await http.request("GET", "/a")


async def test_a_fleet_from_urls_speaks_through_its_own_keepalive_clients_with_the_api_key() -> None:
    async def sglang(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        while (request := await read_request(reader, conn, server)) is not None:
            if request.line.startswith("GET /model_info"):
                writer.write(answer(b'{"model_path": "m", "weight_version": "7"}'))
            else:
                writer.write(answer(b'{"message": "Generation paused successfully.", "status": "ok"}'))
            await writer.drain()

    async with scripted(sglang) as a, scripted(sglang) as b:
        async with EngineFleet([a.url, b.url], api_key="k") as fleet:
            for _ in range(3):
                await fleet.pause()
                assert await fleet.read_versions() == {a.url: "7", b.url: "7"}
                await fleet.resume()
    for server in (a, b):
        assert server.accepted == 1
        assert {r.headers["authorization"] for r in server.requests} == {"Bearer k"}
        assert [r.line.split()[1] for r in server.requests[:3]] == [
            "/pause_generation",
            "/model_info",
            "/continue_generation",
        ]
        assert server.requests[0].body == b'{"mode":"retract"}'


async def test_a_large_body_goes_out_whole_and_a_large_answer_comes_back_whole() -> None:
    big = bytes(range(256)) * (8 * 4096)  # 8 MiB: more than any socket buffer, so writing pauses
    async with scripted(serve_echo) as server, KeepAliveHttp(server.url) as http:
        reply = await http.request("POST", "/update_weights_from_tensor", content=big)
        again = await http.request("GET", "/after")
    assert reply.content == b"POST /update_weights_from_tensor HTTP/1.1|" + big
    assert again.content == b"GET /after HTTP/1.1|"
    assert server.accepted == 1


async def test_requests_timed_to_uvicorns_keepalive_close_all_succeed() -> None:
    """The reference engine on uvicorn (as SGLang runs) closing idle connections after 0.3 s, and a fleet whose
    requests come just before, at and just after that moment: every request succeeds. A connection uvicorn closed
    is either seen closed before it is used, or the request crosses the close and is sent once more."""
    state = EngineState()
    with ServedEngine(create_app(state), keep_alive=0.3) as engine:
        async with EngineFleet([engine.url]) as fleet:
            labels = []
            for i in range(12):
                await asyncio.sleep(0.27 + 0.005 * i)
                labels.append((await fleet.read_versions())[engine.url])
    assert labels == ["default"] * 12


async def test_an_answer_before_the_whole_body_was_read_is_taken_and_its_connection_retired() -> None:
    async def early(reader: Reader, writer: Writer, conn: int, server: Server) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        server.requests.append(Request(head.decode("latin-1").split("\r\n")[0], {}, b"", conn))
        if conn == 1:
            # Refuses the body unread, and reads nothing more: the client's write stays in its buffer.
            writer.write(answer(b"too large", status="413 Payload Too Large"))
            await writer.drain()
            await asyncio.sleep(3)
            return
        await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
        writer.write(answer(b"ok"))
        await writer.drain()

    big = b"x" * (32 * 1024 * 1024)
    async with scripted(early) as server, KeepAliveHttp(server.url, timeout=2) as http:
        refused = await http.request("POST", "/update_weights_from_tensor", content=big)
        assert http.open_connections == 0
        accepted = await http.request("POST", "/update_weights_from_tensor", content=b"{}")
    assert (refused.status_code, refused.content) == (413, b"too large")
    assert accepted.content == b"ok"
    assert server.accepted == 2
