"""Producer fixtures: strict reference engines reached through httpx's ASGI transport (or served over real HTTP), bus
helpers, and the catch-up tests' weight files and their invariant."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from weightbus.bus import Deliver
from weightbus.bus.protocol import Bus, Envelope, PublishAck
from weightbus.engines.sglang import SGLangClient
from weightbus.producers import VersionPublisher
from weightbus.producers.artifact import safetensors_artifact
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import Event


class Engines:
    """Reference engines on fake hosts, all reached through one shared ``httpx.AsyncClient``."""

    def __init__(self) -> None:
        self.states: dict[str, EngineState] = {}
        self._transports: dict[str, httpx.ASGITransport] = {}
        self.routes: dict[str, Callable[[httpx.Request], httpx.Response]] = {}
        self.http = httpx.AsyncClient(transport=httpx.MockTransport(self._dispatch))

    async def _dispatch(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.routes:
            return self.routes[host](request)
        transport = self._transports.get(host)
        if transport is None:
            raise httpx.ConnectError(f"no engine at {host}", request=request)
        response = await transport.handle_async_request(request)
        await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, content=response.content)

    def add(self, name: str, **knobs: object) -> SGLangClient:
        state = EngineState(**knobs)  # type: ignore[arg-type]
        self.states[f"http://{name}"] = state
        self._transports[name] = httpx.ASGITransport(app=create_app(state))
        return SGLangClient(f"http://{name}", http=self.http)

    def paths(self, url: str) -> list[str]:
        return [r.path for r in self.states[url].requests]


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[Engines]:
    e = Engines()
    yield e
    await e.http.aclose()


async def history(bus: Bus, subject: str, idle: float = 0.3) -> list[Envelope]:
    """Every stored event on ``subject``, oldest first."""
    out: list[Envelope] = []
    sub = bus.subscribe(subject, deliver=Deliver.ALL)
    try:
        while True:
            try:
                out.append(await asyncio.wait_for(sub.__anext__(), idle))
            except TimeoutError:
                return out
    finally:
        await sub.aclose()


class HookBus:
    """A ``Bus`` wrapper that runs ``hook(subject, event)`` before delegating each publish."""

    def __init__(self, inner: Bus, hook: Callable[[str, Event], Awaitable[None]]) -> None:
        self.inner = inner
        self.hook = hook

    async def publish(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str,
        expected_last_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        await self.hook(subject, event)
        return await self.inner.publish(
            subject, event, msg_id=msg_id, expected_last_seq=expected_last_seq, headers=headers
        )

    async def publish_raw(self, subject: str, data: bytes, *, msg_id: str, headers=None) -> PublishAck:  # noqa: ANN001
        return await self.inner.publish_raw(subject, data, msg_id=msg_id, headers=headers)

    def subscribe(  # noqa: ANN201
        self,
        pattern: str,
        *,
        deliver: Deliver = Deliver.LAST_PER_SUBJECT,
        include_invalid: bool = False,
        transient: bool = False,
    ):
        return self.inner.subscribe(pattern, deliver=deliver, include_invalid=include_invalid, transient=transient)

    async def last_seq(self, subject: str) -> int:
        return await self.inner.last_seq(subject)

    async def last(self, subject: str) -> Envelope | None:
        return await self.inner.last(subject)

    async def aclose(self) -> None:
        await self.inner.aclose()


def write_safetensors(path: Path, seed: int) -> Path:
    """A small safetensors file (one F32 tensor of 4 values) whose bytes depend on ``seed``; no torch."""
    data = struct.pack("<4f", *(float(seed * 10 + i) for i in range(4)))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def write_checkpoint(root: Path, seed: int = 1) -> Path:
    """A small HF-style checkpoint: a config, two shards, an index, and a tokenizer file in a subdirectory."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": ["HashLM"], "seed": seed}))
    write_safetensors(root / "model-00001-of-00002.safetensors", seed)
    rename_tensor(write_safetensors(root / "model-00002-of-00002.safetensors", seed + 1), "w", "v")
    (root / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-00001", "v": "model-00002"}}')
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    return root


def rename_tensor(path: Path, old: str, new: str) -> None:
    """Rename a tensor in a safetensors file written by ``write_safetensors`` (the names have the same length)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + length].replace(f'"{old}"'.encode(), f'"{new}"'.encode())
    path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + length :])


@pytest.fixture
def served() -> Iterator[tuple[EngineState, str]]:
    """A reference engine served over real HTTP in a thread: its state and its URL."""
    state = EngineState()
    with ServedEngine(create_app(state)) as engine:
        yield state, engine.url


async def announce_full(pub: VersionPublisher, weights: Path) -> tuple[int, Path]:
    """One full update announced by the trainer's own path, with the artifact of a file it wrote for it."""
    upd = pub.update()
    async with upd as version:
        path = write_safetensors(weights / f"weights-v{version}.safetensors", version)
        upd.artifact = safetensors_artifact(path)
    return version, path


def truthful(state: EngineState, files: dict[int, Path]) -> bool:
    """The invariant: a numeric label names exactly the weights the engine loaded."""
    label = state.weight_version
    if not label.isdigit():
        return True
    return int(label) in files and state.model_path == str(files[int(label)])


def loads(state: EngineState) -> list[object]:
    return [r.body for r in state.recorded("/update_weights_from_disk")]
