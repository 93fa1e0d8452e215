"""The bus: the ``Bus`` protocol, its NATS JetStream and in-memory implementations, the subject scheme and traces.

Importing this package does not import nats-py: ``NatsBus`` and ``connect`` load ``weightbus.bus.nats`` on first use.
"""

from __future__ import annotations

import typing as _typing

from weightbus.bus.history import History, read_subject_history
from weightbus.bus.memory import MemoryBus
from weightbus.bus.metrics import BusMetrics, MetricsServer, serve_metrics
from weightbus.bus.options import ConnectOptions, redact_url
from weightbus.bus.protocol import Bus, Deliver, Envelope, PublishAck, Skipped, Subscription

if _typing.TYPE_CHECKING:
    from weightbus.bus.nats import NatsBus, connect

__all__ = [
    "Bus",
    "BusMetrics",
    "ConnectOptions",
    "Deliver",
    "Envelope",
    "History",
    "MemoryBus",
    "MetricsServer",
    "NatsBus",
    "PublishAck",
    "Skipped",
    "Subscription",
    "connect",
    "read_subject_history",
    "serve_metrics",
    "redact_url",
]

_LAZY = frozenset({"NatsBus", "connect"})


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        from weightbus.bus import nats

        value = getattr(nats, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
