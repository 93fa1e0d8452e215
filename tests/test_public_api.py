"""Every public module's API is explicit: ``__all__`` names exactly its public, non-module attributes.

The modules are found by walking ``src/weightbus`` (``pkgutil.walk_packages``), so a new module is checked the
day it is added. A module is public when no part of its dotted name starts with ``_``.
Also: ``import weightbus`` and the event/staleness path never import torch, starlette or uvicorn.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
import types
from typing import TypeVar

import pytest

import weightbus


def _public_modules() -> list[str]:
    def unreachable(name: str) -> None:
        raise AssertionError(f"walk_packages could not import {name}")

    found = [info.name for info in pkgutil.walk_packages(weightbus.__path__, "weightbus.", onerror=unreachable)]
    return ["weightbus", *(n for n in found if not any(part.startswith("_") for part in n.split(".")))]


PUBLIC_MODULES = _public_modules()


def test_the_walk_finds_the_tree() -> None:
    # A walk that silently found nothing would make every other check here pass.
    expected = {"weightbus.errors", "weightbus.consumers.tracker", "weightbus.rules.staleness", "weightbus.cli.watch"}
    assert expected <= set(PUBLIC_MODULES)
    assert "weightbus.__main__" not in PUBLIC_MODULES and "weightbus.bus._natspy" not in PUBLIC_MODULES


def _import(name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        # An optional extra that is not installed (torch, matplotlib) is a skip; a broken weightbus import is not.
        if exc.name is None or exc.name.split(".")[0] == "weightbus":
            raise
        pytest.skip(f"{name} needs {exc.name}")


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_matches_public_names(name: str) -> None:
    module = _import(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    exported = set(module.__all__)
    is_package = hasattr(module, "__path__")
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and not isinstance(value, (types.ModuleType, TypeVar))  # a type variable is plumbing, not API
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
    missing = sorted(attr for attr in exported if not hasattr(module, attr))
    assert not missing, f"in __all__ but not defined: {missing}"
    assert len(module.__all__) == len(exported), "duplicates in __all__"
    # An error has one import path, weightbus.errors (the 0.1 re-exports are gone: docs/upgrading.md).
    if name != "weightbus.errors":
        errors = sorted(
            attr
            for attr in exported
            if inspect.isclass(getattr(module, attr))
            and issubclass(getattr(module, attr), BaseException)
            and getattr(module, attr).__module__ == "weightbus.errors"
        )
        assert not errors, f"{name} re-exports {errors}: import them from weightbus.errors"
    # Classes and functions carry their own docstring (constants are documented where they are defined).
    undocumented = sorted(
        attr
        for attr in exported
        if (inspect.isclass(getattr(module, attr)) or inspect.isfunction(getattr(module, attr)))
        and not getattr(module, attr).__doc__
    )
    assert not undocumented, f"{name}: no docstring on {undocumented}"


def test_event_and_staleness_path_stays_light() -> None:
    code = (
        "import sys, weightbus, weightbus.bus, weightbus.schemas, weightbus.rules, weightbus.consumers,"
        " weightbus.producers, weightbus.engines, weightbus.embedded, weightbus.integrations.miles,"
        " weightbus.integrations.slime,"
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
