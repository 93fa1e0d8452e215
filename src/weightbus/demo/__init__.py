"""``weightbus demo``: a supervisor that runs the fully-async RL loop as separate processes and checks it.

It starts an embedded nats-server (store in a temporary directory), two reference engines serving the policy
model, the real SGLang router in front of them, a recorder of the bus, the rollout process and the trainer,
each a ``weightbus`` (or ``sglang_router``) command a user could launch alone, each given its config as one JSON
file written from :class:`DemoConfig` (``config``, ``children``). It prints one line per training step from the
trainer's ``steps.jsonl``, injects the four faults (trainer failover, NATS kill, rollout restart, engine restart) at
spread steps by default as real process operations (``faults``), and at the end writes ``report.json`` and
``report.png`` and checks the invariants (:mod:`weightbus.rl.report`), each ``held``, ``failed`` or ``vacuous``.

Invariants of the supervisor itself: every process it starts is stopped on exit, on an error and on Ctrl-C
(SIGTERM, then SIGKILL after a grace period, by pid), and its temporary directory is removed.
"""

from __future__ import annotations

from weightbus.demo.config import FAULTS, DemoConfig
from weightbus.demo.supervisor import run_demo

__all__ = ["FAULTS", "DemoConfig", "run_demo"]
