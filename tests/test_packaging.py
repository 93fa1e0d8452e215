"""The sdist is complete: a clean machine can run the suite from it (conftest, fixtures, LICENSE)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_sdist_carries_the_suite_the_license_and_the_metadata(tmp_path: Path) -> None:
    from setuptools import build_meta

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        name = build_meta.build_sdist(str(tmp_path))
    finally:
        os.chdir(cwd)
    with tarfile.open(tmp_path / name) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
        pkg_info = sdist.extractfile(f"{name.removesuffix('.tar.gz')}/PKG-INFO").read().decode()  # type: ignore[union-attr]
    for path in (
        "LICENSE",
        "Makefile",
        "tests/conftest.py",
        "tests/fixtures/trace.jsonl",
        "tests/producers/conftest.py",
    ):
        assert path in members, path
    assert "src/weightbus/integrations/miles.py" in members and "src/weightbus/__main__.py" in members
    assert "License-Expression: Apache-2.0" in pkg_info and "License-File: LICENSE" in pkg_info
    assert not any("__pycache__" in m for m in members)
