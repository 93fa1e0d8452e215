"""Every package's public API is explicit: ``__all__`` names exactly its public, non-module attributes.

Also: ``import weightbus`` and the event/staleness path never import torch, starlette or uvicorn.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import types

import pytest

PACKAGES = [
    "weightbus",
    "weightbus.errors",
    "weightbus.schemas",
    "weightbus.bus",
    "weightbus.producers",
    "weightbus.consumers",
    "weightbus.consumers.tracker",
    "weightbus.consumers.drain",
    "weightbus.rules",
    "weightbus.embedded",
    "weightbus.integrations",
    "weightbus.engines",
    "weightbus.cli",
    "weightbus.demo",
    "weightbus.refengine",
    "weightbus.rl",
    "weightbus.rl.task",
    "weightbus.rl.batches",
    "weightbus.rl.report",
    "weightbus.rl.writers",
    "weightbus.rl.config",
    "weightbus.process.progress",
    "weightbus.process.overhead",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_matches_public_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    is_package = hasattr(module, "__path__")
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and attr != "annotations"
        # A package re-exports its API; a plain module only owes __all__ the names it defines.
        and (
            getattr(value, "__module__", name).startswith("weightbus")
            if is_package
            else getattr(value, "__module__", None) == name
        )
    }
    # Names defined or re-exported here must be listed; every listed name must exist.
    assert public <= exported, f"public but not in __all__: {sorted(public - exported)}"
    assert all(hasattr(module, attr) for attr in exported)
    assert len(module.__all__) == len(exported), "duplicates in __all__"
    for attr in exported:
        if inspect.isclass(getattr(module, attr)) or inspect.isfunction(getattr(module, attr)):
            assert getattr(module, attr).__doc__, f"{name}.{attr} has no docstring"


def test_event_and_staleness_path_stays_light() -> None:
    code = (
        "import sys, weightbus, weightbus.bus, weightbus.schemas, weightbus.rules, weightbus.consumers,"
        " weightbus.producers, weightbus.engines, weightbus.embedded, weightbus.integrations.miles,"
        " weightbus.rl, weightbus.rl.task, weightbus.rl.batches, weightbus.refengine;"
        "heavy = [m for m in ('torch', 'starlette', 'uvicorn', 'sglang') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_module_opens_with_a_docstring() -> None:
    """The house rule: each module states its role (docs/architecture.md, "Where a new module goes")."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "weightbus"
    missing = [
        p.relative_to(src).as_posix()
        for p in sorted(src.rglob("*.py"))
        if p.name != "__main__.py" and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not missing, f"modules without a docstring: {missing}"
