"""``weightbus catchup``: bring one restarted or lagging engine to the policy's announced version, from the bus alone.

The library call is ``producers.catchup.catch_up``; this command only connects, runs it once and maps how it ended to
an exit code (docs/cli.md). With ``--watch`` it runs ``producers.watcher.FleetCatchup`` over the engines instead, until
``--duration`` or an interrupt, printing each catch-up as it ends. It never claims the counter (never fences a trainer).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Annotated, Final

import typer
from prometheus_client import CollectorRegistry

from weightbus.bus.metrics import BusMetrics
from weightbus.bus.nats import NatsBus, connect
from weightbus.bus.options import ConnectOptions
from weightbus.cli.connection import with_connection
from weightbus.cli.exits import EXIT_DENIED, EXIT_USAGE, fail, run_async
from weightbus.cli.metrics_server import start_metrics
from weightbus.cli.options import (
    DEFAULT_NATS,
    ApiKeyOption,
    ConnectTimeoutOption,
    EngineTimeoutOption,
    MetricsHostOption,
    MetricsPortOption,
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
from weightbus.producers.fleet import EngineFleet
from weightbus.producers.metrics import CatchupMetrics
from weightbus.producers.watcher import FleetCatchup

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


def _exit_code(outcome: CatchupResult | BaseException) -> int:
    if isinstance(outcome, ArtifactDigestError | ArtifactMissingError | ArtifactLineageError):
        return EXIT_ARTIFACT
    if isinstance(outcome, CatchupError):
        return EXIT_NEVER_PUBLISHED if outcome.reason == "never_published" else EXIT_ENGINE
    if isinstance(outcome, BaseException):
        raise outcome  # a bus failure (or worse): the command's own handling
    return EXIT_ENGINE if outcome.outcome == "behind" else EXIT_OK


@dataclass(frozen=True, slots=True)
class _Job:
    """What a run of the command catches up, and how it reaches the bus and the engines."""

    nats: str
    policy: str
    engines: list[str]
    api_key: str | None
    engine_timeout: float
    connect_timeout: float
    rounds: int
    connection: ConnectOptions

    async def connect(self, metrics: BusMetrics | None = None) -> NatsBus:
        # ensure_stream=False: catching an engine up must not create or reconfigure the stream.
        return await connect(
            self.nats,
            name="weightbus-catchup",
            ensure_stream=False,
            connect_timeout=self.connect_timeout,
            options=self.connection,
            metrics=metrics,
        )


async def _run(job: _Job) -> list[CatchupResult | BaseException]:
    bus = await job.connect()

    async def one(url: str) -> CatchupResult:
        async with SGLangClient(url, api_key=job.api_key, timeout=job.engine_timeout) as client:
            return await catch_up(bus, job.policy, client, rounds=job.rounds)

    try:
        # Each engine on its own: one that fails is quarantined, the others still catch up.
        return list(await asyncio.gather(*(one(url) for url in job.engines), return_exceptions=True))
    finally:
        await bus.aclose()


async def _watch(
    job: _Job, interval: float, duration: float | None, registry: CollectorRegistry, as_json: bool
) -> None:
    bus = await job.connect(BusMetrics(registry))
    try:
        async with EngineFleet(job.engines, api_key=job.api_key, timeout=job.engine_timeout) as fleet:
            watcher = FleetCatchup(
                bus, job.policy, fleet, interval=interval, metrics=CatchupMetrics(registry), rounds=job.rounds
            )
            try:
                async with asyncio.timeout(duration):
                    async for done in watcher.results():
                        for url, outcome in done.items():
                            _print(url, outcome, as_json)
            except TimeoutError:
                return
    finally:
        await bus.aclose()


def _doc(url: str, outcome: CatchupResult | BaseException) -> dict[str, object]:
    if isinstance(outcome, CatchupError):
        return {"engine": url, "error": str(outcome), "reason": outcome.reason, "quarantined": outcome.quarantined}
    assert isinstance(outcome, CatchupResult)
    return {
        "engine": outcome.engine,
        "outcome": outcome.outcome,
        "before": outcome.before,
        "label": outcome.label,
        "version": outcome.version,
        "announced": outcome.announced,
        "loaded": list(outcome.loaded),
    }


def _print(url: str, outcome: CatchupResult | BaseException, as_json: bool) -> None:
    """One engine's outcome: a JSON object, or a line (an ``error:`` line on stderr when it does not serve it)."""
    if as_json:
        typer.echo(json.dumps(_doc(url, outcome), sort_keys=True))
    elif isinstance(outcome, CatchupResult):
        loaded = ", ".join(f"v{v}" for v in outcome.loaded) or "nothing"
        typer.echo(f"{url}  {outcome.before} -> {outcome.label}  {outcome.outcome} (loaded {loaded})")
        if outcome.outcome == "behind":
            typer.echo(
                f"error: {url}: the bus announced v{outcome.announced} meanwhile; it serves v{outcome.version}",
                err=True,
            )
    else:
        fail(str(outcome))  # one error: line per engine; the exit code is decided by the caller


