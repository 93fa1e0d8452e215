"""``weightbus demo``: a supervisor that runs the fully-async RL loop as separate processes and checks it.

It starts an embedded nats-server (store in a temporary directory), two reference engines serving the policy
model, the real SGLang router in front of them, a recorder of the bus, the rollout process and the trainer,
each a ``weightbus`` (or ``sglang_router``) command a user could launch alone. It prints one line per training
step from the trainer's ``steps.jsonl``, injects the requested faults as real process operations, and at the
end writes ``report.json`` and ``report.png`` and checks the invariants (:mod:`weightbus.rl.report`). Each step line
shows the step's time, weightbus's own part of it and the engines' HTTP time inside ``update()``.

Invariants of the supervisor itself: every process it starts is stopped on exit, on an error and on Ctrl-C
(SIGTERM, then SIGKILL after a grace period, by pid), and its temporary directory is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from weightbus.bus import connect, subjects
from weightbus.embedded.server import EmbeddedNats, free_port
from weightbus.errors import DemoError
from weightbus.rl.report import ROGUE_ID, DemoResult, analyse, write_report
from weightbus.schemas import WeightUpdated, now

__all__ = ["DemoConfig", "DemoError", "run_demo"]

_STOP_GRACE = 5.0
_READY_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """One demo run.

    Attributes:
        steps: training steps.
        max_staleness: the rollout's bound.
        on_stale: ``recycle`` or ``drop``.
        seed: initial weights, sampler and prompt stream.
        group_size, batch, in_flight: rollout shape.
        lr: the trainer's learning rate.
        lora_rank: train and push a LoRA adapter of this rank instead of the full weights.
        out_dir: where ``report.json`` and ``report.png`` go (None: write nothing).
        failover_at, kill_nats_at, restart_rollout_at, restart_engine_at: the step after which each fault is
            injected, or None.
        policy: the policy id.
    """

    steps: int = 80
    max_staleness: int = 1
    on_stale: str = "recycle"
    seed: int = 0
    group_size: int = 8
    batch: int = 8
    in_flight: int = 4
    lr: float = 0.05
    lora_rank: int | None = None
    out_dir: Path | None = Path("demo-report")
    failover_at: int | None = None
    kill_nats_at: int | None = None
    restart_rollout_at: int | None = None
    restart_engine_at: int | None = None
    policy: str = "demo"


class _Process:
    """One child process, its log in the run directory, stopped by pid."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        # torch keeps a compile cache in the system temp dir; keep it in ours, which is removed at the end.
        self.env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(log_dir / "torchinductor")}
        self.popen: subprocess.Popen[bytes] | None = None
        self.expected_exit = False

    def start(self) -> _Process:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )
        self.expected_exit = False
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.expected_exit = True
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(_STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])
        return ""


