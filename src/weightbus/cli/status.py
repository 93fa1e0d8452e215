"""``weightbus status``: a policy's current version, epoch, publisher and age, engine read-backs, and convergence.

Read-only (it never fences a trainer): what every tracker holds, a refused event flagged. Exit codes: docs/cli.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

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
from weightbus.consumers.replicas import read_replicas
from weightbus.engines._http import normalize_url
from weightbus.errors import BusError, EngineError, PermissionDeniedError
from weightbus.process.logs import setup_logging
from weightbus.producers import EngineFleet
from weightbus.producers.status import EngineReadBack, read_weights_history
from weightbus.rules.history import WeightsHistory
from weightbus.rules.replicas import ReplicaView
from weightbus.schemas import WeightUpdated, now

__all__ = [
    "EXIT_ENGINE",
    "EXIT_INVALID",
    "EXIT_NATS",
    "EXIT_NEVER_PUBLISHED",
    "EXIT_OK",
    "EXIT_REJECTED",
    "register",
    "status_command",
]

EXIT_OK: Final = 0
EXIT_ENGINE: Final = 3
EXIT_NEVER_PUBLISHED: Final = 4
EXIT_NATS: Final = 5
EXIT_INVALID: Final = 6
EXIT_REJECTED: Final = 7


_KIND = {"WeightUpdated": "updated", "PublisherClaimed": "claimed", "VersionReserved": "reserved"}


@dataclass(frozen=True, slots=True)
class _Status:
    history: WeightsHistory
    engines: list[EngineReadBack] = field(default_factory=list)
    router_error: str | None = None
    replicas: ReplicaView = field(default_factory=ReplicaView)

    @property
    def version(self) -> int | None:
        return self.history.state.version

    def engine_ok(self, e: EngineReadBack) -> bool:
        return e.error is None and e.weight_version == str(self.version)

    @property
    def exit_code(self) -> int:
        codes = []
        if self.router_error is not None or (
            self.version is not None and any(not self.engine_ok(e) for e in self.engines)
        ):
            codes.append(EXIT_ENGINE)
        if self.version is None:
            codes.append(EXIT_NEVER_PUBLISHED)
        if self.history.invalid is not None:
            codes.append(EXIT_INVALID)
        if self.history.latest_rejected:
            codes.append(EXIT_REJECTED)
        return min(codes, default=EXIT_OK)

    def to_dict(self) -> dict[str, Any]:
        h = self.history
        last = h.last_accepted
        lora = last.lora if isinstance(last, WeightUpdated) else None
        artifact = last.artifact if isinstance(last, WeightUpdated) else None
        return {
            "policy": h.policy,
            "version": h.state.version,
            "epoch": h.state.epoch,
            "publisher": h.state.publisher,
            "last_event": None if last is None else _KIND.get(type(last).__name__, "claimed"),
            "published_at": None if last is None else last.published_at,
            "age_s": None if last is None else max(0.0, now() - last.published_at),
            "lora": None if lora is None else {"name": lora.name, "path": lora.path},
            "artifact": None
            if artifact is None
            else {
                "uri": artifact.uri,
                "lineage": artifact.lineage,
                "base": artifact.base,
                "manifest_digest": artifact.manifest_digest,
            },
            "seq": h.last_accepted_seq,
            "counter_issued": h.issued,
            "unexplained_marks": [
                {"seq": u.seq, "version": u.mark.version, "trainer_id": u.mark.trainer_id, "chain_seen": u.seen}
                for u in h.unexplained_marks
            ],
            "engines": [
                {"engine": e.engine, "weight_version": e.weight_version, "error": e.error} for e in self.engines
            ],
            "router_error": self.router_error,
            "replicas": _replicas_dict(self.replicas),
            "rejected": [
                {
                    "seq": r.seq,
                    "version": r.version,
                    "held": r.held,
                    "epoch": r.epoch,
                    "trainer_id": r.trainer_id,
                    "published_at": r.published_at,
                    "reason": r.reason,
                    "event_type": r.event_type,
                }
                for r in h.rejected
            ],
            "latest_rejected": h.latest_rejected,
            "invalid_event": None if h.invalid is None else str(h.invalid),
            "exit_code": self.exit_code,
        }


def _replicas_dict(view: ReplicaView) -> dict[str, Any]:
    """The replica view as ``status --json`` prints it: the newest version's reach, the last convergence, engines."""
    conv = view.convergence()
    last = view.last_converged()
    return {
        "newest": view.newest,
        "serving_newest": None if conv is None else conv.serving,
        "fleet": None if conv is None else conv.fleet,
        "converged": None if conv is None else conv.converged,
        "unconverged_since": view.unconverged_since(),
        "last_converged": None
        if last is None
        else {"version": last.version, "seconds": last.time_to_converge(1.0), "announced_at": last.announced_at},
        "engines": [
            {"engine": e.engine, "serving": e.serving, "label": e.label, "since": e.since, "reason": e.reason}
            for e in sorted(view.engines.values(), key=lambda e: e.engine)
        ],
    }


