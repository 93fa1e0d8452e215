"""``weightbus status``: a policy's current version, epoch, publisher and age, and engine read-backs.

Read-only: it never claims the counter, so it never fences a running trainer. Exit codes: 0 shown,
2 bad arguments, 4 the router could not list its workers, 5 NATS unreachable.
"""

from __future__ import annotations

import json
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
from weightbus.errors import BusError, EngineError, InvalidPolicyError
from weightbus.producers import EngineFleet, PolicyStatus, read_status

__all__ = ["register"]


async def _status(
    nats: str,
    policy: str,
    engines: list[str],
    router: str | None,
    connect_timeout: float,
    connection: ConnectOptions | None = None,
) -> PolicyStatus:
    # ensure_stream=False: a status read must not create or reconfigure anything.
    bus = await connect(
        nats, name="weightbus-status", ensure_stream=False, connect_timeout=connect_timeout, options=connection
    )
    fleet: EngineFleet | None = None
    try:
        if router:
            fleet = await EngineFleet.from_router(router)
        elif engines:
            fleet = EngineFleet(engines)
        return await read_status(bus, policy, fleet=fleet)
    finally:
        if fleet is not None:
            await fleet.aclose()
        await bus.close()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.1f}min ago"
    return f"{seconds / 3600:.1f}h ago"


def _render(status: PolicyStatus) -> str:
    if status.last_event is None:
        lines = [f"policy     {status.policy}", "version    none (no publisher has claimed this policy)"]
    else:
        lora = (
            ""
            if status.lora is None
            else f" (LoRA {status.lora.name}" + (f" from {status.lora.path})" if status.lora.path else ")")
        )
        lines = [
            f"policy     {status.policy}",
            f"version    {status.version if status.version is not None else 'none yet'}{lora}",
            f"epoch      {status.epoch}",
            f"publisher  {status.publisher}",
            f"last event {status.last_event} {_age(status.age_s)}",
        ]
    expected = None if status.version is None else str(status.version)
    for e in status.engines:
        if e.error is not None:
            lines.append(f"engine     {e.engine}  error: {e.error}")
        else:
            mark = "ok" if e.weight_version == expected else f"OUT OF SYNC (bus says {expected or 'none'})"
            lines.append(f"engine     {e.engine}  {e.weight_version}  {mark}")
    return "\n".join(lines)


def status_command(
    policy: PolicyOption,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    engine: Annotated[
        list[str] | None, typer.Option("--engine", help="SGLang worker URL to read back (repeatable).")
    ] = None,
    router: RouterOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    connect_timeout: ConnectTimeoutOption = 5.0,
    verbose: VerboseOption = 0,
) -> None:
    """Show POLICY's current version, epoch, publisher and time since the last event; read-only (never claims)."""
    setup_logging(verbose)
    try:
        validate_policy(policy)
    except InvalidPolicyError as exc:
        raise fail(str(exc), 2) from None
    if engine and router:
        raise fail("pass --engine or --router, not both", 2)
    try:
        status = run_async(_status(nats, policy, list(engine or []), router, connect_timeout, connection))
    except EngineError as exc:
        raise fail(str(exc), 4) from None
    except BusError as exc:
        raise fail(str(exc), 5) from None
    if as_json:
        typer.echo(json.dumps(status.to_dict(), sort_keys=True))
    else:
        typer.echo(_render(status))


def register(app: typer.Typer) -> None:
    """Add ``status`` to ``app``."""
    app.command("status")(with_connection(status_command))
