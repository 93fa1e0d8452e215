"""The trainer side: the fenced version publisher, engine fleets and their stamping, and status reads.

``VersionPublisher`` (``SyncVersionPublisher`` for sync trainers) owns a policy's counter; ``EngineFleet`` addresses
the workers; ``stamp_and_verify`` checks them before an announcement; ``push_lora_adapter`` is all or nothing;
``PublisherMetrics`` exports the updates' phases and the counter's state; ``catch_up`` brings one restarted or lagging
engine to the announced version from the bus alone, ``FleetCatchup`` every engine of a fleet that falls behind.
"""

from weightbus.producers.catchup import CatchupResult, catch_up
from weightbus.producers.coverage import pending_label
from weightbus.producers.fleet import EngineFleet, EngineStamp
from weightbus.producers.lora import push_lora_adapter
from weightbus.producers.metrics import CatchupMetrics, PublisherMetrics
from weightbus.producers.publisher import PublisherState, VersionPublisher
from weightbus.producers.stamping import stamp_and_verify
from weightbus.producers.status import EngineReadBack, PolicyStatus, read_status
from weightbus.producers.sync import SyncPublisherState, SyncUpdate, SyncVersionPublisher
from weightbus.producers.update import VersionUpdate, quarantine_label
from weightbus.producers.watcher import FleetCatchup

__all__ = [
    "CatchupMetrics",
    "CatchupResult",
    "EngineFleet",
    "EngineReadBack",
    "EngineStamp",
    "FleetCatchup",
    "PolicyStatus",
    "PublisherMetrics",
    "PublisherState",
    "SyncPublisherState",
    "SyncUpdate",
    "SyncVersionPublisher",
    "VersionPublisher",
    "VersionUpdate",
    "catch_up",
    "pending_label",
    "push_lora_adapter",
    "quarantine_label",
    "read_status",
    "stamp_and_verify",
]
