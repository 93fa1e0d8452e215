"""Field types shared by every event family: versions, epochs, policy ids, timestamps.

Constraints live on the types, so a bad event fails decoding with a JSON path (``$.version``); constructors check none.
"""

from __future__ import annotations

import time
from typing import Annotated

from msgspec import Meta

__all__ = ["MAX_VERSION", "POLICY_PATTERN", "Epoch", "PolicyId", "Timestamp", "Version", "now"]

#: A policy id is one NATS subject token made of safe characters (no dots, spaces or wildcards).
POLICY_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

#: The largest version: every JSON consumer (JavaScript's doubles included) holds it exactly.
MAX_VERSION = 2**53 - 1

Version = Annotated[
    int,
    Meta(ge=0, le=MAX_VERSION, description="A policy's weight version; 0 is the pre-training baseline."),
]
Epoch = Annotated[
    int, Meta(ge=0, le=MAX_VERSION, description="Publisher epoch; bumped by every takeover of the counter.")
]
PolicyId = Annotated[str, Meta(pattern=POLICY_PATTERN, description="Policy id: one NATS subject token.")]
Timestamp = Annotated[float, Meta(ge=0, description="Unix time in seconds.")]


def now() -> float:
    """Wall-clock Unix time in seconds, as stamped on events."""
    return time.time()
