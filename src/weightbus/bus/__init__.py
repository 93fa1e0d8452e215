"""The bus: the ``Bus`` protocol, its NATS JetStream and in-memory implementations, the subject
scheme, an embedded nats-server, and record/replay of event traces.

``weightbus.bus.nats`` imports nats-py; everything here is light enough to import anywhere.
"""

from weightbus.bus.history import History, read_history
from weightbus.bus.memory import MemoryBus
from weightbus.bus.metrics import BusMetrics
from weightbus.bus.nats import NatsBus, connect
from weightbus.bus.options import ConnectOptions, redact_url
from weightbus.bus.protocol import Bus, Deliver, Envelope, PublishAck, Skipped, Subscription
from weightbus.bus.server import EmbeddedNats, NatsServerNotFound, NatsServerStartError, find_nats_server, free_port

__all__ = [
    "Bus",
    "BusMetrics",
    "ConnectOptions",
    "Deliver",
    "EmbeddedNats",
    "Envelope",
    "History",
    "MemoryBus",
    "NatsBus",
    "NatsServerNotFound",
    "NatsServerStartError",
    "PublishAck",
    "Skipped",
    "Subscription",
    "connect",
    "find_nats_server",
    "free_port",
    "read_history",
    "redact_url",
]
