"""ops/ stays true to the code: every metric the rules and dashboard query is one weightbus exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from weightbus.bus import BusMetrics
from weightbus.consumers import StalenessMetrics, TrackerMetrics

OPS = Path(__file__).parent.parent / "ops"


def exported_series() -> set[str]:
    registry = CollectorRegistry()
    BusMetrics(registry).invalid_events.labels("weights", "invalid").inc()
    drain = StalenessMetrics(registry).for_policy("p")
    drain.count_groups("kept", "fresh")
    drain.observe_staleness([1])
    drain.set_buffer(1, 1.0, 1)
    tracker = TrackerMetrics(registry).for_policy("p")
    tracker.observe_lag(0.01)
    tracker.count_regression()
    tracker.set_state(1, 0, 1.0)
    return {sample.name for family in registry.collect() for sample in family.samples}


def referenced(path: Path) -> set[str]:
    return set(re.findall(r"\bweightbus_[a-z_]+", path.read_text()))


def test_rules_and_dashboard_query_only_exported_metrics() -> None:
    series = exported_series()
    files = [OPS / "prometheus" / "weightbus-rules.yml", OPS / "grafana" / "weightbus-dashboard.json"]
    for path in files:
        names = referenced(path)
        assert names, path
        assert names <= series, f"{path.name} queries unknown series: {sorted(names - series)}"


def test_dashboard_is_valid_json_with_panels() -> None:
    dashboard = json.loads((OPS / "grafana" / "weightbus-dashboard.json").read_text())
    assert dashboard["uid"] == "weightbus" and len(dashboard["panels"]) >= 6


def test_nats_configs_enable_jetstream_and_bind_loopback_where_single() -> None:
    single = (OPS / "nats" / "single.conf").read_text()
    assert "jetstream" in single and "listen: 127.0.0.1:" in single
    for name in ("cluster.conf", "auth.conf"):
        assert "jetstream" in (OPS / "nats" / name).read_text()


def test_nats_configs_parse_with_the_real_server() -> None:
    import os
    import subprocess

    from weightbus.bus import find_nats_server

    env = {**os.environ, "TRAINER_PASSWORD": "t", "ROLLOUT_PASSWORD": "r"}
    for conf in sorted((OPS / "nats").glob("*.conf")):
        out = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True, env=env)
        assert out.returncode == 0 and "is valid" in out.stdout + out.stderr, (conf, out.stderr)
