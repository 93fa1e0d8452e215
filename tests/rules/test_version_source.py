"""``rules.source``: the one reader of a version source (tracker, int or None, callable)."""

from __future__ import annotations

import pytest

from weightbus.errors import TrackerNotReadyError
from weightbus.rules.source import VersionSource, read_version, version_or_none, version_reader


class _Tracker:
    def __init__(self) -> None:
        self.reads = 0
        self.ready = False

    @property
    def current(self) -> int | None:
        self.reads += 1
        if not self.ready:
            raise TrackerNotReadyError("p", "starting")
        return 7


def test_a_tracker_is_read_once_per_read_and_never_at_construction() -> None:
    tracker = _Tracker()
    read = version_reader(tracker)  # a tracker that is not ready must not raise here
    assert tracker.reads == 0
    with pytest.raises(TrackerNotReadyError):
        read()
    assert version_or_none(tracker) is None
    tracker.ready = True
    assert read() == 7 and read_version(tracker) == 7
    assert tracker.reads == 4
    assert isinstance(tracker, VersionSource)


def test_constants_and_callables() -> None:
    assert read_version(None) is None and read_version(0) == 0 and read_version(lambda: 3) == 3
    for bad in (True, "7", 1.0, lambda: "7", lambda: False):
        with pytest.raises(TypeError):
            read_version(bad)  # type: ignore[arg-type]
    for negative in (-1, lambda: -1):
        with pytest.raises(ValueError):
            read_version(negative)
    with pytest.raises(TypeError):
        version_or_none(lambda: "7")  # a wrong type is a bug, not "cannot say"
