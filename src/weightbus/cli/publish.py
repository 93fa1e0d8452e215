"""``weightbus publish``: bump a policy's weight version once, by hand (claim, stamp, verify, publish).

Safe by default: no takeover of a live owner without ``--takeover``, no version no engine carries, no engine left
paused, whatever ends it. Exit codes: docs/cli.md.
"""

from __future__ import annotations

import asyncio
import getpass
import socket
from dataclasses import dataclass
from pathlib import Path
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
    RouterOption,
    VerboseOption,
)
from weightbus.engines._http import normalize_url
from weightbus.engines.sglang import PauseMode
from weightbus.errors import (
    BusError,
    EngineError,
    FencedError,
    InvalidEventError,
    OwnerAliveError,
    PermissionDeniedError,
)
from weightbus.process.logs import setup_logging
from weightbus.producers import EngineFleet, VersionPublisher
from weightbus.producers.artifact import CheckedArtifact, checkpoint_artifact, safetensors_artifact
from weightbus.producers.lora import push_lora_adapter
from weightbus.producers.status import read_weights_history
from weightbus.schemas import LoraAdapter, WeightArtifact, now

__all__ = [
    "EXIT_ENGINE",
    "EXIT_FENCED",
    "EXIT_INVALID",
    "EXIT_NATS",
    "default_cli_trainer_id",
    "publish_command",
    "register",
]

EXIT_FENCED: Final = 3
EXIT_ENGINE: Final = 4
EXIT_NATS: Final = 5
EXIT_INVALID: Final = 6


