"""The trainer side: the fenced version publisher, engine fleets and their stamping, and status reads.

``VersionPublisher`` owns a policy's version counter on the bus (a ``FencedCounter``, module ``counter``,
that only the update protocol of module ``update`` drives); ``EngineFleet`` addresses the SGLang
workers that serve the policy; ``stamp_and_verify`` is the check that keeps a trainer from announcing a
version its engines do not serve. ``SyncVersionPublisher`` is the blocking facade for sync trainers;
``push_lora_adapter`` (re-)loads a LoRA adapter on every engine, all or nothing.
"""

from weightbus.producers.coverage import pending_label
from weightbus.producers.fleet import EngineFleet, EngineStamp
from weightbus.producers.lora import push_lora_adapter
from weightbus.producers.publisher import PublisherState, VersionPublisher, default_trainer_id
from weightbus.producers.stamping import stamp_and_verify
from weightbus.producers.status import EngineReadBack, PolicyStatus, read_status
from weightbus.producers.sync import SyncPublisherState, SyncUpdate, SyncVersionPublisher
from weightbus.producers.update import VersionUpdate, quarantine_label

__all__ = [
    "EngineFleet",
    "EngineReadBack",
    "EngineStamp",
    "PolicyStatus",
    "PublisherState",
    "SyncPublisherState",
    "SyncUpdate",
    "SyncVersionPublisher",
    "VersionPublisher",
    "VersionUpdate",
    "default_trainer_id",
    "pending_label",
    "push_lora_adapter",
    "quarantine_label",
    "read_status",
    "stamp_and_verify",
]