async def _status(
    nats: str,
    policy: str,
    engines: list[str],
    router: str | None,
    connect_timeout: float,
    api_key: str | None,
    engine_timeout: float,
    connection: ConnectOptions | None = None,
) -> _Status:
    # ensure_stream=False: a status read must not create or reconfigure anything.
    bus = await connect(
        nats, name="weightbus-status", ensure_stream=False, connect_timeout=connect_timeout, options=connection
    )
    fleet: EngineFleet | None = None
    try:
        history = await read_weights_history(bus, policy)
        replicas = await read_replicas(bus, policy)
        try:
            if router:
                fleet = await EngineFleet.from_router(router, api_key=api_key, timeout=engine_timeout)
            elif engines:
                fleet = EngineFleet(engines, api_key=api_key, timeout=engine_timeout)
        except EngineError as exc:
            return _Status(history, router_error=str(exc), replicas=replicas)
        read_backs: list[EngineReadBack] = []
        if fleet is not None:
            for url, result in (await fleet.read_versions()).items():
                if isinstance(result, EngineError):
                    read_backs.append(EngineReadBack(url, None, str(result)))
                else:
                    read_backs.append(EngineReadBack(url, result))
        return _Status(history, read_backs, replicas=replicas)
    finally:
        if fleet is not None:
            await fleet.aclose()
        await bus.aclose()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.1f}min ago"
    return f"{seconds / 3600:.1f}h ago"


def _render(status: _Status) -> str:
    doc = status.to_dict()
    h = status.history
    if doc["last_event"] is None:
        lines = [f"policy     {h.policy}", "version    none (no publisher has claimed this policy)"]
    else:
        lora = doc["lora"]
        lora_text = (
            "" if lora is None else f" (LoRA {lora['name']}" + (f" from {lora['path']})" if lora["path"] else ")")
        )
        version = doc["version"] if doc["version"] is not None else "none yet"
        lines = [
            f"policy     {h.policy}",
            f"version    {version}{lora_text}",
            f"epoch      {doc['epoch']}",
            f"publisher  {doc['publisher']}",
            f"last event {doc['last_event']} {_age(doc['age_s'])}",
        ]
        artifact = doc["artifact"]
        if artifact is not None:
            kind = "full" if artifact["base"] is None else f"delta on v{artifact['base']}"
            digest = artifact["manifest_digest"] or "no digest: a catch-up cannot check it"
            lines.append(f"artifact   {artifact['uri']} ({kind}, {digest})")
    if h.issued is not None:
        # Above the version: each announcement reserves the next number; failed updates burn theirs.
        lines.append(f"counter    v{h.issued} (every number up to it issued or reserved)")
    for u in h.unexplained_marks:
        why = "superseded by a lower mark" if u.seen is None else f"the chain had seen v{u.seen}"
        mark = f"counter mark v{u.mark.version} by {u.mark.trainer_id} (seq {u.seq})"
        lines.append(f"IGNORED    {mark}: unexplained, {why}")
    for r in h.rejected:
        latest = ", the newest stored event" if h.latest_rejected and r is h.rejected[-1] else ""
        why = (
            f"below v{r.held}, trackers hold the higher version"
            if r.reason is None
            else f"{r.event_type} not accepted ({r.reason}), trackers hold v{r.held}"
        )
        lines.append(f"REJECTED   v{r.version} by {r.trainer_id} (epoch {r.epoch}, seq {r.seq}{latest}): {why}")
    if h.invalid is not None:
        lines.append(f"INVALID    newest stored event: {h.invalid} (trackers skip it)")
    lines.extend(_replica_lines(status.replicas, doc["replicas"]))
    if status.router_error is not None:
        lines.append(f"router     error: {status.router_error}")
    expected = None if status.version is None else str(status.version)
    for e in status.engines:
        if e.error is not None:
            lines.append(f"engine     {e.engine}  error: {e.error}")
        elif expected is None:
            lines.append(f"engine     {e.engine}  {e.weight_version}")
        else:
            mark = "ok" if e.weight_version == expected else f"OUT OF SYNC (bus says {expected})"
            lines.append(f"engine     {e.engine}  {e.weight_version}  {mark}")
    return "\n".join(lines)


