"""Chaos: a holder of the shared budget outlives its lease (paused, partitioned, or the bus down), and the
running groups stay within the limit.

Three rollout processes (this module run as a script: ``Admission`` in the ``cap`` mode over one
``SharedBudget``) keep every slot busy with groups of 1 to 4 s (3 to 8 s in the outage). The first one reaches
nats-server through a TCP proxy of the test's own, which can be cut. Scenarios: that process is SIGSTOPped for
10 s and continued; its proxy is cut for 8 s; the nats-server is killed and restarted on its store 6 s later.
Every process records the start and end of each group and each ledger it stored, with a timestamp. Checked
from those records:

* the peak of running groups across the processes never exceeds the cap (6): the others count a lapsed
  holding for ``linger_s`` more, and a holder back from the fault writes what it still has in use;
* no ledger was refused by the validation and no holding counted as tampered with (there is no forger here);
* no process started a group later than ``lease_s - skew_s`` after its last stored ledger (its own clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._builders import wait_until
from tests.chaos.conftest import kill_pid, report
from weightbus.embedded.server import EmbeddedNats

pytestmark = [pytest.mark.slow, pytest.mark.nats]

POLICY = "chaos-lease"
CAP = 6
LEASE_S = 2.0
SKEW_S = 0.3
#: Covers the longest fault here (a 10 s pause) plus a group: the bound under test is "no over-admission".
LINGER_S = float(os.environ.get("WEIGHTBUS_TEST_LINGER_S", "14"))
HOLD_S = (1.0, 4.0)
#: In the outage every holder stops admitting ``lease - skew`` into it: only groups longer than the rest of the
#: outage are still running when the bus comes back (a generation of several seconds).
OUTAGE_HOLD_S = (3.0, 8.0)


class Proxy:
    """A TCP proxy to ``port`` that can be cut (every connection closed, new ones refused) and restored."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._cut = False
        self._conns: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.close()
            return
        self._conns |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    if self._cut:
                        break
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._conns -= {writer, up_writer}

    def cut(self) -> None:
        self._cut = True
        for w in list(self._conns):
            w.transport.abort()

    def restore(self) -> None:
        self._cut = False

    async def aclose(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def _spawn(url: str, name: str, log: Path, hold: tuple[float, float]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    with log.with_suffix(".err").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, __file__, url, name, str(log), str(hold[0]), str(hold[1])],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def peak_running(groups: list[tuple[float, float]]) -> int:
    """The most groups running at one instant, from (start, end) pairs; an end sorts before a start."""
    edges = sorted([(s, 1) for s, _ in groups] + [(e, -1) for _, e in groups])
    running = best = 0
    for _, step in edges:
        running += step
        best = max(best, running)
    return best


@pytest.mark.parametrize("fault", ["sigstop", "partition", "outage"])
async def test_running_groups_stay_within_the_cap_when_a_holder_outlives_its_lease(
    fault: str, own_server: EmbeddedNats, tmp_path: Path
) -> None:
    proxy = await Proxy(own_server.port).start()
    logs = [tmp_path / f"r{i}.jsonl" for i in range(3)]
    urls = [f"nats://127.0.0.1:{proxy.port}", own_server.url, own_server.url]
    hold = OUTAGE_HOLD_S if fault == "outage" else HOLD_S
    procs = [_spawn(urls[i], f"r{i}", logs[i], hold) for i in range(3)]
    try:
        await wait_until(
            lambda: all(any(r["kind"] == "start" for r in _records(log)) for log in logs),
            60,
            "every worker's first group",
        )
        await asyncio.sleep(3.0)  # the scenario: every worker runs a while before the fault
        fault_at = time.time()
        if fault == "sigstop":
            kill_pid(procs[0].pid, signal.SIGSTOP)
            await asyncio.sleep(10.0)
            kill_pid(procs[0].pid, signal.SIGCONT)
        elif fault == "partition":
            proxy.cut()
            await asyncio.sleep(8.0)
            proxy.restore()
        else:
            own_server.kill()
            await asyncio.sleep(6.0)
            await asyncio.to_thread(own_server.start)
        healed_at = time.time()
        # Long enough for every process to be back and admitting, and for the linger to run out.
        await asyncio.sleep(8.0)
        assert all(p.poll() is None for p in procs), [log.with_suffix(".err").read_text()[-2000:] for log in logs]
    finally:
        for p in procs:
            kill_pid(p.pid, signal.SIGCONT)
            kill_pid(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                kill_pid(p.pid)
                p.wait(5)
        await proxy.aclose()

    recs = [_records(log) for log in logs]
    last = max(r["t"] for rs in recs for r in rs)
    groups: list[tuple[float, float]] = []
    for rs in recs:
        ends = {r["id"]: r["t"] for r in rs if r["kind"] == "end"}
        groups += [(r["t"], ends.get(r["id"], last)) for r in rs if r["kind"] == "start"]
    peak = peak_running(groups)
    during = [g for g in groups if g[1] > fault_at]
    after = sum(1 for rs in recs for r in rs if r["kind"] == "start" and r["t"] > healed_at)
    report(f"admission-lease-{fault}", peak=peak, cap=CAP, groups=len(groups), after=after, linger_s=LINGER_S)
    assert during and after, "the processes did not admit through and after the fault"
    assert peak <= CAP, f"peak {peak} running groups against a cap of {CAP} ({fault})"
    # No honest ledger was refused by the validation, and no holding was taken for tampered with.
    for i, rs in enumerate(recs):
        checks = [r for r in rs if r["kind"] == "checks"]
        assert checks and checks[-1]["rejected"] == {} and checks[-1]["tampered"] == 0, (i, checks[-1:])
    # A holder admits only on a lease it renewed itself, within lease - skew of sending it.
    for i, rs in enumerate(recs):
        writes = sorted(r["sent"] for r in rs if r["kind"] == "ledger")
        for r in rs:
            if r["kind"] != "start":
                continue
            before = [w for w in writes if w <= r["t"]]
            assert before and r["t"] - before[-1] <= LEASE_S - SKEW_S + 0.05, (i, r, before[-1:])


# -- the worker process ------------------------------------------------------------------------------------


async def _worker(url: str, name: str, log_path: Path, hold: tuple[float, float]) -> None:
    from weightbus.bus import connect
    from weightbus.consumers.admission import Admission, SharedBudget

    out = log_path.open("a", buffering=1)

    def write(record: dict[str, Any]) -> None:
        out.write(json.dumps(record) + "\n")

    sent: list[float] = [0.0]
    bus = await connect(url, name=f"chaos-{name}", publish_timeout=0.5, publish_attempts=1)
    budget = SharedBudget(
        bus,
        POLICY,
        name=name,
        lease_s=LEASE_S,
        skew_s=SKEW_S,
        linger_s=LINGER_S,
        grant=1,
        on_write=lambda ledger, seq: write({"kind": "ledger", "seq": seq, "t": time.time(), "sent": sent[0]}),
    )
    gate = Admission("cap", cap=CAP, batch=1, budget=budget, poll_s=0.02)
    # The wall-clock time a write was sent: a lease counts from the send (the holder's own clock).
    real_publish = bus.publish

    async def publish(*args: Any, **kwargs: Any) -> Any:
        at = time.time()
        ack = await real_publish(*args, **kwargs)
        sent[0] = at
        return ack

    bus.publish = publish  # type: ignore[method-assign]
    rng = random.Random(name)
    ids = iter(range(1 << 30))

    async def produce() -> None:
        while True:
            slot = await gate.acquire()
            k = next(ids)
            write({"kind": "start", "id": k, "t": time.time()})
            await asyncio.sleep(rng.uniform(*hold))
            write({"kind": "end", "id": k, "t": time.time()})
            slot.release("finished")

    async def account() -> None:
        # What the validation refused, for the record: with no forger here, an honest ledger refused is a bug.
        while True:
            await asyncio.sleep(0.5)
            write({"kind": "checks", "t": time.time(), "rejected": budget.rejected, "tampered": budget.tampered})

    async with budget:
        await asyncio.gather(*(produce() for _ in range(4)), account())


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_worker(sys.argv[1], sys.argv[2], Path(sys.argv[3]), (float(sys.argv[4]), float(sys.argv[5]))))
