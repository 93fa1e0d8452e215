"""The demo's child processes: how each is started (one config file per child), watched and stopped.

A replacement is the same config with its own identity; a child is stopped by pid (SIGTERM, SIGKILL), never by name.
A child never writes to the terminal: its stdout and stderr go to ``<name>.log`` in the run's log directory, so the
supervisor is the terminal's one writer (it prints a failed child's last lines itself).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec

from weightbus.demo.config import DemoConfig
from weightbus.errors import DemoError
from weightbus.process.logs import logging_env
from weightbus.refengine.config import EngineConfig
from weightbus.rl.config import RolloutConfig, TrainerConfig, dump_config

__all__ = ["Layout", "Process", "http_ok", "router_argv", "router_workers", "wait_until", "weightbus_argv"]

_STOP_GRACE = 5.0
_READY_TIMEOUT = 60.0


class Process:
    """One child process, its output in ``<log_dir>/<name>.log`` (``tmp`` when no log_dir), stopped by pid."""

    def __init__(
        self, name: str, argv: list[str], tmp: Path, env: dict[str, str] | None = None, *, log_dir: Path | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = (log_dir or tmp) / f"{name}.log"
        # The demo's --log-level/--log-format reach its children; torch keeps a compile cache in the system temp
        # dir: keep it in ours, which is removed at the end.
        self.env = {
            **os.environ,
            **logging_env(),
            **(env or {}),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp / "torchinductor"),
        }
        self.popen: subprocess.Popen[bytes] | None = None
        self.expected_exit = False

    def start(self) -> Process:
        """Start it, its stdout and stderr appended to its log."""
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )
        self.expected_exit = False
        return self

    def alive(self) -> bool:
        """Whether it runs."""
        return self.popen is not None and self.popen.poll() is None

    def exited_ok(self) -> bool:
        """Whether it exited with status 0."""
        return self.popen is not None and self.popen.poll() == 0

    def kill(self) -> None:
        """SIGKILL it and reap it (a fault, not a stop)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period."""
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
        """The last lines of its log, on one line."""
        return " | ".join(self.last_lines(lines))

    def last_lines(self, lines: int = 10) -> list[str]:
        """The last ``lines`` non-empty lines of its log (none when it cannot be read)."""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            return [line for line in text.splitlines() if line.strip()][-lines:]
        return []

    def failed(self) -> bool:
        """Whether it exited unasked with a non-zero status (a stop or a fault's kill is asked)."""
        return self.popen is not None and self.popen.poll() not in (None, 0) and not self.expected_exit


def wait_until(
    predicate: Callable[[], bool], what: str, processes: list[Process], timeout: float = _READY_TIMEOUT
) -> None:
    """Poll ``predicate`` until true.

    Raises:
        DemoError: one of ``processes`` exited meanwhile, or ``timeout`` passed.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        for proc in processes:
            if not proc.alive():
                raise DemoError(f"{proc.name} exited during startup (log {proc.log_path}): {proc.tail(1)}")
        if time.monotonic() > deadline:
            raise DemoError(f"{what} not ready within {timeout:.0f} s")
        time.sleep(0.05)


def http_ok(url: str) -> bool:
    """Whether GET ``url`` answers 200."""
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def router_workers(url: str) -> int:
    """How many healthy workers the router at ``url`` lists."""
    try:
        body = httpx.get(f"{url}/workers", timeout=1.0).json()
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(1 for w in body.get("workers", []) if w.get("is_healthy"))


def weightbus_argv(*args: str) -> list[str]:
    """A ``weightbus`` command on this interpreter."""
    return [sys.executable, "-m", "weightbus.cli", *args]


def router_argv(port: int, engines: list[str], prometheus_port: int) -> list[str]:
    """The SGLang router in front of ``engines`` on 127.0.0.1:``port``, checking their health every second."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *engines,
        "--log-level",
        "warn",
        "--health-check-interval-secs",
        "1",
        # Its metrics exporter defaults to 0.0.0.0:29000: a second router on the host would die.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
    ]


@dataclass(frozen=True)
class Layout:
    """Where one run's pieces are: its directory, the URLs, and the configs of its children."""

    tmp: Path
    nats_url: str
    engine_ports: list[int]
    router_port: int
    log_dir: Path | None = None
    """Where the children's logs go (``<name>.log``); ``tmp`` when None."""

    @property
    def logs(self) -> Path:
        """The directory of the children's logs."""
        return self.log_dir or self.tmp

    def process(self, name: str, argv: list[str]) -> Process:
        """Child ``name`` running ``argv``, its output in ``logs/<name>.log``."""
        return Process(name, argv, self.tmp, log_dir=self.logs)

    @property
    def router(self) -> str:
        """The router's URL."""
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def engines(self) -> list[str]:
        """The engines' URLs."""
        return [f"http://127.0.0.1:{port}" for port in self.engine_ports]

    @property
    def run_dir(self) -> Path:
        """The trainer's run directory (checkpoint, ``steps.jsonl``, weight files)."""
        return self.tmp / "run"

    def _write(self, name: str, config: msgspec.Struct) -> str:
        return str(dump_config(config, self.tmp / f"{name}.json"))

    def engine(self, config: DemoConfig, i: int) -> Process:
        """Engine ``i``: the policy model from the trainer's seed, sampling seeded per engine."""
        spec = EngineConfig(
            port=self.engine_ports[i],
            model="policy",
            seed=config.seed,
            sampling_seed=config.seed * 10 + i,
            token_delay=0.0,
        )
        return self.process(f"engine-{i}", weightbus_argv("engine", "--config", self._write(f"engine-{i}", spec)))

    def rollout(self, config: DemoConfig, n: int) -> Process:
        """The ``n``-th rollout process (a restart seeds its prompt stream anew)."""
        spec = RolloutConfig(
            router_url=self.router,
            nats_url=self.nats_url,
            policy=config.policy,
            group_size=config.group_size,
            batch=config.batch,
            in_flight=config.in_flight,
            max_staleness=config.max_staleness,
            on_stale=config.on_stale,
            follow_lora=config.lora_rank is not None,
            seed=config.seed * 100 + n,
            admission=config.admission,
            cap=config.rollout_cap,
            early_abort=config.early_abort,
        )
        argv = weightbus_argv("rollout", "--config", self._write(f"rollout-{n}", spec))
        return self.process(f"rollout-{n}", argv)

    def trainer(self, config: DemoConfig, n: int) -> Process:
        """The ``n``-th trainer (``trainer-<n>`` on the bus); a replacement resumes the run directory."""
        spec = TrainerConfig(
            router_url=self.router,
            nats_url=self.nats_url,
            policy=config.policy,
            run_dir=str(self.run_dir),
            steps=config.steps,
            batch=config.batch,
            seed=config.seed,
            lr=config.lr,
            lora_rank=config.lora_rank,
            trainer_id=f"trainer-{n}",
        )
        argv = weightbus_argv("trainer", "--config", self._write(f"trainer-{n}", spec))
        return self.process(f"trainer-{n}", argv)

    def recorder(self) -> Process:
        """Records every event of the bus (from the start of the stream) into ``bus.jsonl``."""
        argv = weightbus_argv("record", "--nats", self.nats_url, "--out", str(self.recording), "--deliver", "all")
        return self.process("recorder", argv)

    @property
    def recording(self) -> Path:
        """The recorder's output."""
        return self.tmp / "bus.jsonl"
