"""Where nats-py may be touched: imported only under ``weightbus.bus`` (never by ``cli/``), not at all by
``import weightbus.bus``, and its private attributes only in ``weightbus.bus._natspy``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import weightbus

SRC = Path(weightbus.__file__).parent
NATSPY = SRC / "bus" / "_natspy.py"
# nats-py's private attributes weightbus reads or writes (client, subscription, JetStream state, header parser).
PRIVATE = frozenset(
    {
        "_status",
        "_pending",
        "_pending_data_size",
        "_pending_queue",
        "_pending_size",
        "_reading_task",
        "_ping_interval_task",
        "_flusher_task",
        "_reconnection_task",
        "_reconnection_task_future",
        "_wait_for_msgs_task",
        "_jsi",
        "_hbtask",
        "_fctask",
        "_transport",
        "_server_pool",
        "_current_server",
        "_sub",
        "parse_email",
    }
)


def _imports_nats(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "nats" or a.name.startswith("nats.") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == "nats" or node.module.startswith("nats."):
                lines.append(node.lineno)
    return lines


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_import_weightbus_bus_does_not_import_nats_py() -> None:
    code = (
        "import sys, weightbus.bus, weightbus.bus.memory, weightbus.bus.protocol, weightbus.bus.subjects,"
        " weightbus.bus.history, weightbus.bus.options, weightbus.bus.trace;"
        "print(','.join(sorted(m for m in sys.modules if m == 'nats' or m.startswith('nats.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_lazy_names_still_import_from_the_package() -> None:
    from weightbus.bus import NatsBus, connect
    from weightbus.bus import nats as nats_module

    assert NatsBus is nats_module.NatsBus and connect is nats_module.connect


def test_nats_py_is_imported_only_under_weightbus_bus() -> None:
    outside = {
        str(path.relative_to(SRC)): lines
        for path in _sources()
        if "bus" not in path.relative_to(SRC).parts[:1]
        for lines in [_imports_nats(ast.parse(path.read_text()))]
        if lines
    }
    assert outside == {}, f"nats-py imported outside weightbus.bus: {outside}"


def test_private_nats_py_state_is_touched_only_in_natspy() -> None:
    reaches: dict[str, list[str]] = {}
    for path in _sources():
        if path == NATSPY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # ``self._status`` is the module's own state; ``client._status`` or ``sub._sub`` is nats-py's.
            if (
                isinstance(node, ast.Attribute)
                and node.attr in PRIVATE
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                reaches.setdefault(str(path.relative_to(SRC)), []).append(f"{node.lineno}:{node.attr}")
    assert reaches == {}, f"nats-py private state touched outside bus/_natspy.py: {reaches}"
