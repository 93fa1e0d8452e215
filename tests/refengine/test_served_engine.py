"""The reference engine over real HTTP: uvicorn in a background thread via ServedEngine, and the CLI command."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import typer
from typer.testing import CliRunner

from tests._builders import wait_until
from weightbus.cli import engine as engine_cli
from weightbus.engines import SGLangClient
from weightbus.errors import EngineError
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine

# Polled faster than the engine makes tokens (2 ms each), so a wait sees a state before it moves on.
POLL = 0.002


async def test_full_weight_update_cycle_over_http() -> None:
    state = EngineState(token_delay=0.002)
    with ServedEngine(create_app(state)) as engine:
        assert engine.url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=engine.url) as http:
            assert (await http.post("/pause_generation")).status_code == 400
        async with SGLangClient(engine.url, timeout=5) as client:
            assert await client.weight_version() == "default"
            task = asyncio.create_task(client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 30}))
            await wait_until(lambda: any(len(r.output_ids) >= 2 for r in state.in_flight.values()), interval=POLL)
            await client.pause_generation("in_place")
            await wait_until(lambda: all(r.parked for r in state.in_flight.values()), interval=POLL)
            await client.update_weights_from_disk("/ckpt/1", weight_version=1)
            await client.continue_generation()
            out = await asyncio.wait_for(task, 5)
            assert out.meta_info.weight_version == "1"
            assert [span.version for span in out.meta_info.weight_versions or []] == ["default", "1"]
            assert await client.flush_cache() == "Cache flushed.\n"
    with pytest.raises(EngineError) as info:
        async with SGLangClient(engine.url, timeout=2) as client:
            await client.weight_version()
    assert info.value.status is None


async def test_stop_does_not_hang_on_a_parked_request() -> None:
    state = EngineState(token_delay=0.001)
    engine = ServedEngine(create_app(state), graceful_timeout=1).start()
    async with SGLangClient(engine.url, timeout=10) as client:
        await client.pause_generation("in_place")
        task = asyncio.create_task(client.generate(input_ids=[1], sampling_params={"max_new_tokens": 5}))
        await wait_until(lambda: any(r.parked for r in state.in_flight.values()), interval=POLL)
        started = time.monotonic()
        await asyncio.to_thread(engine.stop)
        assert time.monotonic() - started < 5
        # uvicorn cancels the parked handler after the grace period and answers 500 (or drops the connection).
        with pytest.raises(EngineError) as info:
            await task
        assert info.value.status in (None, 500)
    assert state.in_flight == {}


def test_cli_registers_the_engine_command() -> None:
    app = typer.Typer()
    engine_cli.register(app)

    @app.command("other")
    def other() -> None:
        """Keeps typer from collapsing a single command into the app."""

    result = CliRunner().invoke(app, ["engine", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--port", "--model", "--weight-version", "--api-key"):
        assert option in result.output
