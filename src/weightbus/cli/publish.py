"""``weightbus publish``: bump a policy's weight version once, by hand (claim, stamp, verify, publish).

It claims the counter first, so a running trainer of the same policy is fenced by it: its next
publish fails with ``FencedError``. Exit codes: 0 published (the version is printed on stdout),
2 bad arguments, 3 fenced, 4 an engine failed or is out of sync, 5 NATS unreachable or publish failed.
"""

from __future__ import annotations

from typing import Annotated

import typer

from weightbus.bus.nats import connect
from weightbus.bus.options import ConnectOptions
from weightbus.bus.subjects import validate_policy
from weightbus.cli._common import (
    DEFAULT_NATS,
    ConnectTimeoutOption,
    NatsOption,
    PolicyOption,
    RouterOption,
    VerboseOption,
    fail,
    run_async,
    setup_logging,
    with_connection,
)
from weightbus.errors import BusError, EngineError, FencedError, InvalidPolicyError
from weightbus.producers import EngineFleet, VersionPublisher, default_trainer_id
from weightbus.schemas import LoraAdapter

__all__ = ["register"]

EXIT_FENCED = 3
EXIT_ENGINE = 4
EXIT_BUS = 5


async def _publish(
    nats: str,
    policy: str,
    engines: list[str],
    router: str | None,
    lora: LoraAdapter | None,
    trainer_id: str | None,
    pause: str | None,
    connect_timeout: float,
    connection: ConnectOptions | None = None,
) -> int:
    bus = await connect(nats, name="weightbus-publish", connect_timeout=connect_timeout, options=connection)
    fleet: EngineFleet | None = None
    try:
        if router:
            fleet = await EngineFleet.from_router(router)
        elif engines:
            fleet = EngineFleet(engines)
        pub = VersionPublisher(
            bus,
            policy,
            trainer_id=trainer_id or f"cli:{default_trainer_id()}",
            fleet=fleet,
            pause=pause,  # type: ignore[arg-type]
        )
        await pub.start()
        if lora is not None and lora.path is not None and fleet is not None:
            return await pub.publish_lora(lora)
        async with pub.update(lora=lora) as version:
            pass
        return version
    finally:
        if fleet is not None:
            await fleet.aclose()
        await bus.close()


def publish_command(
    policy: PolicyOption,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    engine: Annotated[
        list[str] | None, typer.Option("--engine", help="SGLang worker URL to stamp and verify (repeatable).")
    ] = None,
    router: RouterOption = None,
    lora: Annotated[str | None, typer.Option("--lora", help="Name of the LoRA adapter this push carries.")] = None,
    lora_path: Annotated[
        str | None,
        typer.Option("--lora-path", help="Load the adapter from this path on every engine before stamping."),
    ] = None,
    trainer_id: Annotated[
        str | None, typer.Option("--trainer-id", help="Publisher identity (default cli:<host>:<pid>).")
    ] = None,
    pause: Annotated[
        str | None, typer.Option("--pause", help="Pause the engines around the stamp: retract, in_place or abort.")
    ] = None,
    connect_timeout: ConnectTimeoutOption = 5.0,
    verbose: VerboseOption = 0,
) -> None:
    """Bump POLICY's weight version once: claim the counter, stamp and verify the engines, publish, print it.

    Claiming fences any running trainer of the policy (its next publish is refused). Exit codes: 3 fenced,
    4 engine error or out of sync, 5 NATS unreachable or publish failed.
    """
    setup_logging(verbose)
    try:
        validate_policy(policy)
    except InvalidPolicyError as exc:
        raise fail(str(exc), 2) from None
    if lora_path is not None and lora is None:
        raise fail("--lora-path needs --lora NAME", 2)
    if engine and router:
        raise fail("pass --engine or --router, not both", 2)
    if pause is not None and pause not in ("retract", "in_place", "abort"):
        raise fail(f"--pause must be retract, in_place or abort, not {pause!r}", 2)
    if pause is not None and not (engine or router):
        raise fail("--pause needs --engine or --router", 2)
    adapter = LoraAdapter(name=lora, path=lora_path) if lora is not None else None
    try:
        version = run_async(
            _publish(nats, policy, list(engine or []), router, adapter, trainer_id, pause, connect_timeout, connection)
        )
    except FencedError as exc:
        raise fail(str(exc), EXIT_FENCED) from None
    except EngineError as exc:
        raise fail(_with_notes(exc) + "; nothing was published", EXIT_ENGINE) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_BUS) from None
    typer.echo(str(version))


def _with_notes(exc: BaseException) -> str:
    notes = getattr(exc, "__notes__", None) or []
    return "; ".join([str(exc), *notes])


def register(app: typer.Typer) -> None:
    """Add ``publish`` to ``app``."""
    app.command("publish")(with_connection(publish_command))
