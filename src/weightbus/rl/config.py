"""What ``weightbus rollout`` and ``weightbus trainer`` run: one typed config object per process, readable from a file.

Each setting is declared once, as a field: type, default, constraints and help (``Meta(description=...)``); the
commands' flags are derived from the fields (``weightbus.cli.config_flags``). Unknown fields are refused and
constraints checked at decode; credentials and TLS never go in these files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Final, Literal, TypeVar

import msgspec
from msgspec import Meta

from weightbus.errors import ConfigError

__all__ = [
    "MAX_GROUP_SIZE",
    "MAX_IN_FLIGHT",
    "MIN_SHARED_LEASE_S",
    "ROUTER_WAIT_S",
    "RolloutConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
    "make_config",
]

_C = TypeVar("_C", bound=msgspec.Struct)

#: The client default; weightbus never starts a server on 4222 itself.
_DEFAULT_NATS = "nats://127.0.0.1:4222"

#: The most prompt groups one rollout process keeps in flight (``in_flight``, ``cap``): each is a task and
#: ``group_size`` open requests to the router; far beyond this a process spends its time scheduling them.
MAX_IN_FLIGHT: Final = 1024
#: The most samples in one prompt group.
MAX_GROUP_SIZE: Final = 1024
#: The shortest ``admission_lease_s`` a shared budget accepts: it must exceed three times its clock-skew
#: allowance (``SharedBudget``'s ``skew_s``, 1 s), so that renewals every third of a lease land in time.
MIN_SHARED_LEASE_S: Final = 3.0
#: Seconds ``run_rollout`` waits by default for the router to answer before it gives up (``--router-wait``).
ROUTER_WAIT_S: Final = 30.0


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What ``weightbus rollout`` runs.

    Each field is declared once, here: its ``Meta(description=...)`` is the help of its flag
    (``weightbus.cli.config_flags``) and its description in the config's JSON schema.
    """

    router_url: Annotated[str, Meta(description="The SGLang router that rollouts generate through (http://host:port).")]
    policy: Annotated[str, Meta(description="The policy id.")]
    nats_url: Annotated[str, Meta(description="The NATS URL (or several, comma-separated).")] = _DEFAULT_NATS
    task: Annotated[str, Meta(description="The task (prompts, tokenizer, reward), as package.module:factory.")] = (
        "weightbus.rl.task:ReverseDigits"
    )
    group_size: Annotated[int, Meta(ge=2, le=MAX_GROUP_SIZE, description="Samples per prompt group.")] = 8
    batch: Annotated[int, Meta(ge=1, description="Groups per training batch (sizes the buffer).")] = 8
    in_flight: Annotated[int, Meta(ge=1, le=MAX_IN_FLIGHT, description="Prompt groups being generated at once.")] = 4
    max_staleness: Annotated[int, Meta(ge=0, description="The largest staleness kept.")] = 1
    on_stale: Annotated[
        Literal["recycle", "drop"], Meta(description="recycle or drop the groups that are not kept.")
    ] = "recycle"
    temperature: Annotated[float, Meta(gt=0, description="Sampling temperature.")] = 1.0
    admission: Annotated[
        Literal["off", "cap", "bounded"],
        Meta(
            description="Pace generation (weightbus.consumers.admission): bounded starts a group only while it can "
            "still be trained within max_staleness, cap keeps at most cap groups running, off keeps in_flight "
            "groups running whatever becomes of them."
        ),
    ] = "bounded"
    cap: Annotated[
        Annotated[int, Meta(ge=1, le=MAX_IN_FLIGHT)] | None,
        Meta(description="The cap mode's limit on running groups (default: in_flight)."),
    ] = None
    admission_shared: Annotated[
        bool,
        Meta(
            description="Share one admission budget with the policy's other rollout processes over NATS "
            "(weightbus.<policy>.admission)."
        ),
    ] = False
    admission_lease_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Seconds a shared holding lasts without renewal. The others count a lapsed holding for one "
            "more lease (its groups may still run), so a killed process's slots come back within twice this (+1 s).",
        ),
    ] = 10.0
    follow_lora: Annotated[
        bool, Meta(description="Generate with the LoRA adapter that the latest WeightUpdated names (lora_path).")
    ] = False
    seed: Annotated[int, Meta(description="Seeds the prompt stream.")] = 0
    consumer: Annotated[
        str | None,
        Meta(description="The drain reporter's consumer id (default: rollout-<random>, unique per start)."),
    ] = None
    metrics_port: Annotated[
        Annotated[int, Meta(ge=1, le=65535)] | None,
        Meta(description="Serve Prometheus metrics (the bus's and the drain's) on this port."),
    ] = None
    metrics_host: Annotated[
        str, Meta(description="Interface the metrics server binds (0.0.0.0 to let a cluster scrape it).")
    ] = "127.0.0.1"
    freeze_heap: Annotated[
        bool,
        Meta(
            description="Freeze the start-up heap once the tracker is ready (gc.freeze): a long-running "
            "process's choice."
        ),
    ] = True
    early_abort: Annotated[
        bool,
        Meta(
            description="Abort, at the engines (/abort_request), a group still generating once it is certain to "
            "exceed max_staleness, and recycle its prompt (weightbus.rules.abort)."
        ),
    ] = True
    require_version: Annotated[
        Literal["off", "current"],
        Meta(
            description="off: requests go through the router; current: each request asks for at least the version "
            "the tracker holds when its group starts and goes straight to an engine the replica view knows serves "
            "it (an activation acknowledgement; weightbus.consumers.replicas), never through the router."
        ),
    ] = "off"


class TrainerConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What ``weightbus trainer`` runs (each field declared once, as ``RolloutConfig``'s)."""

    router_url: Annotated[str, Meta(description="The router whose /workers are the engines to push to.")]
    policy: Annotated[str, Meta(description="The policy id.")]
    run_dir: Annotated[
        str,
        Meta(description="Holds checkpoint.pt, steps.jsonl and the weight files (must be readable by the engines)."),
    ]
    nats_url: Annotated[str, Meta(description="The NATS URL (or several, comma-separated).")] = _DEFAULT_NATS
    steps: Annotated[int, Meta(ge=1, description="Train until the checkpointed step count reaches this.")] = 40
    batch: Annotated[int, Meta(ge=1, description="Groups per step.")] = 8
    seed: Annotated[int, Meta(description="The initial weights (the engines' --seed).")] = 0
    lr: Annotated[float, Meta(gt=0, description="Adam's learning rate.")] = 0.05
    clip: Annotated[float, Meta(gt=0, description="The PPO clip range of the importance ratio.")] = 0.2
    lora_rank: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Train and push a LoRA adapter of this rank instead of the full weights."),
    ] = None
    lora_prefix: Annotated[
        str, Meta(description="The adapters' name prefix on the engines (<lora_prefix>-v<version>).")
    ] = "policy-lora"
    trainer_id: Annotated[str | None, Meta(description="Identity on the bus (default: <hostname>:<pid>).")] = None
    metrics_port: Annotated[
        Annotated[int, Meta(ge=1, le=65535)] | None,
        Meta(description="Serve Prometheus metrics (the bus's) on this port."),
    ] = None
    metrics_host: Annotated[
        str, Meta(description="Interface the metrics server binds (0.0.0.0 to let a cluster scrape it).")
    ] = "127.0.0.1"

    @property
    def run_path(self) -> Path:
        """``run_dir`` as a path."""
        return Path(self.run_dir)


def make_config(kind: type[_C], base: _C | None = None, **given: object) -> _C:
    """A ``kind`` from ``base`` (or the defaults) with every non-None value of ``given`` set, validated.

    Raises:
        ConfigError: a field is missing, unknown or out of range.
    """
    fields = msgspec.structs.asdict(base) if base is not None else {}
    fields.update({name: value for name, value in given.items() if value is not None})
    try:
        return msgspec.convert(fields, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None


def load_config(path: Path, kind: type[_C]) -> _C:
    """Read a ``kind`` from the JSON file at ``path``.

    Raises:
        ConfigError: the file cannot be read or does not decode as ``kind``.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def dump_config(config: msgspec.Struct, path: Path) -> Path:
    """Write ``config`` as JSON to ``path``; returns ``path``."""
    path.write_bytes(msgspec.json.format(msgspec.json.encode(config), indent=2) + b"\n")
    return path
