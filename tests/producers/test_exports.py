"""The producers package exports exactly its public names, sorted."""

from __future__ import annotations

import weightbus.producers as producers


def test_all_is_sorted_and_complete() -> None:
    assert producers.__all__ == sorted(producers.__all__)
    public = {name for name in vars(producers) if not name.startswith("_")} - {
        "lora",
        "publisher",
        "stamping",
        "status",
        "sync",
        "update",
    }
    assert public == set(producers.__all__)
