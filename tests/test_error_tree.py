"""One error tree: every public exception class of weightbus lives in ``weightbus.errors`` under ``WeightbusError``,
and the tree drawn in that module's docstring names each of them with its builtin base.

Private exception classes (a leading underscore) are signals caught inside their own module and never reach a
caller; they are exempt.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import weightbus
import weightbus.errors as errors
from weightbus.errors import WeightbusError


def _all_modules() -> list[str]:
    names = ["weightbus"]
    for info in pkgutil.walk_packages(weightbus.__path__, prefix="weightbus."):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            names.append(info.name)
    return names


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _all_modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.startswith("weightbus")
                and not attr.startswith("_")
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_every_public_exception_is_in_errors_under_the_root() -> None:
    classes = _exception_classes()
    assert "weightbus.errors.WeightbusError" in classes
    outside = sorted(name for name, cls in classes.items() if cls.__module__ != "weightbus.errors")
    assert not outside, f"exception classes defined outside weightbus.errors: {outside}"
    rootless = sorted(name for name, cls in classes.items() if not issubclass(cls, WeightbusError))
    assert not rootless, f"exception classes not under WeightbusError: {rootless}"


def test_the_docstring_tree_draws_every_error_with_its_parent_and_builtin_base() -> None:
    doc = errors.__doc__ or ""
    drawn: dict[str, tuple[int, str | None]] = {}
    parents: list[tuple[int, str]] = []
    for line in doc.splitlines():
        match = re.match(r"^    ([│ ]*(?:[├└]── )?)(\w+)(?: \((\w+)\))?", line)
        if match is None or not match.group(2).endswith(("Error", "NotFound")):
            continue
        depth = len(match.group(1)) // 4
        drawn[match.group(2)] = (depth, match.group(3))
        parents[depth:] = [(depth, match.group(2))]
        cls = getattr(errors, match.group(2), None)
        assert cls is not None, f"the tree draws {match.group(2)}, which errors.py does not define"
        if depth:
            parent = getattr(errors, parents[depth - 1][1])
            assert cls.__bases__[0] is parent, f"{cls.__name__} is drawn under {parent.__name__}"
        builtin = match.group(3)
        bases = [b.__name__ for b in cls.__bases__[1:]]
        assert bases == ([builtin] if builtin else []), f"{cls.__name__}: drawn base {builtin}, real bases {bases}"
    defined = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == "weightbus.errors"
    }
    assert defined == set(drawn), f"missing from the tree: {sorted(defined - set(drawn))}"
    assert set(errors.__all__) == defined


def test_the_moved_errors_keep_their_builtin_bases() -> None:
    # Their 0.1 import paths (weightbus.demo.DemoError, ...) are gone: tests/test_public_api.py checks that no
    # module but weightbus.errors lists an error.
    from weightbus.errors import DemoError, NatsServerNotFound, NoRolloutError, TaskLoadError

    # The builtin bases callers may catch today are kept.
    assert issubclass(NatsServerNotFound, FileNotFoundError) and issubclass(DemoError, RuntimeError)
    assert issubclass(TaskLoadError, ValueError) and issubclass(NoRolloutError, ConnectionError)
