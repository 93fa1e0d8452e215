"""How a ``weightbus`` command ends: the shared exit codes, the one ``error:`` line, and signals.

A mistake is one ``error:`` line, never a traceback; SIGINT exits 130 and SIGTERM 143, after ``finally`` blocks ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, Final, TypeVar

import typer
from typer._click import exceptions as click_errors  # typer 0.29 vendors click; these are not re-exported
from typer.core import TyperGroup

from weightbus.errors import EventLoopError
from weightbus.process.eventloop import run as run_on_loop

__all__ = [
    "EXIT_DENIED",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_NATS",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "CommandGroup",
    "fail",
    "run_async",
    "signal_exit_code",
]

T = TypeVar("T")

EXIT_OK: Final = 0
#: A runtime failure with no more specific code.
EXIT_FAILURE: Final = 1
#: A bad option or argument (click's own usage errors use it too).
EXIT_USAGE: Final = 2
#: NATS unreachable (or refusing what the command needs).
EXIT_NATS: Final = 5
#: NATS refused this user an action the command needs (permissions): reachable, but not allowed (sysexits' NOPERM).
EXIT_DENIED: Final = 77
#: Ctrl-C (SIGINT).
EXIT_INTERRUPTED: Final = 128 + signal.SIGINT
#: SIGTERM.
EXIT_TERMINATED: Final = 128 + signal.SIGTERM


def signal_exit_code(sig: int) -> int:
    """The exit code of a command stopped by ``sig``: 128 + its number (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""
    return 128 + int(sig)


def fail(message: str, code: int = EXIT_FAILURE) -> typer.Exit:
    """Print ``message`` to stderr as one ``error:`` line and return an Exit to raise with ``code``."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    return typer.Exit(code)


class CommandGroup(TyperGroup):
    """The root group: click's usage errors become one ``error:`` line naming the command (exit 2)."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click_errors.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None else ""
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            fail(f"{where}{exc.format_message()}{hint}", exc.exit_code)
            sys.exit(exc.exit_code)
        except typer.Abort:
            fail("aborted", EXIT_FAILURE)
            sys.exit(EXIT_FAILURE)
        sys.exit(code if isinstance(code, int) else EXIT_OK)


async def _cancel_on_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    installed = False
    if task is not None:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
            installed = True
    try:
        return await coro
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGTERM)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine on weightbus's loop (uvloop where installed, ``WEIGHTBUS_EVENT_LOOP``).

    Ctrl-C (exit 130) and SIGTERM (exit 143) cancel it, so its cleanup runs.
    """
    try:
        return run_on_loop(_cancel_on_sigterm(coro))
    except EventLoopError as exc:
        coro.close()  # the wrapper was closed unstarted, so the command's own coroutine never ran either
        raise fail(str(exc), EXIT_USAGE) from None
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except asyncio.CancelledError:
        raise typer.Exit(EXIT_TERMINATED) from None
