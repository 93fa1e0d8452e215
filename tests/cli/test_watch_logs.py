"""A log line written while ``watch`` draws its live view lands above the view, never leaving a ghost header.

The terminal is emulated: the view's console and the log handler share one stream (as stdout and stderr
share a tty), and the final screen is rebuilt from the cursor movements rich writes.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import sys
from collections.abc import Iterator

import pytest
from rich.console import Console

from tests._builders import updated, wait_until
from weightbus.bus import MemoryBus, subjects
from weightbus.cli.watch import watch
from weightbus.process.logs import setup_logging

_TOKEN = re.compile(r"\x1b\[(\??)(\d*)([A-Za-z])|\r|\n|[^\x1b\r\n]+")


def screen(raw: str) -> list[str]:
    """The lines a terminal shows after ``raw`` (text, CR, LF, cursor up/down/column, erase line)."""
    lines = [""]
    row = col = 0
    for match in _TOKEN.finditer(raw):
        token = match.group(0)
        if token == "\n":
            row, col = row + 1, 0
        elif token == "\r":
            col = 0
        elif token.startswith("\x1b["):
            private, number, command = match.groups()
            if private:
                continue  # cursor visibility
            if command == "A":
                row = max(0, row - int(number or 1))
            elif command == "B":
                row += int(number or 1)
            elif command == "G":
                col = int(number or 1) - 1
            elif command == "K":
                while len(lines) <= row:
                    lines.append("")
                lines[row] = "" if number == "2" else lines[row][:col]
            continue  # colours and styles
        else:
            while len(lines) <= row:
                lines.append("")
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token) :]
            col += len(token)
        while len(lines) <= row:
            lines.append("")
    return [line.rstrip() for line in lines]


@pytest.fixture
def tty(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    setup_logging(0)  # the command's handler, writing to "stderr": the same terminal
    yield stream
    root.handlers[:] = handlers
    root.setLevel(level)


async def test_a_log_line_during_the_live_view_leaves_no_ghost_header(tty: io.StringIO) -> None:
    console = Console(file=tty, force_terminal=True, color_system=None, width=220, height=60)
    bus = MemoryBus()
    await bus.publish(subjects.weights("p"), updated(1, trainer="trainer-a"), msg_id="p:1")

    async def meanwhile() -> None:
        await wait_until(lambda: "weightbus — " in tty.getvalue(), 1.5, "the live view")
        logging.getLogger("weightbus.consumers").warning("something worth a line", extra={"policy": "p"})
        await wait_until(lambda: "something worth a line" in tty.getvalue(), 1.5, "the log line")
        await bus.publish(subjects.weights("p"), updated(2, trainer="trainer-a"), msg_id="p:2")

    task = asyncio.create_task(meanwhile())
    await watch(bus, "weightbus.>", duration=1.5, console=console, refresh_per_second=20)
    await task
    shown = screen(tty.getvalue())
    headers = [line.strip() for line in shown if line.strip().startswith("weightbus — ")]
    assert headers == ["weightbus — 1 policies, 2 events"], "\n".join(shown)
    logged = [line for line in shown if "something worth a line" in line]
    assert len(logged) == 1 and logged[0].startswith("{") and '"level": "warning"' in logged[0], "\n".join(shown)
    # The line is above the view, not drawn over it.
    assert shown.index(logged[0]) < next(n for n, line in enumerate(shown) if headers[0] in line)
    assert logging.getLogger().handlers[0].stream is tty  # type: ignore[attr-defined]  # restored after the view
