"""The demo's faults, each a real process operation, and the rogue publish that ends every run.

Each fault is a SIGKILL and a restart or replacement, recorded (kind, step, time, engine) for the report's checks. A
restarted engine is then caught up from the bus (``producers.catch_up``, what it did recorded as the fault's
``catchup``), usually before the trainer's next push reaches it; when that push is first, the catch-up finds it current.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any, Final

from weightbus.bus import connect, subjects
from weightbus.demo.children import Layout, Process, http_ok, wait_until
from weightbus.demo.config import DemoConfig
from weightbus.embedded.server import EmbeddedNats
from weightbus.engines.sglang import SGLangClient
from weightbus.errors import BusError, CatchupError
from weightbus.producers import catch_up
from weightbus.rl.report import ROGUE_ID
from weightbus.schemas import WeightUpdated, now

__all__ = ["Injector", "rogue_publish"]

#: Seconds the catch-up of a restarted engine may take (a connect, a history read, one small load).
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
        """Catch the restarted engine up from the bus once it answers (in this process: no interpreter start to
        wait for, so it usually lands before the trainer's retried push); what it did, for the report."""
        wait_until(functools.partial(http_ok, f"{url}/health"), f"engine {url}", list(self.procs.values()))
        record = asyncio.run(_catch_up(self.layout.nats_url, self.config.policy, url))
        return record | {"time": time.time()}

    def _replace(self, role: str, make: Any) -> None:
        self.procs[role].kill()
        self._starts[role] += 1
        self.procs[role] = make(self.config, self._starts[role]).start()


async def _catch_up(nats_url: str, policy: str, url: str) -> dict[str, Any]:
    """``catch_up`` of one engine, as a record: its outcome, version and loads, or ``failed`` with the reason."""
    try:
        async with asyncio.timeout(_CATCHUP_TIMEOUT):
            bus = await connect(nats_url, name="weightbus-demo-catchup", ensure_stream=False)
            try:
                async with SGLangClient(url) as client:
                    result = await catch_up(bus, policy, client, observer="demo-catchup")
            finally:
                await bus.aclose()
    except CatchupError as exc:
        return {"outcome": "failed", "reason": exc.reason, "error": str(exc)}
    except (BusError, TimeoutError) as exc:
        # NATS restarting (a kill-nats at the same step): the trainer's next push still reaches the engine.
        return {"outcome": "failed", "reason": "bus", "error": repr(exc)}
    return {
        "outcome": result.outcome,
        "version": result.version,
        "before": result.before,
        "loaded": list(result.loaded),
    }


async def rogue_publish(url: str, policy: str) -> None:
    """Announce v1 as a script that bypasses the counter would (the rollout's tracker must hold and alert)."""
    bus = await connect(url, name="weightbus-demo-rogue")
    try:
        event = WeightUpdated(policy=policy, version=1, epoch=0, trainer_id=ROGUE_ID, published_at=now())
        await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:rogue:{uuid.uuid4().hex}")
    finally:
        await bus.aclose()
