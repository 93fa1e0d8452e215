"""Where a drop-in's settings come from: ``args.weightbus_<name>``, else ``WEIGHTBUS_<NAME>``, else a default.

One lookup for every host and both halves, so a setting has one name everywhere; ``ConnectSettings`` is how
every half of every host reaches the bus (the URL, credentials, TLS, the connect timeout), ``DropInSettings`` is
that and what the trainer half needs (``MilesSettings``, ``SlimeSettings`` are it under the host's name). Pure: no
I/O beyond ``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Final, Self

from weightbus.bus.options import ENV as CONNECT_ENV
from weightbus.bus.options import ConnectOptions

__all__ = [
    "DEFAULT_METRICS_HOST",
    "DEFAULT_NATS",
    "ConnectSettings",
    "DropInSettings",
    "add_arguments",
    "metrics_address",
    "seconds",
    "setting",
]

DEFAULT_NATS: Final = "nats://127.0.0.1:4222"
#: The interface a metrics port binds by default, as ``weightbus rollout --metrics-host``.
DEFAULT_METRICS_HOST: Final = "127.0.0.1"


def setting(args: Any, name: str, env: str, default: str | None = None) -> str | None:
    """``args.<name>`` when set and not empty, else ``$<env>``, else ``default``."""
    value = getattr(args, name, None)
    if value is None or value == "":
        value = os.environ.get(env) or default
    return None if value is None else str(value)


def metrics_address(args: Any, name: str, env: str) -> tuple[str, int] | None:
    """Where a half serves its metrics: ``(host, port)`` from ``args.<name>`` / ``$<env>`` and
    ``weightbus_metrics_host`` / ``WEIGHTBUS_METRICS_HOST`` (default 127.0.0.1), or None when no port is set.

    Raises:
        ValueError: a port that is not in 1-65535.
    """
    raw = setting(args, name, env)
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{env} (args.{name}) must be a port, not {raw!r}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{env} (args.{name}) must be a port in 1-65535, not {port}")
    host = setting(args, "weightbus_metrics_host", "WEIGHTBUS_METRICS_HOST", DEFAULT_METRICS_HOST)
    return host or DEFAULT_METRICS_HOST, port


def seconds(args: Any, name: str, env: str, default: str) -> float:
    """``setting`` as a number of seconds >= 0.

    Raises:
        ValueError: not a number, or negative.
    """
    raw = setting(args, name, env, default)
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{env} (args.{name}) must be a number of seconds, not {raw!r}") from None
    if value < 0:
        raise ValueError(f"{env} (args.{name}) must be >= 0 seconds, not {value}")
    return value


def add_arguments(parser: Any) -> Any:
    """Add weightbus' metrics flags to a host's ``argparse`` parser, and return it.

    ``--weightbus-metrics-port``, ``--weightbus-trainer-metrics-port``, ``--weightbus-metrics-host``: the
    ``args`` attributes ``metrics_address`` reads. miles calls it as the generate function's ``add_arguments``
    (with ``--custom-generate-function-path weightbus.integrations.miles.generate``); a launcher can pass it
    to the host's ``parse_args(add_custom_arguments=...)``.
    """
    group = parser.add_argument_group("weightbus")
    group.add_argument(
        "--weightbus-metrics-port",
        type=int,
        default=None,
        help="Serve the rollout half's Prometheus metrics on this port (WEIGHTBUS_METRICS_PORT).",
    )
    group.add_argument(
        "--weightbus-trainer-metrics-port",
        type=int,
        default=None,
        help="Serve the trainer half's Prometheus metrics on this port, on rank 0 (WEIGHTBUS_TRAINER_METRICS_PORT).",
    )
    group.add_argument(
        "--weightbus-metrics-host",
        default=None,
        help=f"Interface the metrics ports bind (WEIGHTBUS_METRICS_HOST, else {DEFAULT_METRICS_HOST}).",
    )
    return parser


@dataclass(frozen=True, slots=True)
class ConnectSettings:
    """How a half reaches the bus: each is ``args.weightbus_<name>`` when set, else its variable.

    Attributes:
        nats: the NATS URL (``weightbus_nats`` / ``WEIGHTBUS_NATS``).
        options: credentials and TLS (``weightbus_creds``, ``weightbus_token``, ``weightbus_user``,
            ``weightbus_password``, ``weightbus_nkey_seed``, ``weightbus_tls_ca``, ``weightbus_tls_cert``,
            ``weightbus_tls_key``, else the ``WEIGHTBUS_*`` variables of ``weightbus.bus.options``).
        connect_timeout: seconds the first connect may take (``WEIGHTBUS_CONNECT_TIMEOUT``, 5).
    """

    nats: str
    options: ConnectOptions
    connect_timeout: float = 5.0

    @classmethod
    def from_args(cls, args: Any) -> ConnectSettings:
        """The connect settings for ``args`` (the host's namespace; None for the environment alone).

        Raises:
            ValueError: a connect timeout that is not a number of seconds.
            BusConfigError: credentials or TLS settings that cannot work together.
        """
        overrides = {field: getattr(args, f"weightbus_{field}", None) or None for field in CONNECT_ENV}
        overrides.pop("replicas", None)
        return cls(
            nats=setting(args, "weightbus_nats", "WEIGHTBUS_NATS", DEFAULT_NATS) or DEFAULT_NATS,
            options=ConnectOptions.from_env(**overrides),
            connect_timeout=seconds(args, "weightbus_connect_timeout", "WEIGHTBUS_CONNECT_TIMEOUT", "5"),
        )


@dataclass(frozen=True, slots=True)
class DropInSettings:
    """What both halves need to reach the bus, and what the trainer half needs to publish.

    Attributes:
        policy: the policy id (``weightbus_policy`` / ``WEIGHTBUS_POLICY``; required).
        nats, options, connect_timeout: how it reaches the bus (``ConnectSettings``).
        update_timeout: seconds ``update_weights`` keeps retrying to take a number while the bus
            does not answer, before it raises (``WEIGHTBUS_UPDATE_TIMEOUT``); None when unset: the host's
            default (``Host.update_timeout``).
        floor: the version of the checkpoint the trainer resumed from (``WEIGHTBUS_FLOOR``): the
            counter resumes above it even when the bus lost its history; None to rely on the bus.
        trainer_id: the trainer's readable name on the bus (``WEIGHTBUS_TRAINER_ID``; default
            ``<host framework>:<hostname>:<pid>``).
        trainer_metrics: where rank 0 serves the trainer half's metrics (``weightbus_trainer_metrics_port`` /
            ``WEIGHTBUS_TRAINER_METRICS_PORT``, with ``WEIGHTBUS_METRICS_HOST``); None: not served.
    """

    policy: str
    nats: str
    options: ConnectOptions
    connect_timeout: float = 5.0
    update_timeout: float | None = None
    floor: int | None = None
    trainer_id: str | None = None
    trainer_metrics: tuple[str, int] | None = None

    @classmethod
    def from_args(cls, args: Any) -> Self:
        """The settings for ``args`` (the host's namespace; None for the environment alone).

        Raises:
            ValueError: no policy, a timeout or floor that is not a number, or a metrics port that is not a port.
            BusConfigError: credentials or TLS settings that cannot work together.
        """
        policy = setting(args, "weightbus_policy", "WEIGHTBUS_POLICY")
        if not policy:
            raise ValueError(
                "set the policy to publish and follow: args.weightbus_policy or the WEIGHTBUS_POLICY "
                "environment variable"
            )
        connect = ConnectSettings.from_args(args)
        raw_floor = setting(args, "weightbus_floor", "WEIGHTBUS_FLOOR")
        floor: int | None = None
        if raw_floor is not None:
            try:
                floor = int(raw_floor)
            except ValueError:
                why = f"WEIGHTBUS_FLOOR (args.weightbus_floor) must be a version, not {raw_floor!r}"
                raise ValueError(why) from None
        return cls(
            policy=policy,
            nats=connect.nats,
            options=connect.options,
            connect_timeout=connect.connect_timeout,
            update_timeout=(
                seconds(args, "weightbus_update_timeout", "WEIGHTBUS_UPDATE_TIMEOUT", "0")
                if setting(args, "weightbus_update_timeout", "WEIGHTBUS_UPDATE_TIMEOUT") is not None
                else None
            ),
            floor=floor,
            trainer_id=setting(args, "weightbus_trainer_id", "WEIGHTBUS_TRAINER_ID"),
            trainer_metrics=metrics_address(args, "weightbus_trainer_metrics_port", "WEIGHTBUS_TRAINER_METRICS_PORT"),
        )
