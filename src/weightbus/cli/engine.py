"""``weightbus engine``: run the CPU reference engine (SGLang 0.5.23's weight and generate routes) until Ctrl-C.

One ``EngineConfig`` from ``--config FILE``, then the flags on top; starlette, uvicorn and torch load after parsing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer

from weightbus.cli._common import EXIT_USAGE, check_port, fail, run_async
from weightbus.errors import ConfigError
from weightbus.refengine.config import EngineConfig
from weightbus.rl.config import load_config, make_config

if TYPE_CHECKING:
    from weightbus.refengine.model import EngineModel

__all__ = ["engine_command", "register"]


def _d(name: str) -> str:
    (field,) = (f for f in msgspec.structs.fields(EngineConfig) if f.name == name)
    return f" (default: {field.default})"


def engine_command(
    config_file: Annotated[
        Path | None,
        typer.Option("--config", exists=True, help="JSON file of the engine's config (flags given override it)."),
    ] = None,
    port: Annotated[
        int | None, typer.Option("--port", help="HTTP port (SGLang's default)." + _d("port"), callback=check_port)
    ] = None,
    host: Annotated[str | None, typer.Option("--host", help="Interface to bind." + _d("host"))] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="hash: pure-Python; torch: tiny torch LM; policy: the RL loop's WindowLM (safetensors, sampling)."
            + _d("model"),
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Initial weights of the policy model (as the trainer's).")
    ] = None,
    sampling_seed: Annotated[
        int | None, typer.Option("--sampling-seed", help="Seed of the policy model's sampler.")
    ] = None,
    weight_version: Annotated[
        str | None,
        typer.Option(
            "--weight-version", help="Boot weight_version label, as SGLang's --weight-version." + _d("weight_version")
        ),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="WEIGHTBUS_API_KEY", help="Require Bearer auth.")
    ] = None,
    token_delay: Annotated[
        float | None, typer.Option("--token-delay", help="Seconds per generated token." + _d("token_delay"))
    ] = None,
) -> None:
    """Serve a reference SGLang engine on HOST:PORT that tracks weight_version like SGLang 0.5.23.

    Exit codes: 0 stopped, 1 the engine extra is missing, 2 bad arguments or HOST:PORT cannot be bound,
    130/143 interrupted.
    """
    try:
        base = load_config(config_file, EngineConfig) if config_file is not None else None
        config = make_config(
            EngineConfig,
            base,
            port=port,
            host=host,
            model=model,
            seed=seed,
            sampling_seed=sampling_seed,
            weight_version=weight_version,
            token_delay=token_delay,
        )
    except ConfigError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    try:
        from weightbus.refengine.reference import EngineState, create_app
        from weightbus.refengine.serve import listen, serve_forever
    except ImportError as exc:
        raise fail(f"the reference engine needs the 'engine' extra (starlette, uvicorn): {exc}") from None
    try:
        # Bound before anything starts and handed to uvicorn, so a taken port is one line rather than a server log.
        sock = listen(config.host, config.port)
    except OSError as exc:
        raise fail(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", EXIT_USAGE) from None
    state = EngineState(
        model=_model(config), weight_version=config.weight_version, api_key=api_key, token_delay=config.token_delay
    )
    typer.echo(f"http://{config.host}:{config.port}", color=False)
    typer.echo(
        f"reference engine ({config.model} model, weight_version {config.weight_version!r}); Ctrl-C to stop", err=True
    )
    run_async(serve_forever(create_app(state), config.host, config.port, sock=sock))


def _model(config: EngineConfig) -> EngineModel | None:
    engine_model: EngineModel | None = None
    try:
        if config.model == "torch":
            from weightbus.refengine.tiny_model import TinyTorchModel

            engine_model = TinyTorchModel()
        elif config.model == "policy":
            from weightbus.refengine.policy_model import WindowLM

            engine_model = WindowLM(seed=config.seed, sampling_seed=config.sampling_seed)
    except ImportError as exc:
        raise fail(f"--model {config.model} needs torch (the 'engine' extra): {exc}") from None
    return engine_model


def register(app: typer.Typer) -> None:
    """Add ``engine`` to ``app``."""
    app.command("engine")(engine_command)
