"""slime's update waits for a bus that does not answer: its ``train_async.py`` has no retry, so raising ends the job.

The cell's loop (``integrations.host.cell``) under a fake clock: miles gives up after ``WEIGHTBUS_UPDATE_TIMEOUT``
(30 s by default; its group retries the update on another cell), slime waits for as long as the bus is down unless
a timeout is set.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import weightbus.integrations.host.cell as host_cell
from weightbus.errors import BusConnectError
from weightbus.integrations.miles.trainer import MILES
from weightbus.integrations.slime.trainer import SLIME


class _FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _update(host: Any, timeout: float | None, down_for: float, clock: _FakeTime) -> str:
    """The cell's retry loop over a bus that refuses for ``down_for`` fake seconds, then answers."""
    back_at = clock.now + down_for

    def attempt() -> str:
        if clock.now < back_at:
            raise BusConnectError("nats://h:1", "refused", "refused")
        return "taken"

    cell = SimpleNamespace(host=host, settings=SimpleNamespace(policy="p", update_timeout=timeout))
    return host_cell.Cell._retrying(cell, attempt, "taking a version", "nothing was pushed")  # type: ignore[arg-type]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _FakeTime:
    fake = _FakeTime()
    monkeypatch.setattr(host_cell, "time", fake)
    return fake


def test_a_slime_update_waits_out_a_ten_minute_outage(clock: _FakeTime) -> None:
    assert _update(SLIME, None, 600.0, clock) == "taken"


def test_a_miles_update_still_gives_up_after_thirty_seconds_for_its_group_to_retry(clock: _FakeTime) -> None:
    with pytest.raises(BusConnectError) as info:
        _update(MILES, None, 600.0, clock)
    assert any("gave up taking a version after 30s" in note for note in info.value.__notes__)


def test_a_timeout_the_slime_user_sets_is_kept(clock: _FakeTime) -> None:
    with pytest.raises(BusConnectError):
        _update(SLIME, 5.0, 600.0, clock)
