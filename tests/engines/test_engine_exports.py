"""weightbus.engines exports exactly its public names and stays light (no starlette, uvicorn or torch)."""

from __future__ import annotations

import subprocess
import sys
import types

import weightbus.engines as engines


def test_all_is_sorted_and_complete() -> None:
    assert engines.__all__ == sorted(engines.__all__)
    public = {
        name
        for name, value in vars(engines).items()
        if not name.startswith("_") and name != "annotations" and not isinstance(value, types.ModuleType)
    }
    assert public == set(engines.__all__)


def test_import_is_light() -> None:
    code = (
        "import sys, weightbus.engines, weightbus.refengine.model, weightbus.refengine.tiny_model;"
        "heavy = sorted(m for m in ('starlette', 'uvicorn', 'torch') if m in sys.modules);"
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == ""
