"""The demo's supervisor loop: start the children, follow ``steps.jsonl``, inject the faults, check the run.

A child dying unasked (but the trainer finishing), or two minutes without a training step, ends the run (``DemoError``).
The supervisor is the terminal's one writer: each child's output goes to ``OUT/logs/<name>.log`` (named in one line
at the start); when the run fails, the last lines of the failed children's logs are printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightbus.demo.children import (
    Layout,
    Process,
    http_ok,
    router_argv,
    router_workers,
    wait_until,
)
from weightbus.demo.config import DemoConfig
from weightbus.demo.faults import Injector, rogue_publish
from weightbus.embedded.server import EmbeddedNats, free_port
from weightbus.errors import DemoError
from weightbus.rl.report import DemoResult, analyse, trained_staleness
from weightbus.rl.writers import write_report

__all__ = ["run_demo"]

_STALL_S = 120.0
_WATCHED = ("trainer", "rollout", "router", "engine-0", "engine-1", "recorder")
#: How many lines of a failed child's log the supervisor prints.
_TAIL_LINES = 10


def _read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def _format_step(row: dict[str, Any], fault: str | None) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    # The trained groups' staleness (the bound's); the judged one counts recycled and dropped groups too.
    avg, top = trained_staleness(row)
    line = (
        f"step {row['step']:>3}  v{row['version']:<4} reward {row['reward']:.3f}  "
        f"staleness avg {num(avg, '.2f')} max {num(top, 'd')} (judged max {num(row['staleness_max'], 'd')})  "
        f"kept {row['kept']} recycled {row['recycled']} dropped {row['dropped']}  "
        f"lag {num(row.get('lag_s') and row['lag_s'] * 1000, '.1f')} ms  "
        f"step {row['step_s'] * 1000:.0f} ms (weightbus {row['weightbus_s'] * 1000:.1f} ms, "
        f"engines {(row.get('engine_http_s') or 0) * 1000:.1f} ms)"
    )
    return line + (f"   <- {fault}" if fault else "")


def _terminate_as_interrupt() -> Any:
    """Make SIGTERM unwind like Ctrl-C, so the cleanup runs; returns the previous handler (None off the main thread)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signum)  # the signal travels with it: the CLI exits 143, not Ctrl-C's 130

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: the caller owns signals
        return None


def _start(config: DemoConfig, layout: Layout, procs: dict[str, Process]) -> None:
    """Engines and recorder, then the router once the engines answer, then rollout and trainer."""
    layout.run_dir.mkdir()
    for i in range(len(layout.engine_ports)):
        procs[f"engine-{i}"] = layout.engine(config, i).start()
    procs["recorder"] = layout.recorder().start()
    for url in layout.engines:
        wait_until(functools.partial(http_ok, f"{url}/health"), f"engine {url}", list(procs.values()))
    argv = router_argv(layout.router_port, layout.engines, free_port())
    procs["router"] = layout.process("router", argv).start()
    wait_until(lambda: router_workers(layout.router) == len(layout.engines), "router", list(procs.values()))
    procs["rollout"] = layout.rollout(config, 0).start()
    procs["trainer"] = layout.trainer(config, 0).start()


def _follow(
    config: DemoConfig, layout: Layout, procs: dict[str, Process], injector: Injector, emit: Callable[[str], None]
) -> None:
    """Print each step as the trainer records it and inject the faults planned after it, until the last step."""
    plan = config.fault_plan()
    shown = consumed = 0
    last_progress = time.monotonic()
    steps_path = layout.run_dir / "steps.jsonl"
    while shown < config.steps:
        for row in _read_steps(steps_path)[consumed:]:
            consumed += 1
            step = row["step"]
            repeated = step <= shown  # redone by a replacement trainer after a failover
            shown = max(shown, step)
            last_progress = time.monotonic()
            due = [] if repeated else [name for name, at in plan.items() if at == step]
            emit(_format_step(row, ", ".join(due) if due else ("redone" if repeated else None)))
            for name in due:
                injector.inject(name, step)
        for name in _WATCHED:
            proc = procs[name]
            if not proc.alive() and not (name == "trainer" and proc.exited_ok()):
                code = proc.popen.poll() if proc.popen is not None else None
                raise DemoError(f"{name} exited unexpectedly (status {code}, log {proc.log_path}): {proc.tail(1)}")
        if time.monotonic() - last_progress > _STALL_S:
            raise DemoError(
                f"no training step for {_STALL_S:.0f} s after step {shown} (logs {procs['trainer'].log_path}, "
                f"{procs['rollout'].log_path})"
            )
        time.sleep(0.05)


