"""slime#2279's weight-update hooks (``before_weight_update`` / ``after_weight_update``), checked against the bus.

The RolloutManager of that branch counts in memory from 0; the hooks read the bus's newest announced version once
after each successful update, say a mismatch loudly (an error line, ``weightbus_host_version_mismatches_total``) and
answer the bus's number.
"""

from __future__ import annotations

import logging

import pytest

from weightbus.integrations.host.metrics import process_metrics
from weightbus.integrations.slime import after_weight_update, before_weight_update
from weightbus.producers.sync import SyncVersionPublisher

pytestmark = pytest.mark.nats


def _mismatches(policy: str) -> float:
    value = process_metrics().registry.get_sample_value("weightbus_host_version_mismatches_total", {"policy": policy})
    return value or 0.0


def test_slime_count_is_checked_against_the_bus_and_the_bus_number_wins(
    nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    with SyncVersionPublisher(policy, nats_url=nats_url) as pub:
        for _ in range(3):
            with pub.update():
                pass
    assert after_weight_update(3, True) == 3 and _mismatches(policy) == 0  # slime's count agrees: quiet

    # A resumed run: slime's RolloutManager counts from 0 again, the bus says 3.
    before_weight_update(1)
    with caplog.at_level(logging.ERROR, logger="weightbus.integrations.slime"):
        assert after_weight_update(1, True) == 3
    assert _mismatches(policy) == 1
    assert any("policy_version 1 is not the bus's version 3" in r.getMessage() for r in caplog.records)
    assert after_weight_update(2, False) is None and _mismatches(policy) == 1  # a failed update: nothing to check


def test_before_anything_was_announced_the_hook_says_so(
    nats_url: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTBUS_NATS", nats_url)
    monkeypatch.setenv("WEIGHTBUS_POLICY", policy)
    assert after_weight_update(1, True) is None and _mismatches(policy) == 1