def _replica_lines(view: ReplicaView, doc: dict[str, Any]) -> list[str]:
    """What the engines acknowledged (``rules.replicas``): the newest version's reach and the last convergence."""
    lines: list[str] = []
    if doc["fleet"] is not None:
        reach = f"{doc['serving_newest']}/{doc['fleet']} engines acknowledged serving v{doc['newest']}"
        since = doc["unconverged_since"]
        if not doc["converged"] and since is not None:
            reach += f" (unconverged since {_age(max(0.0, now() - since))})"
        lines.append(f"replicas   {reach}")
    last = doc["last_converged"]
    if last is not None and last["seconds"] is not None:
        lines.append(
            f"converged  v{last['version']} reached its whole fleet {last['seconds']:.3f}s after its announcement"
        )
    for e in doc["engines"]:
        if e["serving"] is None and e["reason"] is not None:
            lines.append(f"replica    {e['engine']}  serves nothing known ({e['reason']}: {e['label']})")
    return lines


def status_command(
    policy: PolicyOption,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    engine: Annotated[
        list[str] | None, typer.Option("--engine", help="SGLang worker URL to read back (repeatable).")
    ] = None,
    router: RouterOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    api_key: ApiKeyOption = None,
    engine_timeout: EngineTimeoutOption = 30.0,
    connect_timeout: ConnectTimeoutOption = 5.0,
    verbose: VerboseOption = 0,
) -> None:
    """Show what every tracker holds for POLICY: version, epoch, publisher, age, convergence; read-only.

    The stored history is checked with the trackers' rule: a rejected (lower) version is flagged. The
    counter line is the trainer's high-water mark: every number up to it was issued or reserved (each
    announcement reserves the next one), so no trainer will ever publish one of them again. The replicas
    line counts the engines whose activation acknowledgement (an ok read-back) of the newest version stands.

    Exit codes (lowest wins): 0 ok, 2 bad arguments, 3 engine out of sync or unreadable, 4 never
    published, 5 NATS unreachable or without JetStream, 6 newest stored event invalid, 7 newest stored
    event rejected, 77 permission denied.
    """
    setup_logging(verbose)
    try:
        for url in [*(engine or []), *([router] if router else [])]:
            normalize_url(url)
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    if engine and router:
        raise fail("pass --engine or --router, not both", EXIT_USAGE)
    try:
        status = run_async(
            _status(nats, policy, list(engine or []), router, connect_timeout, api_key, engine_timeout, connection)
        )
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_NATS) from None
    if as_json:
        typer.echo(json.dumps(status.to_dict(), sort_keys=True))
    else:
        typer.echo(_render(status))
    code = status.exit_code
    if code == EXIT_INVALID and status.history.invalid is not None:
        raise fail(str(status.history.invalid), code)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add ``status`` to ``app``."""
    app.command("status")(with_connection(status_command))
