"""``weightbus watch``'s layout on a small screen (80x24) and while the bus is down, drawn by a recording Console."""

from __future__ import annotations

from rich.console import Console

from tests._builders import updated
from weightbus.cli.watch import render
from weightbus.consumers.monitor import LinkView, MonitorState, latest_alert, link_seen, reduce
from weightbus.schemas import DrainReport, VersionRegressed

NOW = 200.0


def _two_policies(alerts: int = 8, drains: int = 8) -> MonitorState:
    state = MonitorState()
    for policy, version in (("demo", 12), ("demo-copy", 7)):
        event = updated(version, policy=policy, trainer="trainer-a", at=100.0)
        state = reduce(state, f"weightbus.{policy}.weights", event, received_at=100.1)
    for seq in range(drains):
        report = DrainReport(
            policy="demo",
            consumer="rm-0",
            seq=seq,
            current=12,
            kept=7,
            recycled=2,
            dropped=1,
            published_at=110.0 + seq,
            staleness_avg=1.5,
            staleness_max=4,
        )
        state = reduce(state, "weightbus.demo.drains", report, received_at=110.0 + seq)
    for n in range(alerts):
        alert = VersionRegressed(
            policy="demo-copy",
            current=7,
            incoming=n,
            incoming_epoch=2,
            publisher="trainer-b",
            action="hold",
            observer="rm-0",
            published_at=120.0 + n,
        )
        state = reduce(state, "weightbus.demo-copy.alerts", alert, received_at=120.0 + n)
    # The newest alert of all: a rogue lower version on demo's weights subject.
    rogue = updated(1, policy="demo", epoch=2, trainer="rogue-v1", at=190.0)
    return reduce(state, "weightbus.demo.weights", rogue, received_at=190.0)


def _screen(state: MonitorState, link: LinkView | None = None, *, width: int = 80, height: int = 24) -> list[str]:
    console = Console(width=width, height=height, record=True, color_system=None)
    console.print(render(state, NOW, link=link, fit_height=True))
    return console.export_text().splitlines()


def _rows(lines: list[str], column: int) -> list[str]:
    """The cells of the first table's ``column`` (0-based), one per screen line of its body."""
    start = next(i for i, line in enumerate(lines) if line.startswith("┡")) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
    return [line.split("│")[column + 1].strip() for line in lines[start:end]]


def test_at_80x24_each_policy_shows_its_whole_name_version_status_and_the_newest_alert_shows() -> None:
    lines = _screen(_two_policies())
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), "\n".join(lines)
    header = next(line for line in lines if line.startswith("┃"))
    assert [h.strip() for h in header.split("┃")[1:4]] == ["policy", "version", "status"]
    assert _rows(lines, 0) == ["demo", "demo-copy"]
    assert _rows(lines, 1) == ["12", "7"]
    assert _rows(lines, 2) == ["rejected v1", "8 alerts"]
    assert lines[0].startswith("latest alert: 10.0s ago  demo  regression_seen  v12 → v1")
    assert "rogue-v1" in lines[0] + lines[1]
    assert "recent alerts" in "\n".join(lines)


def test_at_80_columns_the_low_priority_columns_go_first() -> None:
    text = "\n".join(_screen(_two_policies()))
    assert "since update" in text
    assert "total k/r/d" not in text and "staleness avg/max" not in text
    wide = Console(width=250, record=True, color_system=None)
    wide.print(render(_two_policies(), NOW))
    text = wide.export_text()
    assert "total k/r/d" in text and "12 (rejected v1 by rogue-v1)" in text


def test_the_alerts_shown_are_the_newest_that_fit_and_nothing_runs_off_the_screen() -> None:
    lines = _screen(_two_policies(alerts=8, drains=8), height=20)
    assert len(lines) <= 20, "\n".join(lines)
    text = "\n".join(lines)
    assert "v12 → v1 on the weights subject" in text  # the newest alert, also in the alerts table
    assert "v7 → v0" not in text  # the oldest one gave way
    assert "recent drains" not in text  # no room left for them


def test_a_long_policy_name_folds_instead_of_becoming_a_prefix() -> None:
    state = MonitorState()
    names = ("alpha-experiment-2026-12-run-a", "alpha-experiment-2026-12-run-b")
    for name in names:
        state = reduce(state, f"weightbus.{name}.weights", updated(3, policy=name, at=100.0), received_at=100.0)
    lines = _screen(state, width=30)
    assert all(len(line) <= 30 for line in lines)
    assert "…" not in "".join(_rows(lines, 0))
    assert "".join(_rows(lines, 0)) == "".join(names)


def test_while_the_bus_is_down_a_banner_gives_the_outages_age_and_the_view_is_marked_stale() -> None:
    link = LinkView("nats://127.0.0.1:4333", down_since=NOW - 150)
    lines = _screen(_two_policies(), link)
    assert len(lines) <= 24
    assert lines[0].strip() == "DISCONNECTED from nats://127.0.0.1:4333 for 2m30s: the view below is stale"
    assert lines[1].startswith("latest alert:") and "rogue-v1" in lines[1] + lines[2]
    assert "as of 2m30s ago" in "\n".join(lines)
    assert _rows(lines, 2) == ["rejected v1 (stale)", "8 alerts (stale)"]
    up = "\n".join(_screen(_two_policies(), LinkView("nats://127.0.0.1:4333")))
    assert "DISCONNECTED" not in up and "stale" not in up


def test_link_seen_keeps_the_first_time_the_connection_was_seen_down_until_it_is_back() -> None:
    link = LinkView("nats://h:1")
    assert link_seen(link, True, 10.0) is link
    down = link_seen(link, False, 10.0)
    assert down.down_since == 10.0 and down.down_for(12.5) == 2.5
    assert link_seen(down, False, 20.0).down_since == 10.0
    assert link_seen(down, True, 21.0) == LinkView("nats://h:1")


def test_latest_alert_is_the_newest_of_any_policy() -> None:
    assert latest_alert(MonitorState()) is None
    newest = latest_alert(_two_policies())
    assert newest is not None and newest[0] == "demo" and newest[1].kind == "regression_seen"
