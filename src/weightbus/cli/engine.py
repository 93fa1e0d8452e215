"""``weightbus engine``: run the CPU reference engine (SGLang 0.5.23's weight and generate routes) until Ctrl-C.

One ``EngineConfig`` from ``--config FILE``, then the flags on top (one per field: ``cli.config_flags``); starlette,
uvicorn and torch load after parsing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Final

import typer

from weightbus.cli._common import EXIT_USAGE, check_port, fail, run_async
from weightbus.cli.config_flags import ConfigFlags, Flag
from weightbus.refengine.config import EngineConfig

if TYPE_CHECKING:
    from weightbus.refengine.model import EngineModel

__all__ = ["ENGINE_FLAGS", "engine_command", "register"]


#: One flag per field of ``EngineConfig``; the port is checked as every command's port is.
ENGINE_FLAGS: Final = ConfigFlags(EngineConfig, {"port": Flag(callback=check_port)})


@ENGINE_FLAGS
def engine_command(
    config: EngineConfig,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="WEIGHTBUS_API_KEY", help="Require Bearer auth.")
    ] = None,
) -> None:
    """Serve a reference SGLang engine on HOST:PORT that tracks weight_version like SGLang 0.5.23.

    Exit codes: 0 stopped, 1 the engine extra is missing, 2 bad arguments or HOST:PORT cannot be bound,
    130/143 interrupted.
    """
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
