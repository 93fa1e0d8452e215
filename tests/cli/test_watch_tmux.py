"""``weightbus watch`` in a real 80x24 terminal (a tmux pane), against a nats-server of its own that the test stops.

What the pane shows is read with ``tmux capture-pane``: both policies with their whole names, versions and
statuses, the newest alert, and once the server is gone the DISCONNECTED banner and its growing age.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests._builders import updated, wait_until
from weightbus.bus import connect, subjects
from weightbus.embedded import EmbeddedNats
from weightbus.schemas import VersionRegressed

pytestmark = [
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (a real terminal for the live table)"),
]

_MAIN = "import sys; from weightbus.cli import main; sys.argv[0] = 'weightbus'; main()"
_WAIT = 30.0
_POLL = 0.2  # each look at the screen runs tmux once


def _tmux(socket: str, *args: str, check: bool = True) -> str:
    # -S: a tmux server of this test alone (kill-server ends nothing else); -f /dev/null: no user config.
    done = subprocess.run(
        ["tmux", "-S", socket, "-f", os.devnull, *args], capture_output=True, text=True, timeout=10, check=check
    )
    return done.stdout


def _cells(screen: list[str], policy: str) -> list[str]:
    """The policies table's first three cells on the row of ``policy``, or [] when it is not on screen."""
    for line in screen:
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 4 and cells[1] == policy:
            return cells[1:4]
    return []


async def _publish_demo(url: str) -> None:
    async with await connect(url, connect_timeout=5) as bus:
        for policy, version in (("demo", 12), ("demo-copy", 7)):
            event = updated(version, policy=policy, trainer="trainer-a")
            await bus.publish(subjects.weights(policy), event, msg_id=f"{policy}:w:{version}")
        alert = VersionRegressed(
            policy="demo-copy",
            current=7,
            incoming=3,
            incoming_epoch=2,
            publisher="trainer-b",
            action="hold",
            observer="rm-0",
            published_at=updated(0).published_at,
        )
        await bus.publish(subjects.alerts("demo-copy"), alert, msg_id="demo-copy:alert:1")
        # The newest alert: a rogue lower version on demo's weights subject, which watch flags itself.
        rogue = updated(1, policy="demo", epoch=2, trainer="rogue-v1")
        await bus.publish(subjects.weights("demo"), rogue, msg_id="demo:w:1:2")


async def test_watch_at_80x24_shows_each_policy_and_the_newest_alert_then_the_outage(tmp_path: Path) -> None:
    # A short directory of its own: a socket path has a length limit that tmp_path can pass; removed at the end.
    sockets = Path(tempfile.mkdtemp(prefix="wb-tmux-"))
    socket = str(sockets / "s")
    server = EmbeddedNats(store_dir=tmp_path / "store", log_file=tmp_path / "nats.log").start()
    started_tmux = False
    try:
        await _publish_demo(server.url)
        env = ["env", "-u", "COLUMNS", "-u", "LINES", f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}"]
        watch = shlex.join([*env, sys.executable, "-c", _MAIN, "watch", "--nats", server.url])
        # The shell stays after watch so that an early exit stays on screen, where the failure shows it.
        _tmux(socket, "new-session", "-d", "-x", "80", "-y", "24", "-s", "watch", f"{watch}; echo watch exited $?; cat")
        started_tmux = True
        screen: list[str] = []

        def look() -> list[str]:
            nonlocal screen
            screen = _tmux(socket, "capture-pane", "-p", "-t", "watch").splitlines()
            return screen

        def shows_everything() -> bool:
            look()
            return bool(_cells(screen, "demo") and _cells(screen, "demo-copy"))

        await wait_until(shows_everything, _WAIT, "watch to draw both policies", interval=_POLL)
        assert len(screen) <= 24 and all(len(line) <= 80 for line in screen)
        assert _cells(screen, "demo") == ["demo", "12", "rejected v1"], "\n".join(screen)
        assert _cells(screen, "demo-copy") == ["demo-copy", "7", "1 alert"], "\n".join(screen)
        latest = next(i for i, line in enumerate(screen) if line.startswith("latest alert:"))
        assert "demo  regression_seen  v12 → v1" in screen[latest], "\n".join(screen)
        assert "rogue-v1" in screen[latest] + screen[latest + 1], "\n".join(screen)

        server.stop()
        banner = re.compile(rf"DISCONNECTED from {re.escape(server.url)} for (\d+)s")

        def outage_age() -> int | None:
            found = [m for line in look() if (m := banner.search(line))]
            return int(found[-1].group(1)) if found else None

        await wait_until(lambda: outage_age() is not None, _WAIT, "the DISCONNECTED banner", interval=_POLL)
        await wait_until(lambda: (outage_age() or 0) >= 2, _WAIT, "the outage's age to grow", interval=_POLL)
        text = "\n".join(screen)
        assert "(stale)" in text and re.search(r"as of \d+s ago", text), text
        assert _cells(screen, "demo")[:2] == ["demo", "12"] and "latest alert:" in text, text
    finally:
        if started_tmux:
            _tmux(socket, "kill-server", check=False)  # a failure here must not hide the test's own
        server.stop()
        shutil.rmtree(sockets, ignore_errors=True)
