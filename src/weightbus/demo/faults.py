"""The demo's faults, each a real process operation, and the rogue publish that ends every run.

Each fault is a SIGKILL and a restart or replacement, recorded (kind, step, time, engine) for the report's checks. A
restarted engine is then caught up from the bus by ``weightbus catchup`` (its exit code and JSON line recorded as the
fault's ``catchup``), before the trainer's next push reaches it, unless that push is first.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
import uuid
from typing import Any, Final

from weightbus.bus import connect, subjects
from weightbus.demo.children import Layout, Process, http_ok, wait_until, weightbus_argv
from weightbus.demo.config import DemoConfig
from weightbus.embedded.server import EmbeddedNats
from weightbus.process.logs import logging_env
from weightbus.rl.report import ROGUE_ID
from weightbus.schemas import WeightUpdated, now

__all__ = ["Injector", "rogue_publish"]

#: Seconds the catch-up of a restarted engine may take (a Python start, one history read, one small load).
_CATCHUP_TIMEOUT: Final = 60.0


class Injector:
    """Injects the faults of one run into its processes and records them."""

    def __init__(self, config: DemoConfig, layout: Layout, procs: dict[str, Process], nats: EmbeddedNats) -> None:
        self.config = config
        self.layout = layout
        self.procs = procs
        self.nats = nats
        self.injected: list[dict[str, Any]] = []
        self._starts = {"trainer": 0, "rollout": 0}

    def inject(self, kind: str, step: int) -> None:
        """Inject ``kind`` now, after ``step``."""
        fault: dict[str, Any] = {"kind": kind, "step": step, "time": time.time()}
        if kind == "restart-engine":
            fault["engine"] = self.layout.engines[0]
        self.injected.append(fault)
        if kind == "failover":
            self._replace("trainer", self.layout.trainer)
        elif kind == "kill-nats":
            self.nats.kill()
            self.nats.start()
        elif kind == "restart-rollout":
            self._replace("rollout", self.layout.rollout)
        elif kind == "restart-engine":
            self.procs["engine-0"].kill()
            self.procs["engine-0"] = self.layout.engine(self.config, 0).start()
            fault["catchup"] = self._catch_up(fault["engine"])
        else:
            raise ValueError(f"unknown fault {kind!r}")

    def _catch_up(self, url: str) -> dict[str, Any]:
        """Run ``weightbus catchup`` on the restarted engine once it answers; its exit code and JSON line."""
        wait_until(functools.partial(http_ok, f"{url}/health"), f"engine {url}", list(self.procs.values()))
        argv = weightbus_argv(
            "catchup", "--nats", self.layout.nats_url, "--policy", self.config.policy, "--engine", url, "--json"
        )
        env = {**os.environ, **logging_env()}
        with (self.layout.logs / "catchup.log").open("ab") as log:
            try:
                done = subprocess.run(
                    argv, stdout=subprocess.PIPE, stderr=log, env=env, timeout=_CATCHUP_TIMEOUT, check=False
                )
            except subprocess.TimeoutExpired:
                # The trainer's next full push still reaches the engine; the report says it was not caught up.
                return {"exit": None, "result": None, "time": time.time()}
        lines = done.stdout.decode("utf-8", "replace").splitlines()
        result = json.loads(lines[-1]) if lines else None
        return {"exit": done.returncode, "result": result, "time": time.time()}

    def _replace(self, role: str, make: Any) -> None:
        self.procs[role].kill()
        self._starts[role] += 1
        self.procs[role] = make(self.config, self._starts[role]).start()


async def rogue_publish(url: str, policy: str) -> None:
    """Announce v1 as a script that bypasses the counter would (the rollout's tracker must hold and alert)."""
    bus = await connect(url, name="weightbus-demo-rogue")
    try:
        event = WeightUpdated(policy=policy, version=1, epoch=0, trainer_id=ROGUE_ID, published_at=now())
        await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:rogue:{uuid.uuid4().hex}")
    finally:
        await bus.aclose()
