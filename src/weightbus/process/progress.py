"""Progress of the RL loop's processes on stderr: one short line per step, or a bar where a person waits.

Plain ``key=value`` lines (the logs stay JSON); a bar only on a terminal with a known number of steps.
"""

from __future__ import annotations

import sys
from typing import IO, Any

__all__ = ["ProgressPrinter", "format_progress"]


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def format_progress(process: str, fields: dict[str, Any]) -> str:
    """``<process> key=value ...`` for one progress report (None shown as ``-``, floats to 3 places)."""
    return " ".join([process, *(f"{key}={_value(value)}" for key, value in fields.items())])


class ProgressPrinter:
    """Prints a process's progress reports: a rich bar on a terminal when ``total`` is known, else plain lines.

    Use as a context manager (the bar is closed on exit); ``quiet`` prints nothing at all.
    """

    def __init__(self, process: str, *, total: int | None = None, quiet: bool = False, stream: IO[str] | None = None):
        self.process = process
        self.total = total
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressPrinter:
        if not self.quiet and self.total is not None and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"{self.process}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream),
            )
            self._bar.start()
            self._task = self._bar.add_task(self.process, total=self.total, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def report(self, fields: dict[str, Any], *, completed: int | None = None) -> None:
        """Show one report; ``completed`` advances the bar (steps done so far)."""
        if self.quiet:
            return
        if self._bar is not None:
            info = " ".join(f"{k}={_value(v)}" for k, v in fields.items() if k not in ("step", "steps"))
            self._bar.update(self._task, completed=completed, info=info)
            return
        self.stream.write(format_progress(self.process, fields) + "\n")
        self.stream.flush()