def default_cli_trainer_id() -> str:
    """``cli:<user>@<host>``: the same for every manual publish of one operator on one host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


@dataclass(frozen=True, slots=True)
class _Request:
    nats: str
    policy: str
    engines: list[str]
    router: str | None
    lora: LoraAdapter | None
    lora_replace: bool
    trainer_id: str
    pause: PauseMode | None
    connect_timeout: float
    takeover: bool
    alive_window: float
    engine_timeout: float
    api_key: str | None
    connection: ConnectOptions | None = None
    artifact: Path | None = None


async def _resume(fleet: EngineFleet) -> None:
    try:
        await fleet.resume()
    except EngineError as exc:
        typer.echo(f"warning: resuming the engines failed: {exc}", err=True)


async def _artifact(path: Path, lora: bool, current: int | None) -> tuple[WeightArtifact, CheckedArtifact]:
    """The artifact of what was pushed, a checkpoint directory or a safetensors file (a LoRA adapter is a delta on
    the version before this one, the base weights it is loaded on), and its files' identities from before hashing.

    Raises:
        ValueError: it cannot be read, is no safetensors file, changed while it was hashed, or an adapter has no
            version before it.
    """
    base = None
    if lora:
        if current is None:
            raise ValueError(
                "--artifact with --lora-adapter is a delta on the version before this one, and the policy has none"
            )
        base = current

    def build() -> tuple[WeightArtifact, CheckedArtifact]:
        checked = CheckedArtifact.now(path)
        artifact = checkpoint_artifact(path, base) if path.is_dir() else safetensors_artifact(path, base)
        why = checked.changed()
        if why is not None:
            raise ValueError(f"it changed while it was hashed: {why}")
        return artifact, checked

    try:
        # In a thread: hashing a checkpoint takes seconds, and nothing is claimed or paused yet.
        return await asyncio.to_thread(build)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--artifact {path}: {exc}") from None


async def _publish(req: _Request) -> int:
    bus = await connect(req.nats, name="weightbus-publish", connect_timeout=req.connect_timeout, options=req.connection)
    fleet: EngineFleet | None = None
    paused = False
    try:
        history = await read_weights_history(bus, req.policy)
        artifact = checked = None
        if req.artifact is not None:  # refused before the claim, which would fence the owner
            artifact, checked = await _artifact(req.artifact, req.lora is not None, history.state.version)
        owner = history.last_accepted
        if owner is not None and owner.trainer_id != req.trainer_id and not req.takeover:
            age = max(0.0, now() - owner.published_at)
            if age < req.alive_window:
                raise OwnerAliveError(req.policy, owner.trainer_id, age, req.alive_window)
        if req.router:
            fleet = await EngineFleet.from_router(req.router, api_key=req.api_key, timeout=req.engine_timeout)
        elif req.engines:
            fleet = EngineFleet(req.engines, api_key=req.api_key, timeout=req.engine_timeout)
        # The command pauses and resumes the fleet itself (same order: pause, stamp, verify, publish,
        # resume) so that a cancel at any await still resumes every engine it paused.
        # One update per run: reserving a next number would make the next run's claim skip it.
        pub = VersionPublisher(bus, req.policy, trainer_id=req.trainer_id, fleet=fleet, reserve_next=False)
        await pub.start()
        if req.pause is not None and fleet is not None:
            paused = True  # before the await: a cancel mid-pause may have paused some engines already
            await fleet.pause(req.pause)
        async with pub.update(lora=req.lora, artifact=artifact) as version:
            if req.lora is not None and req.lora.path is not None and fleet is not None:
                await push_lora_adapter(fleet, req.lora.name, req.lora.path, replace=req.lora_replace)
            why = None if checked is None else await asyncio.to_thread(checked.changed)
            if why is not None:  # the engines may hold other bytes than the digest says: nothing announced
                raise ValueError(
                    f"--artifact {req.artifact} changed after it was hashed ({why}); nothing was published"
                )
        if paused and fleet is not None:
            paused = False
            await fleet.resume()
        return version
    finally:
        if paused and fleet is not None:
            # Shielded: a second cancel must not leave the engines paused either.
            await asyncio.shield(_resume(fleet))
        if fleet is not None:
            await fleet.aclose()
        await bus.aclose()


EngineOption = Annotated[
    list[str] | None, typer.Option("--engine", help="SGLang worker URL to stamp and verify (repeatable).")
]
NoEnginesOption = Annotated[
    bool, typer.Option("--no-engines", help="Announce a version without stamping any engine (you stamp them).")
]
LoraAdapterOption = Annotated[
    str | None, typer.Option("--lora-adapter", help="Name of the LoRA adapter this push carries.")
]
LoraPathOption = Annotated[
    str | None,
    typer.Option("--lora-path", help="Load the adapter from this path on every engine before stamping."),
]
LoraReplaceOption = Annotated[
    bool,
    typer.Option(
        "--lora-replace/--no-lora-replace", help="Re-push an adapter name an engine already serves (unload, then load)."
    ),
]
TrainerIdOption = Annotated[
    str | None, typer.Option("--trainer-id", help="Publisher identity (default cli:<user>@<host>).")
]
PauseOption = Annotated[
    str | None, typer.Option("--pause", help="Pause the engines around the stamp: retract, in_place or abort.")
]
TakeoverOption = Annotated[
    bool, typer.Option("--takeover", help="Claim the counter even if its owner is alive (fences it).")
]
ArtifactOption = Annotated[
    Path | None,
    typer.Option(
        "--artifact",
        help="Announce where these weights are, with their sha256: a checkpoint directory (what SGLang loads) or a "
        "safetensors file; with --lora-adapter, the adapter's. Lets `weightbus catchup` bring a restarted engine "
        "to this version.",
    ),
]
AliveWindowOption = Annotated[
    float, typer.Option("--alive-window", min=0.0, help="An owner with an event this recent (seconds) is alive.")
]


def _check_targets(
    engines: list[str], router: str | None, no_engines: bool, pause: str | None, adapter: str | None, path: str | None
) -> None:
    """The engine, pause and adapter options agree (one ``error:`` line and exit 2 if not)."""
    if path is not None and adapter is None:
        raise fail("--lora-path needs --lora-adapter NAME", EXIT_USAGE)
    if engines and router:
        raise fail("pass --engine or --router, not both", EXIT_USAGE)
    if no_engines and (engines or router):
        raise fail("--no-engines contradicts --engine/--router", EXIT_USAGE)
    if not (engines or router or no_engines):
        raise fail(
            "no engines: pass --engine URL or --router URL, or --no-engines to announce a version no engine "
            "was stamped with",
            EXIT_USAGE,
        )
    if pause is not None and pause not in ("retract", "in_place", "abort"):
        raise fail(f"--pause must be retract, in_place or abort, not {pause!r}", EXIT_USAGE)
    if pause is not None and no_engines:
        raise fail("--pause needs --engine or --router", EXIT_USAGE)
    if path is not None and no_engines:
        raise fail("--lora-path needs --engine or --router to load the adapter on", EXIT_USAGE)
    try:
        for url in [*engines, *([router] if router else [])]:
            normalize_url(url)
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE) from None


def _run(request: _Request) -> int:
    """Publish once; each failure is one ``error:`` line and the exit code the module docstring lists."""
    try:
        return run_async(_publish(request))
    except (FencedError, OwnerAliveError) as exc:
        raise fail(str(exc), EXIT_FENCED) from None
    except EngineError as exc:
        raise fail(_with_notes(exc) + "; nothing was published", EXIT_ENGINE) from None
    except InvalidEventError as exc:
        raise fail(f"{exc}; fix or purge the subject before publishing", EXIT_INVALID) from None
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_NATS) from None
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE) from None


def publish_command(
    policy: PolicyOption,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    engine: EngineOption = None,
    router: RouterOption = None,
    no_engines: NoEnginesOption = False,
    lora_adapter: LoraAdapterOption = None,
    lora_path: LoraPathOption = None,
    lora_replace: LoraReplaceOption = True,
    artifact: ArtifactOption = None,
    trainer_id: TrainerIdOption = None,
    pause: PauseOption = None,
    takeover: TakeoverOption = False,
    alive_window: AliveWindowOption = 120.0,
    engine_timeout: EngineTimeoutOption = 30.0,
    api_key: ApiKeyOption = None,
    connect_timeout: ConnectTimeoutOption = 5.0,
    verbose: VerboseOption = 0,
) -> None:
    """Bump POLICY's weight version once: claim the counter, stamp and verify the engines, publish, print it.

    Refuses (exit 3) when another trainer published within --alive-window seconds, unless --takeover;
    refuses (exit 2) without --engine/--router unless --no-engines. Ctrl-C or SIGTERM resume any engine
    this command paused.

    Exit codes: 0 published (version on stdout), 2 bad arguments, 3 fenced or owner alive, 4 engine error
    or out of sync, 5 NATS unreachable or publish failed, 6 invalid event stored, 77 permission denied,
    130/143 interrupted.
    """
    setup_logging(verbose)
    engines = list(engine or [])
    _check_targets(engines, router, no_engines, pause, lora_adapter, lora_path)
    if artifact is not None and not (artifact.is_file() or artifact.is_dir()):
        raise fail(f"--artifact {artifact} is not a file or a directory", EXIT_USAGE)
    if artifact is not None and lora_path is not None and artifact.absolute() != Path(lora_path).absolute():
        raise fail(f"--artifact {artifact} is not the adapter --lora-path loads ({lora_path})", EXIT_USAGE)
    request = _Request(
        nats=nats,
        policy=policy,
        engines=engines,
        router=router,
        lora=LoraAdapter(name=lora_adapter, path=lora_path) if lora_adapter is not None else None,
        lora_replace=lora_replace,
        trainer_id=trainer_id or default_cli_trainer_id(),
        pause=pause,  # type: ignore[arg-type]
        connect_timeout=connect_timeout,
        takeover=takeover,
        alive_window=alive_window,
        engine_timeout=engine_timeout,
        api_key=api_key,
        connection=connection,
        artifact=None if artifact is None else artifact.absolute(),  # the path the engines and catch-ups read
    )
    typer.echo(str(_run(request)))


def _with_notes(exc: BaseException) -> str:
    notes = getattr(exc, "__notes__", None) or []
    return "; ".join([str(exc), *notes])


def register(app: typer.Typer) -> None:
    """Add ``publish`` to ``app``."""
    app.command("publish")(with_connection(publish_command))
