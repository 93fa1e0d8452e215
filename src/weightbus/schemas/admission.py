"""The shared admission budget of a policy, rollout side ↔ rollout side (``weightbus.<policy>.admission``).

Each ``AdmissionLedger`` is the whole budget, written conditionally on the subject's last sequence: the newest stored
one is the budget. Evolution: new fields get defaults and go at the end; unknown fields are ignored on decode.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from weightbus.schemas.common import PolicyId, Timestamp, Version

__all__ = ["AdmissionEvent", "AdmissionLedger", "AdmissionMessage", "Holding"]

Count = Annotated[int, Meta(ge=0)]


class Holding(msgspec.Struct, frozen=True, kw_only=True):
    """One holder's share of the budget.

    Attributes:
        slots: the slots it may fill (running plus accepted groups in the horizon).
        used: what it had filled when the entry was written (for the record; the holder may be over its
            slots after a lapsed lease, never by admitting).
        expires_at: Unix time after which another writer may take the slots back.
        wants: the slots it asked for (``slots`` below it: it waits for more, and the others keep no more than
            their fair share, ``rules.admission.fair_shares``); 0 from writers that predate it (read as ``slots``).
    """

    slots: Count
    used: Count
    expires_at: Timestamp
    wants: Count = 0


class AdmissionEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of admission events; encoded as ``{"type": <tag>, ...}``."""


class AdmissionLedger(AdmissionEvent, frozen=True, tag="admission.ledger"):
    """The budget after one write.

    Attributes:
        total: the allowance the writer shares (``rules.admission.allowance``).
        holders: holder id (``<name>:<incarnation>``) → its holding; the slots sum to ``total`` at most.
        writer: the holder that wrote this ledger.
        version: the version the writer's tracker held (None: never published).
        written_at: the writer's Unix time.
    """

    policy: PolicyId
    total: Count
    holders: dict[str, Holding]
    writer: str
    version: Version | None
    written_at: Timestamp


AdmissionMessage = AdmissionLedger