def catchup_command(
    policy: PolicyOption,
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", help="SGLang worker URL to bring up to date (repeatable; a worker, not a router)."),
    ] = None,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds", min=1, help="The most versions to load in turn, following what is announced meanwhile."
        ),
    ] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per engine.")] = False,
    watch: Annotated[
        float | None,
        typer.Option(
            "--watch",
            min=0.05,
            help="Keep watching: every this many seconds, catch up the engines that fall behind (until --duration).",
        ),
    ] = None,
    duration: Annotated[
        float | None, typer.Option("--duration", min=0.0, help="With --watch: exit after this many seconds.")
    ] = None,
    metrics_port: MetricsPortOption = None,
    metrics_host: MetricsHostOption = "127.0.0.1",
    api_key: ApiKeyOption = None,
    engine_timeout: EngineTimeoutOption = 300.0,
    connect_timeout: ConnectTimeoutOption = 5.0,
    verbose: VerboseOption = 0,
) -> None:
    """Bring each --engine (restarted, or behind) to the version POLICY announced, from the bus alone.

    Without the trainer: it loads the newest announced full artifact the version stands on (and a LoRA
    version's adapter on it), each file checked against its announced digests before the engine is touched;
    pauses the engine, loads with the label, reads it back, publishes WeightApplied and resumes. An engine at or
    above the version is not touched. On a failure the engine is quarantined (quarantine:<v>, an alert). The
    files must be readable here at the paths the engine loads them from. Engines are caught up concurrently.

    With --watch: every SECONDS, each engine whose label is behind the announced version is caught up (one whose
    artifact failed is retried only after a new announcement); each catch-up is printed as it ends; exit 0 at
    --duration, 130/143 when interrupted; --metrics-port serves the catch-up counters.

    Exit codes (lowest wins over the engines): 0 every engine serves the announced version, 2 bad arguments, 3
    an engine does not (it failed and was quarantined, a trainer's update holds it, or the bus moved on: left
    at the older verified version), 4 the policy never announced a version, 5 NATS unreachable, 6 no verified
    artifact names the version (digest mismatch, missing file, no artifact, base never announced; quarantined),
    77 permission denied.
    """
    setup_logging(verbose)
    engines = list(engine or [])
    if not engines:
        raise fail("pass at least one --engine URL", EXIT_USAGE)
    try:
        for url in engines:
            normalize_url(url)
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    if len(set(engines)) != len(engines):
        raise fail("an engine is named twice", EXIT_USAGE)
    if watch is None and (duration is not None or metrics_port is not None):
        raise fail("--duration and --metrics-port need --watch", EXIT_USAGE)
    job = _Job(nats, policy, engines, api_key, engine_timeout, connect_timeout, rounds, connection)
    if watch is not None:
        registry = CollectorRegistry()
        start_metrics(metrics_port, registry, metrics_host)
        try:
            run_async(_watch(job, watch, duration, registry, as_json))
        except PermissionDeniedError as exc:
            raise fail(str(exc), EXIT_DENIED) from None
        except BusError as exc:
            raise fail(str(exc), EXIT_NATS) from None
        return
    try:
        outcomes = run_async(_run(job))
        codes = [_exit_code(outcome) for outcome in outcomes]
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_NATS) from None
    for url, outcome in zip(engines, outcomes, strict=True):
        _print(url, outcome, as_json)
    failed = [code for code in codes if code != EXIT_OK]
    raise typer.Exit(min(failed, default=EXIT_OK))


def register(app: typer.Typer) -> None:
    """Add ``catchup`` to ``app``."""
    app.command("catchup")(with_connection(catchup_command))
