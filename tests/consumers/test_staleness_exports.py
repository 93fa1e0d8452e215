"""The consumers package's staleness API: ``__all__`` lists exactly the public names, sorted."""

import importlib

import pytest

MODULES = [
    "weightbus.rules.staleness",
    "weightbus.consumers.drain.stage",
    "weightbus.consumers.drain.buffer",
    "weightbus.consumers.drain.metrics",
    "weightbus.consumers.drain.reports",
    "weightbus.schemas.rollouts",
    "weightbus.rules",
    "weightbus.rules.chain",
    "weightbus.rules.history",
    "weightbus.consumers.drain",
    "weightbus.consumers.drain.window",
    "weightbus.consumers.tracker",
    "weightbus.embedded",
]


@pytest.mark.parametrize("name", MODULES)
def test_module_all_is_sorted_and_resolves(name):
    module = importlib.import_module(name)
    assert module.__doc__
    assert list(module.__all__) == sorted(module.__all__, key=lambda n: (not n.isupper(), n))
    for public in module.__all__:
        assert hasattr(module, public), public


def test_package_reexports_the_staleness_api():
    package = importlib.import_module("weightbus.consumers")
    for name in ["FullyAsyncBuffer", "StalenessStage", "judge_groups", "DrainReporter", "StalenessMetrics", "Reason"]:
        assert name in package.__all__
        assert getattr(package, name).__module__.startswith(("weightbus.consumers.", "weightbus.rules."))
