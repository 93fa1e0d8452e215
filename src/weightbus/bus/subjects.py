"""The subject scheme and NATS wildcard matching: every policy owns six subjects::

    weightbus.<policy>.weights   WeightUpdated, PublisherClaimed, VersionReserved  (durable; the current version)
    weightbus.<policy>.counter   CounterHighWater                  (the counter's high-water mark; read last)
    weightbus.<policy>.applied   WeightApplied                     (per-engine read-back)
    weightbus.<policy>.alerts    VersionRegressed, VersionRejected, EngineOutOfSync, FleetQuarantined
    weightbus.<policy>.drains    DrainReport
    weightbus.<policy>.admission AdmissionLedger                   (the rollouts' shared budget; read last)

A policy id is one subject token of ``[A-Za-z0-9_-]`` (1 to 64 characters), else ``InvalidPolicyError``.
"""

from __future__ import annotations

import re
from typing import Final

from weightbus.errors import InvalidPolicyError

__all__ = [
    "FAMILY_NAMES",
    "PREFIX",
    "admission",
    "alerts",
    "applied",
    "counter",
    "drains",
    "matches",
    "policy_of",
    "policy_pattern",
    "validate_policy",
    "weights",
]

PREFIX: Final = "weightbus"
FAMILY_NAMES: Final = ("weights", "applied", "alerts", "drains", "counter", "admission")
_POLICY_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_policy(policy: str) -> str:
    """Return ``policy`` if it is a valid policy id.

    Raises:
        InvalidPolicyError: empty, too long, or containing dots, spaces, wildcards or other characters.
    """
    if not isinstance(policy, str) or not policy:
        raise InvalidPolicyError(str(policy), "it is empty")
    if len(policy) > 64:
        raise InvalidPolicyError(policy, "it is longer than 64 characters")
    if not _POLICY_RE.fullmatch(policy):
        bad = sorted({c for c in policy if not re.fullmatch(r"[A-Za-z0-9_-]", c)})
        raise InvalidPolicyError(policy, f"only letters, digits, '_' and '-' are allowed (found {bad!r})")
    return policy


def _subject(policy: str, family: str) -> str:
    return f"{PREFIX}.{validate_policy(policy)}.{family}"


def weights(policy: str) -> str:
    """``weightbus.<policy>.weights``."""
    return _subject(policy, "weights")


def applied(policy: str) -> str:
    """``weightbus.<policy>.applied``."""
    return _subject(policy, "applied")


def alerts(policy: str) -> str:
    """``weightbus.<policy>.alerts``."""
    return _subject(policy, "alerts")


def drains(policy: str) -> str:
    """``weightbus.<policy>.drains``."""
    return _subject(policy, "drains")


def counter(policy: str) -> str:
    """``weightbus.<policy>.counter``."""
    return _subject(policy, "counter")


def admission(policy: str) -> str:
    """``weightbus.<policy>.admission``."""
    return _subject(policy, "admission")


def policy_pattern(policy: str | None) -> str:
    """Every subject of ``policy`` (``weightbus.<policy>.>``), or of all policies when None."""
    return f"{PREFIX}.>" if policy is None else f"{PREFIX}.{validate_policy(policy)}.>"


def policy_of(subject: str) -> str | None:
    """The policy token of a weightbus subject, or None for a subject outside the scheme."""
    parts = subject.split(".")
    if len(parts) == 3 and parts[0] == PREFIX and parts[2] in FAMILY_NAMES:
        return parts[1]
    return None


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` matches exactly one token, a final ``>`` one or more."""
    p_tokens = pattern.split(".")
    s_tokens = subject.split(".")
    for i, tok in enumerate(p_tokens):
        if tok == ">":
            return i == len(p_tokens) - 1 and len(s_tokens) > i
        if i >= len(s_tokens):
            return False
        if tok != "*" and tok != s_tokens[i]:
            return False
    return len(s_tokens) == len(p_tokens)
