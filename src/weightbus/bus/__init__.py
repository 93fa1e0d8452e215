"""The bus: the ``Bus`` protocol, its NATS JetStream and in-memory implementations, the subject
scheme, and record/replay of event traces. The embedded nats-server is ``weightbus.embedded``.

``weightbus.bus.nats`` imports nats-py; everything here is light enough to import anywhere.
"""

from weightbus.bus.history import History, read_subject_history
from weightbus.bus.memory import MemoryBus
from weightbus.bus.metrics import BusMetrics
from weightbus.bus.nats import NatsBus, connect
from weightbus.bus.options import ConnectOptions, redact_url
from weightbus.bus.protocol import Bus, Deliver, Envelope, PublishAck, Skipped, Subscription

__all__ = [
    "Bus",
    "BusMetrics",
    "ConnectOptions",
    "Deliver",
    "Envelope",
    "History",
    "MemoryBus",
    "NatsBus",
    "PublishAck",
    "Skipped",
    "Subscription",
    "connect",
    "read_subject_history",
    "redact_url",
]
