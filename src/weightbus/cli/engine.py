"""``weightbus engine``: run the CPU reference engine (SGLang 0.5.23's weight and generate routes) until Ctrl-C.

starlette, uvicorn and (for ``--model torch``) torch are imported inside the command, after option parsing.
"""

from __future__ import annotations

import socket
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from weightbus.cli._common import EXIT_USAGE, check_port, fail, run_async

if TYPE_CHECKING:
    from weightbus.refengine.model import EngineModel

__all__ = ["register"]


class _ModelChoice(str, Enum):
    hash = "hash"
    torch = "torch"
    policy = "policy"


def engine_command(
    port: Annotated[
        int, typer.Option("--port", help="HTTP port (SGLang's default is 30000).", callback=check_port)
    ] = 30000,
    host: Annotated[str, typer.Option("--host", help="Interface to bind.")] = "127.0.0.1",
    model: Annotated[
        _ModelChoice,
        typer.Option(
            "--model",
            help="hash: pure-Python; torch: tiny torch LM; policy: the RL loop's WindowLM (safetensors, sampling).",
        ),
    ] = _ModelChoice.hash,
    seed: Annotated[int, typer.Option("--seed", help="Initial weights of the policy model (as the trainer's).")] = 0,
    sampling_seed: Annotated[int, typer.Option("--sampling-seed", help="Seed of the policy model's sampler.")] = 0,
    weight_version: Annotated[
        str, typer.Option("--weight-version", help="Boot weight_version label, as SGLang's --weight-version.")
    ] = "default",
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="WEIGHTBUS_API_KEY", help="Require Bearer auth.")
    ] = None,
    token_delay: Annotated[float, typer.Option("--token-delay", help="Seconds per generated token.")] = 0.01,
) -> None:
    """Serve a reference SGLang engine on HOST:PORT that tracks weight_version like SGLang 0.5.23.

    Exit codes: 0 stopped, 1 the engine extra is missing, 2 bad arguments or HOST:PORT cannot be bound,
    130/143 interrupted.
    """
    try:
        # Checked before anything starts, so a taken port is one line rather than a server log.
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}", EXIT_USAGE) from None
    try:
        from weightbus.refengine.reference import EngineState, create_app
        from weightbus.refengine.serve import serve_forever
    except ImportError as exc:
        raise fail(f"the reference engine needs the 'engine' extra (starlette, uvicorn): {exc}") from None
    engine_model: EngineModel | None = None
    try:
        if model is _ModelChoice.torch:
            from weightbus.refengine.tiny_model import TinyTorchModel

            engine_model = TinyTorchModel()
        elif model is _ModelChoice.policy:
            from weightbus.refengine.policy_model import WindowLM

            engine_model = WindowLM(seed=seed, sampling_seed=sampling_seed)
    except ImportError as exc:
        raise fail(f"--model {model.value} needs torch (the 'engine' extra): {exc}") from None
    state = EngineState(model=engine_model, weight_version=weight_version, api_key=api_key, token_delay=token_delay)
    typer.echo(f"http://{host}:{port}", color=False)
    typer.echo(f"reference engine ({model.value} model, weight_version {weight_version!r}); Ctrl-C to stop", err=True)
    run_async(serve_forever(create_app(state), host, port))


def register(app: typer.Typer) -> None:
    """Add ``engine`` to ``app``."""
    app.command("engine")(engine_command)
