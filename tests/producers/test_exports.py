"""The producers package: exactly its public names, a publisher nothing can drive around the protocol, no cycles."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import weightbus.producers as producers
from weightbus.producers import PublisherState, VersionPublisher

SRC = Path(__file__).resolve().parents[2] / "src" / "weightbus"


def test_all_is_sorted_and_complete() -> None:
    assert producers.__all__ == sorted(producers.__all__)
    public = {name for name in vars(producers) if not name.startswith("_")} - {
        "artifact",
        "catchup",
        "counter",
        "coverage",
        "fleet",
        "highwater",
        "lora",
        "metrics",
        "publisher",
        "stamping",
        "status",
        "sync",
        "update",
        "watcher",
    }
    assert public == set(producers.__all__)


def test_the_publisher_exposes_start_update_publish_lora_and_read_only_state() -> None:
    members = {name for name in dir(VersionPublisher) if not name.startswith("_")}
    methods = {"start", "update", "publish_lora", "check_owner", "check_outranks", "settle", "aclose"}
    assert members == methods | {"state"}
    prop = inspect.getattr_static(VersionPublisher, "state")
    assert isinstance(prop, property) and prop.fset is None and prop.fdel is None
    # One frozen snapshot: its fields are the publisher's read-only state, none can be set.
    assert {f.name for f in dataclasses.fields(PublisherState)} == {
        "active",
        "epoch",
        "fenced",
        "incarnation",
        "issued",
        "last_event",
        "next_version",
        "policy",
        "started",
        "trainer_id",
        "version",
    }
    assert PublisherState.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert {"__aenter__", "__aexit__"} <= set(vars(VersionPublisher))


def _imports(path: Path) -> set[str]:
    """The ``weightbus`` modules ``path`` imports (at any depth, type-only imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("weightbus"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("weightbus"))
    return out


def _graph() -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_producers_import_no_consumers_module() -> None:
    for name, deps in _graph().items():
        if name.startswith("weightbus.producers"):
            assert not {d for d in deps if d.startswith("weightbus.consumers")}, name


def test_no_import_cycle_between_modules_in_src() -> None:
    # Package __init__ re-exports are edges too, except a package's own submodules importing it back.
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if dep.startswith(node + "."):
                continue  # a package importing its own submodule (its __init__'s re-exports)
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    offending = [c for c in cycles if not all(_is_package_edge(a, b) for a, b in zip(c, c[1:], strict=False))]
    assert not offending, offending


def _is_package_edge(a: str, b: str) -> bool:
    """``a`` imports the package ``b`` it belongs to (``from weightbus.bus import subjects`` in ``bus.stream``)."""
    return a.startswith(b + ".")
