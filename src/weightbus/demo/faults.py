"""The demo's faults, each a real process operation, and the rogue publish that ends every run.

Each fault is a SIGKILL and a restart or replacement, recorded (kind, step, time, engine) for the report's checks.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from weightbus.bus import connect, subjects
from weightbus.demo.children import Layout, Process
from weightbus.demo.config import DemoConfig
from weightbus.embedded.server import EmbeddedNats
from weightbus.rl.report import ROGUE_ID
from weightbus.schemas import WeightUpdated, now

__all__ = ["Injector", "rogue_publish"]


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
        else:
            raise ValueError(f"unknown fault {kind!r}")

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
