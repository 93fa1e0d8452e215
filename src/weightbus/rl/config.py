"""What ``weightbus rollout`` and ``weightbus trainer`` run: one typed config object per process, readable from a file.

Unknown fields are refused and constraints checked at decode; credentials and TLS never go in these files.
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


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What ``weightbus rollout`` runs."""

    router_url: str
    """The SGLang router that rollouts generate through."""
    policy: str
    """The policy id."""
    nats_url: str = _DEFAULT_NATS
    """The NATS to use (several URLs comma-separated)."""
    task: str = "weightbus.rl.task:ReverseDigits"
    """The task (prompts, tokenizer, reward), as ``package.module:factory``."""
    group_size: Annotated[int, Meta(ge=2, le=MAX_GROUP_SIZE)] = 8
    """Samples per prompt group."""
    batch: Annotated[int, Meta(ge=1)] = 8
    """Groups per training batch (sizes the buffer)."""
    in_flight: Annotated[int, Meta(ge=1, le=MAX_IN_FLIGHT)] = 4
    """Prompt groups being generated at once."""
    max_staleness: Annotated[int, Meta(ge=0)] = 1
    """The largest staleness kept."""
    on_stale: Literal["recycle", "drop"] = "recycle"
    """``recycle`` or ``drop`` the groups that are not kept."""
    temperature: Annotated[float, Meta(gt=0)] = 1.0
    """Sampling temperature."""
    admission: Literal["off", "cap", "bounded"] = "bounded"
    """Pace generation (``weightbus.consumers.admission``): ``bounded`` starts a group only while it can still
    be trained within ``max_staleness``, ``cap`` keeps at most ``cap`` groups running, ``off`` keeps
    ``in_flight`` groups running whatever becomes of them."""
    cap: Annotated[int, Meta(ge=1, le=MAX_IN_FLIGHT)] | None = None
    """The ``cap`` mode's limit on running groups (default: ``in_flight``)."""
    admission_shared: bool = False
    """Share one budget with the policy's other rollout processes (``weightbus.<policy>.admission``)."""
    admission_lease_s: Annotated[float, Meta(gt=0)] = 10.0
    """How long a shared holding lasts without renewal. The others count a lapsed holding for one more lease (its
    groups may still run), so a killed process's slots come back within twice this (+1 s)."""
    follow_lora: bool = False
    """Generate with the LoRA adapter that the latest ``WeightUpdated`` names (``lora_path``)."""
    seed: int = 0
    """Seeds the prompt stream."""
    consumer: str | None = None
    """The drain reporter's consumer id (default: ``rollout-<random>``, unique per start)."""
    metrics_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    """Serve Prometheus metrics (the bus's and the drain's) on this port."""
    metrics_host: str = "127.0.0.1"
    """Interface the metrics server binds."""
    freeze_heap: bool = True
    """Freeze the start-up heap once the tracker is ready (``gc.freeze``): a long-running process's choice."""
    early_abort: bool = True
    """Abort, at the engines (``/abort_request``), a group still generating once it is certain to exceed
    ``max_staleness``, and recycle its prompt (``weightbus.rules.abort``)."""


class TrainerConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What ``weightbus trainer`` runs."""

    router_url: str
    """The router whose ``/workers`` are the engines to push to."""
    policy: str
    """The policy id."""
    run_dir: str
    """Holds ``checkpoint.pt``, ``steps.jsonl`` and the weight files (must be readable by the engines)."""
    nats_url: str = _DEFAULT_NATS
    """The NATS to use."""
    steps: Annotated[int, Meta(ge=1)] = 40
    """Train until the checkpointed step count reaches this."""
    batch: Annotated[int, Meta(ge=1)] = 8
    """Groups per step."""
    seed: int = 0
    """The initial weights (the engines' ``--seed``)."""
    lr: Annotated[float, Meta(gt=0)] = 0.05
    """Adam's learning rate."""
    clip: Annotated[float, Meta(gt=0)] = 0.2
    """The PPO clip range of the importance ratio."""
    lora_rank: Annotated[int, Meta(ge=1)] | None = None
    """Train and push a LoRA adapter of this rank instead of the full weights."""
    lora_prefix: str = "policy-lora"
    """The adapters' name prefix on the engines (``<lora_prefix>-v<version>``)."""
    trainer_id: str | None = None
    """Identity on the bus (default ``<hostname>:<pid>``)."""
    metrics_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    """Serve Prometheus metrics (the bus's) on this port."""
    metrics_host: str = "127.0.0.1"
    """Interface the metrics server binds."""

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
