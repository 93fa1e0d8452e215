"""``weightbus catchup``: bring one restarted or lagging engine to the policy's announced version, from the bus alone.

The library call is ``producers.catchup.catch_up``; this command only connects, runs it once and maps how it ended to
an exit code (docs/cli.md). It never claims the counter (never fences a trainer).
"""

from __future__ import annotations

import json
from typing import Annotated, Final

import typer

from weightbus.bus.nats import connect
from weightbus.bus.options import ConnectOptions
from weightbus.cli.connection import with_connection
from weightbus.cli.exits import EXIT_DENIED, EXIT_USAGE, fail, run_async
from weightbus.cli.options import (
    DEFAULT_NATS,
    ApiKeyOption,
    ConnectTimeoutOption,
    EngineTimeoutOption,
    NatsOption,
    PolicyOption,
    VerboseOption,
)
from weightbus.engines._http import normalize_url
from weightbus.engines.sglang import SGLangClient
from weightbus.errors import (
    ArtifactDigestError,
    ArtifactLineageError,
    ArtifactMissingError,
    BusError,
    CatchupError,
    PermissionDeniedError,
)
from weightbus.process.logs import setup_logging
from weightbus.producers.catchup import CatchupResult, catch_up

__all__ = [
    "EXIT_ARTIFACT",
    "EXIT_ENGINE",
    "EXIT_NATS",
    "EXIT_NEVER_PUBLISHED",
    "EXIT_OK",
    "catchup_command",
    "register",
]

EXIT_OK: Final = 0
#: The engine does not serve the announced version: it failed (quarantined), a trainer's update holds it, or the
#: bus moved on faster than the catch-up (left truthfully labelled with the older verified version).
EXIT_ENGINE: Final = 3
EXIT_NEVER_PUBLISHED: Final = 4
EXIT_NATS: Final = 5
#: No verified, loadable artifact names the version (digest mismatch, missing file, no artifact, unannounced base).
EXIT_ARTIFACT: Final = 6


async def _run(
    nats: str,
    policy: str,
    engine: str,
    api_key: str | None,
    engine_timeout: float,
    connect_timeout: float,
    rounds: int,
    connection: ConnectOptions,
) -> CatchupResult:
    # ensure_stream=False: catching an engine up must not create or reconfigure the stream.
    bus = await connect(
        nats, name="weightbus-catchup", ensure_stream=False, connect_timeout=connect_timeout, options=connection
    )
    try:
        async with SGLangClient(engine, api_key=api_key, timeout=engine_timeout) as client:
            return await catch_up(bus, policy, client, rounds=rounds)
    finally:
        await bus.aclose()


def catchup_command(
    engine: Annotated[str, typer.Option("--engine", help="The SGLang worker URL to bring up to date (not a router).")],
    policy: PolicyOption,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    rounds: Annotated[
        int, typer.Option("--rounds", min=1, help="Newer announcements to follow after the first load before stopping.")
    ] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    api_key: ApiKeyOption = None,
    engine_timeout: EngineTimeoutOption = 300.0,
    connect_timeout: ConnectTimeoutOption = 5.0,
    verbose: VerboseOption = 0,
) -> None:
    """Bring ENGINE (restarted, or behind) to the version POLICY announced, from the bus alone, without the trainer.

    It loads the newest announced full artifact the version stands on (and a LoRA version's adapter on it), each
    file checked against its announced digests before the engine is touched; pauses the engine, loads with the
    label, reads it back, publishes WeightApplied and resumes. An engine at or above the version is not touched.
    On a failure the engine is quarantined (quarantine:<v>, an alert). The files must be readable here at the
    paths the engine loads them from.

    Exit codes: 0 the engine serves the announced version, 2 bad arguments, 3 it does not (engine failed and
    quarantined, a trainer's update holds it, or the bus moved on: left at the older verified version), 4 the
    policy never announced a version, 5 NATS unreachable, 6 no verified artifact names the version (digest
    mismatch, missing file, no artifact, base never announced; quarantined), 77 permission denied.
    """
    setup_logging(verbose)
    try:
        normalize_url(engine)
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    try:
        result = run_async(_run(nats, policy, engine, api_key, engine_timeout, connect_timeout, rounds, connection))
    except (ArtifactDigestError, ArtifactMissingError, ArtifactLineageError) as exc:
        raise fail(str(exc), EXIT_ARTIFACT) from None
    except CatchupError as exc:
        raise fail(str(exc), EXIT_NEVER_PUBLISHED if exc.reason == "never_published" else EXIT_ENGINE) from None
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_NATS) from None
    if as_json:
        doc = {
            "engine": result.engine,
            "outcome": result.outcome,
            "before": result.before,
            "label": result.label,
            "version": result.version,
            "announced": result.announced,
            "loaded": list(result.loaded),
        }
        typer.echo(json.dumps(doc, sort_keys=True))
    else:
        loaded = ", ".join(f"v{v}" for v in result.loaded) or "nothing"
        typer.echo(f"{result.engine}  {result.before} -> {result.label}  {result.outcome} (loaded {loaded})")
    if result.outcome == "behind":
        raise fail(f"the bus announced v{result.announced} meanwhile; the engine serves v{result.version}", EXIT_ENGINE)
    raise typer.Exit(EXIT_OK)


def register(app: typer.Typer) -> None:
    """Add ``catchup`` to ``app``."""
    app.command("catchup")(with_connection(catchup_command))
