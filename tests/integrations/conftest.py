"""Fixtures for every host's tests: ``quick_outage_timeouts`` for the scenarios that take the bus away."""

from __future__ import annotations

import functools

import pytest

from weightbus.bus import nats as nats_bus_module

__all__ = ["OUTAGE_PUBLISH_TIMEOUT_S", "OUTAGE_PUBLISH_ATTEMPTS", "quick_outage_timeouts"]

#: What the hosts' own buses wait for one publish acknowledgement or read in an outage scenario, and how often.
OUTAGE_PUBLISH_TIMEOUT_S = 1.0
OUTAGE_PUBLISH_ATTEMPTS = 2


@pytest.fixture
def quick_outage_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The buses a host connects in this process (``weightbus.bus.nats.connect``) give up on an unanswered
    publish or read after 2 x 1 s instead of the default 5 x 2 s.

    With the server gone, that is how long a rollout's tracker takes to learn it cannot say what is current, and a
    trainer's announcement to fail: the scenarios wait for either, and nothing they check depends on how long it
    took (about 4 s instead of 14 here). A host that passes its own timeouts keeps them.
    """
    quick = functools.partial(
        nats_bus_module.connect, publish_timeout=OUTAGE_PUBLISH_TIMEOUT_S, publish_attempts=OUTAGE_PUBLISH_ATTEMPTS
    )
    monkeypatch.setattr(nats_bus_module, "connect", quick)