def _finish(config: DemoConfig, layout: Layout, procs: dict[str, Process]) -> None:
    """Let the trainer exit, then announce the rogue v1 and wait (boundedly) for the rollout's alert on record."""
    procs["trainer"].popen.wait(30)  # type: ignore[union-attr]
    # Against the rollout's live tracker: a script that bypasses the counter announces v1; the tracker must hold
    # the higher version and publish VersionRegressed.
    asyncio.run(rogue_publish(layout.nats_url, config.policy))
    with contextlib.suppress(DemoError):
        wait_until(
            lambda: "alert.version_regressed" in layout.recording.read_text(),
            "the regression alert",
            [procs["recorder"]],
            10,
        )
    for name in _WATCHED[1:]:
        procs[name].stop()


def _log_dir(config: DemoConfig, tmp: Path) -> Path:
    """``OUT/logs`` (this run's logs only: an earlier run's are removed), else the temporary directory."""
    if config.out_dir is None:
        return tmp
    logs = Path(config.out_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()
    return logs


def _show_failures(procs: dict[str, Process], emit: Callable[[str], None], fallback: tuple[str, ...]) -> None:
    """Print the last lines of each child that failed (of the ``fallback`` ones when none did: a stall, a timeout)."""
    failed = [proc for proc in procs.values() if proc.failed()]
    if not failed:
        failed = [procs[name] for name in fallback if name in procs]
    for proc in failed:
        lines = proc.last_lines(_TAIL_LINES)
        emit(f"{proc.name}: last {len(lines)} lines of {proc.log_path}")
        for line in lines:
            emit(f"  {proc.name} | {line}")


def run_demo(config: DemoConfig, emit: Callable[[str], None] = print) -> DemoResult:
    """Run the loop to ``config.steps``, inject the faults, write the report, and return the analysis.

    Raises:
        DemoError: a process failed to start, or died and could not be replaced.
    """
    previous = _terminate_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="weightbus-demo-"))
    procs: dict[str, Process] = {}
    nats: EmbeddedNats | None = None
    started = time.time()
    try:
        logs = _log_dir(config, tmp)
        nats = EmbeddedNats(store_dir=tmp / "nats", log_file=logs / "nats.log").start()
        layout = Layout(
            tmp=tmp,
            nats_url=nats.url,
            engine_ports=[free_port(), free_port()],
            router_port=free_port(),
            log_dir=logs,
        )
        try:
            _start(config, layout, procs)
        except DemoError:
            _show_failures(procs, emit, fallback=tuple(procs))
            raise
        emit(f"nats {nats.url}  engines {' '.join(layout.engines)}  router {layout.router}")
        plan = config.fault_plan()
        faults = ", ".join(f"{name} after step {at}" for name, at in plan.items()) or "none (--no-faults)"
        emit(
            f"training {config.steps} steps, max_staleness {config.max_staleness}, on_stale {config.on_stale}, "
            f"admission {config.admission}, early abort {'on' if config.early_abort else 'off'}"
        )
        emit(f"faults: {faults}")
        emit(
            f"logs: {logs}{'' if config.out_dir is not None else ' (removed at the end)'} (one <name>.log per process)"
        )
        injector = Injector(config, layout, procs, nats)
        try:
            _follow(config, layout, procs, injector, emit)
        except DemoError:
            _show_failures(procs, emit, fallback=("trainer", "rollout"))
            raise
        _finish(config, layout, procs)
        result = analyse(
            config,
            rows=_read_steps(layout.run_dir / "steps.jsonl"),
            recording=layout.recording,
            faults=injector.injected,
            engines=layout.engines,
            wall_s=time.time() - started,
        )
        if config.out_dir is not None:
            write_report(result, Path(config.out_dir))
        return result
    finally:
        for proc in procs.values():
            proc.stop()
        if nats is not None:
            nats.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
