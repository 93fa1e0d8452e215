"""Integrity fixtures: reference engines (shared with the producer tests) and a recording of a policy's subjects."""

from __future__ import annotations

from tests.producers.conftest import Engines, engines, history  # noqa: F401  # re-exported fixtures

__all__ = ["Engines", "engines", "history"]