def _wait(predicate: Callable[[], bool], what: str, processes: list[_Process], timeout: float = _READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for proc in processes:
            if not proc.alive():
                raise DemoError(f"{proc.name} exited during startup: {proc.tail()}")
        if time.monotonic() > deadline:
            raise DemoError(f"{what} not ready within {timeout:.0f} s")
        time.sleep(0.05)


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _router_workers(url: str) -> int:
    try:
        body = httpx.get(f"{url}/workers", timeout=1.0).json()
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(1 for w in body.get("workers", []) if w.get("is_healthy"))


def _weightbus(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightbus.cli", *args]


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

    line = (
        f"step {row['step']:>3}  v{row['version']:<4} reward {row['reward']:.3f}  "
        f"staleness avg {num(row['staleness_avg'], '.2f')} max {num(row['staleness_max'], 'd')}  "
        f"kept {row['kept']} recycled {row['recycled']} dropped {row['dropped']}  "
        f"lag {num(row.get('lag_s') and row['lag_s'] * 1000, '.1f')} ms  "
        f"step {row['step_s'] * 1000:.0f} ms (weightbus {row['weightbus_s'] * 1000:.1f} ms, "
        f"engines {(row.get('engine_http_s') or 0) * 1000:.1f} ms)"
    )
    return line + (f"   <- {fault}" if fault else "")


async def _rogue_publish(url: str, policy: str) -> None:
    bus = await connect(url, name="weightbus-demo-rogue")
    try:
        event = WeightUpdated(policy=policy, version=1, epoch=0, trainer_id=ROGUE_ID, published_at=now())
        await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:rogue:{uuid.uuid4().hex}")
    finally:
        await bus.close()


def _terminate_as_interrupt() -> Any:
    """Make SIGTERM unwind like Ctrl-C, so the cleanup runs; returns the previous handler (None off the main thread)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: the caller owns signals
        return None


def run_demo(config: DemoConfig, emit: Callable[[str], None] = print) -> DemoResult:
    """Run the loop to ``config.steps``, inject the faults, write the report, and return the analysis.

    Raises:
        DemoError: a process failed to start, or died and could not be replaced.
    """
    previous = _terminate_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="weightbus-demo-"))
    procs: dict[str, _Process] = {}
    nats: EmbeddedNats | None = None
    faults: list[dict[str, Any]] = []
    started = time.time()
    try:
        nats = EmbeddedNats(store_dir=tmp / "nats", log_file=tmp / "nats.log").start()
        engine_ports = [free_port() for _ in range(2)]
        router_port = free_port()
        router = f"http://127.0.0.1:{router_port}"
        engine_urls = [f"http://127.0.0.1:{p}" for p in engine_ports]
        run_dir = tmp / "run"
        run_dir.mkdir()
        seed = str(config.seed)

        def engine(i: int) -> _Process:
            argv = _weightbus(
                "engine",
                "--port",
                str(engine_ports[i]),
                "--model",
                "policy",
                "--seed",
                seed,
                "--sampling-seed",
                str(config.seed * 10 + i),
                "--token-delay",
                "0",
            )
            return _Process(f"engine-{i}", argv, tmp)

        def rollout(n: int) -> _Process:
            argv = _weightbus(
                "rollout",
                "--router",
                router,
                "--nats",
                nats.url,
                "--policy",
                config.policy,
                "--group-size",
                str(config.group_size),
                "--batch",
                str(config.batch),
                "--in-flight",
                str(config.in_flight),
                "--max-staleness",
                str(config.max_staleness),
                "--on-stale",
                config.on_stale,
                "--seed",
                str(config.seed * 100 + n),
            )
            if config.lora_rank is not None:
                argv.append("--lora")
            return _Process(f"rollout-{n}", argv, tmp)

        def trainer(n: int) -> _Process:
            argv = _weightbus(
                "trainer",
                "--router",
                router,
                "--nats",
                nats.url,
                "--policy",
                config.policy,
                "--run-dir",
                str(run_dir),
                "--steps",
                str(config.steps),
                "--batch",
                str(config.batch),
                "--seed",
                seed,
                "--lr",
                str(config.lr),
                "--trainer-id",
                f"trainer-{n}",
            )
            if config.lora_rank is not None:
                argv += ["--lora", str(config.lora_rank)]
            return _Process(f"trainer-{n}", argv, tmp)

        for i in range(2):
            procs[f"engine-{i}"] = engine(i).start()
        procs["recorder"] = _Process(
            "recorder",
            _weightbus("record", "--nats", nats.url, "--out", str(tmp / "bus.jsonl"), "--deliver", "all"),
            tmp,
        ).start()
        for url in engine_urls:
            _wait(lambda url=url: _http_ok(f"{url}/health"), f"engine {url}", list(procs.values()))
        router_argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(router_port),
            "--worker-urls",
            *engine_urls,
            "--log-level",
            "warn",
            "--health-check-interval-secs",
            "1",
            # Its metrics exporter defaults to 0.0.0.0:29000: a second router on the host would die.
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        procs["router"] = _Process("router", router_argv, tmp).start()
        _wait(lambda: _router_workers(router) == 2, "router", list(procs.values()))
        procs["rollout"] = rollout(0).start()
        procs["trainer"] = trainer(0).start()
        emit(f"nats {nats.url}  engines {' '.join(engine_urls)}  router {router}")
        emit(f"training {config.steps} steps, max_staleness {config.max_staleness}, on_stale {config.on_stale}")

        plan = {
            "failover": config.failover_at,
            "kill-nats": config.kill_nats_at,
            "restart-rollout": config.restart_rollout_at,
            "restart-engine": config.restart_engine_at,
        }
        counters = {"trainer": 0, "rollout": 0}
        shown = 0
        consumed = 0
        last_progress = time.monotonic()
        steps_path = run_dir / "steps.jsonl"
        while shown < config.steps:
            rows = _read_steps(steps_path)
            for row in rows[consumed:]:
                consumed += 1
                step = row["step"]
                repeated = step <= shown  # redone by a replacement trainer after a failover
                shown = max(shown, step)
                last_progress = time.monotonic()
                done = [] if repeated else [name for name, at in plan.items() if at == step]
                emit(_format_step(row, ", ".join(done) if done else ("redone" if repeated else None)))
                for name in done:
                    fault = {"kind": name, "step": step, "time": time.time()}
                    if name == "restart-engine":
                        fault["engine"] = engine_urls[0]
                    faults.append(fault)
                    if name == "failover":
                        procs["trainer"].kill()
                        counters["trainer"] += 1
                        procs["trainer"] = trainer(counters["trainer"]).start()
                    elif name == "kill-nats":
                        nats.kill()
                        nats.start()
                    elif name == "restart-rollout":
                        procs["rollout"].kill()
                        counters["rollout"] += 1
                        procs["rollout"] = rollout(counters["rollout"]).start()
                    elif name == "restart-engine":
                        procs["engine-0"].kill()
                        procs["engine-0"] = engine(0).start()
            for name in ("trainer", "rollout", "router", "engine-0", "engine-1", "recorder"):
                proc = procs[name]
                if not proc.alive() and not (name == "trainer" and proc.popen and proc.popen.returncode == 0):
                    raise DemoError(f"{name} exited unexpectedly: {proc.tail()}")
            if time.monotonic() - last_progress > 120:
                raise DemoError(f"no training step for 120 s; trainer log: {procs['trainer'].tail()}")
            time.sleep(0.05)
        procs["trainer"].popen.wait(30)  # type: ignore[union-attr]
        # The old demo's last act, now against the rollout's live tracker: a script that bypasses the counter
        # announces v1; the tracker must hold the higher version and publish VersionRegressed.
        asyncio.run(_rogue_publish(nats.url, config.policy))
        recording = tmp / "bus.jsonl"
        with contextlib.suppress(DemoError):
            _wait(
                lambda: "alert.version_regressed" in recording.read_text(),
                "the regression alert",
                [procs["recorder"]],
                10,
            )
        for name in ("rollout", "router", "engine-0", "engine-1", "recorder"):
            procs[name].stop()
        result = analyse(
            config,
            rows=_read_steps(steps_path),
            recording=tmp / "bus.jsonl",
            faults=faults,
            engines=engine_urls,
            wall_s=time.time() - started,
        )
        if config.out_dir is not None:
            write_report(result, config.out_dir)
        return result
    finally:
        for proc in procs.values():
            proc.stop()
        if nats is not None:
            nats.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
