"""An opt-in pytest plugin that collects garbage after every test, so a socket, transport or task a test leaves
behind warns (``ResourceWarning``, failed by pytest as an unraisable exception) in the test that leaked it, not in
whichever later test the collector happens to run in.

Usage: ``.venv/bin/python -m pytest -p tests.leakcheck [paths]`` (about a fifth slower; not part of ``make test``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_after_each_test() -> Iterator[None]:
    yield
    gc.collect()
