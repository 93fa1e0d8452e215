"""One error tree: every public exception class of weightbus lives in ``weightbus.errors`` under ``WeightbusError``,
and the tree drawn in that module's docstring names each of them with its builtin base and its place on the
retryable/final axis (``retryable``, set in each class's own body).

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
from weightbus.errors import WeightbusError, is_retryable


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
        match = re.match(r"^    ([│ ]*(?:[├└]── )?)(\w+)(?: \((\w+)\))?(?: +(retry|final)\b)?", line)
        if match is None or not match.group(2).endswith(("Error", "NotFound")):
            continue
        assert match.group(4), f"{match.group(2)} is drawn without its axis (retry or final)"
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
        assert cls.retryable is (match.group(4) == "retry"), f"{cls.__name__} is drawn {match.group(4)}"
    defined = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == "weightbus.errors"
    }
    assert defined == set(drawn), f"missing from the tree: {sorted(defined - set(drawn))}"
    assert set(errors.__all__) == defined | {"is_retryable"}


def test_the_moved_errors_keep_their_builtin_bases() -> None:
    # Their 0.1 import paths (weightbus.demo.DemoError, ...) are gone: tests/test_public_api.py checks that no
    # module but weightbus.errors lists an error.
    from weightbus.errors import DemoError, NatsServerNotFound, NoRolloutError, TaskLoadError

    # The builtin bases callers may catch today are kept.
    assert issubclass(NatsServerNotFound, FileNotFoundError) and issubclass(DemoError, RuntimeError)
    assert issubclass(TaskLoadError, ValueError) and issubclass(NoRolloutError, ConnectionError)


def test_every_public_error_is_exactly_one_of_retryable_or_final_by_its_own_decision() -> None:
    undecided = sorted(
        name
        for name, cls in _exception_classes().items()
        if not isinstance(vars(cls).get("retryable"), bool)  # set in the class's own body, never inherited
    )
    assert not undecided, f"errors that do not say whether a retry may succeed: {undecided}"
    retryable = {n for n, c in _exception_classes().items() if vars(c)["retryable"]}
    final = {n for n, c in _exception_classes().items() if not vars(c)["retryable"]}
    assert retryable and final and not retryable & final


def test_what_the_caller_does_next() -> None:
    # Something else is restarting or a race was lost: the same call may succeed.
    retry: tuple[type[WeightbusError], ...] = (errors.BusError, errors.BusConnectError, errors.PublishError)
    retry += (errors.SequenceConflictError, errors.EngineError, errors.EngineOutOfSyncError)
    retry += (errors.TrackerNotReadyError, errors.NoRolloutError)
    for cls in retry:
        assert cls.retryable, cls
    # Someone must change something first: the policy id, a permission, a config, the stream, the owner.
    final: tuple[type[WeightbusError], ...] = (
        errors.CounterExhaustedError,
        errors.FencedError,
        errors.PermissionDeniedError,
        errors.BusConfigError,
        errors.StreamConfigError,
        errors.StreamNotFoundError,
        errors.InvalidEventError,
        errors.InstallError,
    )
    for cls in final:
        assert not cls.retryable, cls
    connect = errors.BusConnectError("nats://h:1", "refused", "refused")
    assert is_retryable(connect) and connect.retryable
    assert not is_retryable(errors.StreamConfigError("nats://h:1", "WEIGHTBUS", ["max_msgs_per_subject is 8"]))
    assert not is_retryable(ConnectionError("not a weightbus error"))
    assert not is_retryable(KeyboardInterrupt())


def test_an_exhausted_counter_is_a_bus_error_but_no_publish_error() -> None:
    exc = errors.CounterExhaustedError("weightbus.p.weights", "p", 2**53 - 1)
    assert isinstance(exc, errors.BusError) and not isinstance(exc, errors.PublishError)
    assert (exc.subject, exc.policy, exc.issued) == ("weightbus.p.weights", "p", 2**53 - 1)
    assert "new policy id" in exc.reason and "new policy id" in str(exc)
    from weightbus.producers.counter import CounterExhaustedError  # where the counter raises it

    assert CounterExhaustedError is errors.CounterExhaustedError
