"""ops/ stays true to the code: the rules and dashboard query only series weightbus really emits, with
label names and values the code really uses; the nats configs parse and match what the tests start.

The emitted series come from running the code (a tracker over a ``MemoryBus`` through an update, a live
update and a regression; stages judging fresh, stale, unknown and aborted groups, dropping and
recycling; an invalid payload on a subscription), not from a hand-written list.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests._builders import make_group, updated, wait_until
from tests.roles import ENV, PASSWORDS
from weightbus.bus import BusMetrics, ConnectOptions, Deliver, MemoryBus, connect, subjects
from weightbus.consumers import StalenessMetrics, StalenessStage, TrackerMetrics, VersionTracker
from weightbus.consumers.admission.metrics import AdmissionMetrics
from weightbus.consumers.replicas import ConvergenceMetrics, ReplicaFollower
from weightbus.embedded.cluster import CLUSTER_CONF, EmbeddedCluster
from weightbus.embedded.server import find_nats_server
from weightbus.engines import SGLangClient
from weightbus.errors import CatchupError
from weightbus.producers import CatchupMetrics, catch_up
from weightbus.schemas import WeightApplied
from weightbus.schemas.rollouts import SampleStatus

OPS = Path(__file__).parent.parent / "ops"
RULES = OPS / "prometheus" / "weightbus-rules.yml"
RULES_TESTS = sorted((OPS / "prometheus" / "tests").glob("*.yml"))
_SELECTOR = re.compile(r"\b(weightbus_[a-z_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_BY = re.compile(r"\bby\s*\(([^)]*)\)")


async def _run_the_code(registry: CollectorRegistry) -> None:
    policy = "p"
    bus = MemoryBus(BusMetrics(registry))
    w = subjects.weights(policy)
    await bus.publish(w, updated(5, policy=policy), msg_id="ops:5")
    async with VersionTracker(bus, policy, registry=registry) as tracker:
        await tracker.wait_ready(5)
        await bus.publish(w, updated(6, policy=policy), msg_id="ops:6")  # live: lag observed
        await tracker.wait_for(6, 5)
        rogue = updated(9, policy=policy, trainer="rogue")
        await bus.publish(w, rogue, msg_id="ops:rogue")  # not from the owner: rejected
        await wait_until(
            lambda: registry.get_sample_value(
                "weightbus_events_rejected_total", {"policy": policy, "reason": "not_owner"}
            )
        )
        changes = tracker.changes(include_regressions=True)
        await anext(changes)
        await bus.publish(w, updated(1, policy=policy, epoch=2), msg_id="ops:1")  # a regression
        await asyncio.wait_for(anext(changes), 5)
        await changes.aclose()
    sub = bus.subscribe(w, deliver=Deliver.NEW)
    await bus.publish_raw(w, b"{not json", msg_id="ops:bad")
    await bus.publish(w, updated(7, policy=policy, epoch=2), msg_id="ops:7")
    await asyncio.wait_for(anext(sub), 5)  # skips the invalid payload, counting it
    await sub.aclose()
    convergence = ConvergenceMetrics(registry).for_policy(policy)
    async with ReplicaFollower(bus, policy, metrics=convergence) as replicas:
        await replicas.wait_ready(5)
        await bus.publish(w, updated(8, policy=policy, epoch=2, engines=("http://a",)), msg_id="ops:8")
        ack = WeightApplied(
            policy=policy, version=8, engine="http://a", read_back="8", ok=True, published_at=time.time()
        )
        await bus.publish(subjects.applied(policy), ack, msg_id="ops:applied:8")  # live: activation and convergence
        await replicas.wait_until(lambda view: view.serving(exact_version=8) or None, 5)
    async with SGLangClient("http://127.0.0.1:9") as engine:  # never touched: the policy never published
        with contextlib.suppress(CatchupError):
            await catch_up(bus, "never-published", engine, metrics=CatchupMetrics(registry))
    await bus.aclose()

    AdmissionMetrics(registry).for_policy(policy)  # the shared budget's families, each series at 0
    metrics = StalenessMetrics(registry)
    groups = [
        make_group(0, ["7"], n=1, tokens=[1]),
        make_group(1, ["3"], n=1, tokens=[1]),
        make_group(2, ["default"], n=1, tokens=[1]),
        make_group(3, ["7"], status=SampleStatus.ABORTED, n=1, tokens=[1]),
    ]
    for on_stale in ("drop", "recycle"):
        StalenessStage(max_staleness=1, on_stale=on_stale, metrics=metrics.for_policy(f"p-{on_stale}")).judge(groups, 7)
    StalenessStage(max_staleness=None, metrics=metrics.for_policy("p-unmeasured")).judge(
        [make_group(4, ["7"], n=1, tokens=[1])], None
    )


def emitted() -> dict[str, dict[str, set[str]]]:
    """Every series name the code emits, with each label's values."""
    registry = CollectorRegistry()
    asyncio.run(_run_the_code(registry))
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for family in registry.collect():
        for sample in family.samples:
            labels = out[sample.name]
            for key, value in sample.labels.items():
                labels[key].add(value)
    return out


def rule_exprs() -> list[tuple[str, str, str]]:
    """``(alert, expr, annotations text)`` of every rule, read without a YAML library."""
    rules: list[tuple[str, str, str]] = []
    lines = RULES.read_text().splitlines()
    current: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("- alert:"):
            if current:
                rules.append((current["alert"], current["expr"], current.get("rest", "")))
            current = {"alert": stripped.split(":", 1)[1].strip(), "rest": ""}
        elif stripped.startswith("expr:"):
            value = stripped.split(":", 1)[1].strip()
            if value == "|":
                indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
                block = []
                while i + 1 < len(lines) and (len(lines[i + 1]) - len(lines[i + 1].lstrip()) >= indent):
                    i += 1
                    block.append(lines[i].strip())
                value = " ".join(block)
            current["expr"] = value
        elif current:
            current["rest"] += line + "\n"
        i += 1
    if current:
        rules.append((current["alert"], current["expr"], current.get("rest", "")))
    return rules


def _check_expr(alert: str, expr: str, annotations: str, series: dict[str, dict[str, set[str]]]) -> list[str]:
    problems: list[str] = []
    names = []
    for name, matchers in _SELECTOR.findall(expr):
        names.append(name)
        if name not in series:
            problems.append(f"{alert}: unknown series {name}")
            continue
        for label, op, value in _MATCHER.findall(matchers or ""):
            values = series[name].get(label)
            if not values:
                problems.append(f"{alert}: {name} has no label {label!r}")
            elif op in ("=", "!=") and value not in values:
                problems.append(f"{alert}: {name}{{{label}{op}{value!r}}} but the code emits {sorted(values)}")
            elif op in ("=~", "!~") and not any(re.fullmatch(value, v) for v in values):
                problems.append(f"{alert}: {label}{op}{value!r} matches none of {sorted(values)}")
    labels_known = set().union(*(series[n].keys() for n in names if n in series)) if names else set()
    for group in _BY.findall(expr):
        for label in (x.strip() for x in group.split(",") if x.strip()):
            if label not in labels_known:
                problems.append(f"{alert}: groups by {label!r}, which {names} do not carry")
    for label in re.findall(r"\$labels\.(\w+)", annotations):
        if names and label not in labels_known:  # a rule on Prometheus's own series (up) carries its labels
            problems.append(f"{alert}: annotation uses $labels.{label}, which {names} do not carry")
    return problems


def test_every_alert_rule_uses_emitted_names_and_label_values() -> None:
    series = emitted()
    # The run really exercised what the rules look at.
    assert series["weightbus_groups_total"]["action"] == {"kept", "recycled", "dropped"}
    assert series["weightbus_version_regressions_total"]["policy"] == {"p"}
    assert "weightbus_propagation_lag_seconds_bucket" in series
    assert series["weightbus_version_convergence_seconds_bucket"]["share"] == {"1", "0.9"}
    rules = rule_exprs()
    assert {r[0] for r in rules} >= {"WeightbusStaleGroupsHigh", "WeightbusVersionRegressed"}
    problems = [p for alert, expr, notes in rules for p in _check_expr(alert, expr, notes, series)]
    assert not problems, "\n".join(problems)


def test_the_checker_catches_the_old_keep_mistake() -> None:
    series = emitted()
    old = 'sum by (policy) (rate(weightbus_groups_total{action!="keep"}[10m]))'
    assert any("keep" in p for p in _check_expr("Old", old, "", series))


def test_dashboard_queries_only_emitted_series() -> None:
    series = emitted()
    text = (OPS / "grafana" / "weightbus-dashboard.json").read_text()
    names = set(re.findall(r"\bweightbus_[a-z_]+", text)) - {"weightbus"}
    assert names and names <= set(series), f"unknown series: {sorted(names - set(series))}"
    dashboard = json.loads(text)
    assert dashboard["uid"] == "weightbus" and len(dashboard["panels"]) >= 6


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_checks_and_tests_the_rules() -> None:
    # Every file in ops/prometheus/ is a rule file (the tests live in their own folder), so the glob an operator
    # types checks.
    rule_files = sorted(str(p) for p in (OPS / "prometheus").glob("*.yml") if p.name != "prometheus.yml")
    check = subprocess.run(["promtool", "check", "rules", *rule_files], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert RULES_TESTS
    tested = subprocess.run(["promtool", "test", "rules", *map(str, RULES_TESTS)], capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_rules_test() -> None:
    tests = "\n".join(p.read_text() for p in RULES_TESTS)
    untested = [alert for alert, _, _ in rule_exprs() if f"alertname: {alert}" not in tests]
    assert not untested, untested


def test_every_alert_has_a_runbook_row() -> None:
    runbook = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    missing = [alert for alert, _, _ in rule_exprs() if f"| `{alert}`" not in runbook]
    assert not missing, f"alerts without a row in docs/operations.md: {missing}"


def test_alerts_cover_a_deaf_tracker_and_rejected_events() -> None:
    exprs = {alert: expr for alert, expr, _ in rule_exprs()}
    assert "weightbus_tracker_ready == 0" in exprs.get("WeightbusTrackerDeaf", "")
    assert "weightbus_events_rejected_total" in exprs.get("WeightbusEventsRejected", "")
    panels = (OPS / "grafana" / "weightbus-dashboard.json").read_text()
    assert "weightbus_tracker_ready" in panels and "weightbus_events_rejected_total" in panels


def test_counters_that_alerts_watch_start_at_zero() -> None:
    """A counter born at 1 on its first event shows no increase(): the first one would never alert."""
    series = emitted()
    rejected = series["weightbus_events_rejected_total"]["reason"]
    assert rejected >= {"not_owner", "stale_claim", "unexplained_jump", "counter_reset"}
    registry = CollectorRegistry()
    BusMetrics(registry)
    for family in ("weights", "applied", "alerts", "drains"):
        assert (
            registry.get_sample_value("weightbus_invalid_events_total", {"family": family, "reason": "malformed"}) == 0
        )
    tracker_metrics = TrackerMetrics(registry).for_policy("fresh")
    assert registry.get_sample_value("weightbus_events_rejected_total", {"policy": "fresh", "reason": "not_owner"}) == 0
    del tracker_metrics


def test_watch_exports_no_readiness_so_the_deaf_alert_means_a_tracker() -> None:
    """``watch --metrics-port`` binds the tracker gauges without a tracker: a ready series there would read 0."""
    registry = CollectorRegistry()
    TrackerMetrics(registry).for_policy("p").set_state(5, 1, time.time())
    assert registry.get_sample_value("weightbus_tracker_ready", {"policy": "p"}) is None
    assert registry.get_sample_value("weightbus_current_version", {"policy": "p"}) == 5


def test_nats_configs_parse_with_the_real_server() -> None:
    env = {
        **os.environ,
        **{f"{r}_PASSWORD": "x" for r in ("MONITOR", "ADMIN")},
        **{f"{r}_POLICY_{p}_PASSWORD": "x" for r in ("TRAINER", "ROLLOUT") for p in "AB"},
        "WEIGHTBUS_NODE": "weightbus-a",
        "WEIGHTBUS_CLIENT_LISTEN": "127.0.0.1:-1",
        "WEIGHTBUS_HTTP_LISTEN": "127.0.0.1:-1",
        "WEIGHTBUS_CLUSTER_LISTEN": "127.0.0.1:-1",
        "WEIGHTBUS_STORE": "/tmp/weightbus-conf-check",
        **{f"WEIGHTBUS_ROUTE_{n}": f"nats-route://127.0.0.1:{6222 + i}" for i, n in enumerate("ABC")},
    }
    for conf in sorted((OPS / "nats").glob("*.conf")):
        out = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True, env=env)
        assert out.returncode == 0 and "is valid" in out.stdout + out.stderr, (conf, out.stderr)


def test_single_server_config_binds_loopback_with_jetstream() -> None:
    single = (OPS / "nats" / "single.conf").read_text()
    assert "jetstream" in single and "listen: $WEIGHTBUS_CLIENT_LISTEN" in single
    assert "WEIGHTBUS_CLIENT_LISTEN=127.0.0.1:" in single  # the documented start line binds loopback


def _start_config(conf: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """nats-server on ``conf`` exactly as an operator starts it (no -p/-a/-sd), and the client port it logged."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60  # generous: the machine is shared
    while "Server is ready" not in (text := log.read_text()) and proc.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    found = re.search(r"Listening for client connections on 127\.0\.0\.1:(\d+)", text)
    if found is None or "Server is ready" not in text or proc.poll() is not None:
        _stop(proc)
        pytest.fail(f"{conf.name} did not start: {text[-2000:]}")
    return proc, int(found.group(1))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _stream_works(url: str, options: ConnectOptions | None = None) -> None:
    bus = await connect(url, options=options)  # creates the stream on the config's JetStream store
    try:
        info = await bus.js.stream_info("WEIGHTBUS")
        assert info.config.name == "WEIGHTBUS"
    finally:
        await bus.aclose()


@pytest.mark.nats
@pytest.mark.parametrize("name", ["single.conf", "auth.conf"])
async def test_each_single_node_config_starts_on_the_given_port_and_store(name: str, tmp_path: Path) -> None:
    """The shipped file, started on a port nats-server picks and a temp store from the variables, serves JetStream
    there; nothing is bound to 4222 nor written to /var/lib/weightbus."""
    store = tmp_path / "store"
    env = {**ENV, "WEIGHTBUS_CLIENT_LISTEN": "127.0.0.1:-1", "WEIGHTBUS_HTTP_LISTEN": "127.0.0.1:-1"}
    env["WEIGHTBUS_STORE"] = str(store)
    proc, port = _start_config(OPS / "nats" / name, env, tmp_path / "nats.log")
    try:
        assert port != 4222
        options = ConnectOptions(user="admin", password=PASSWORDS["admin"]) if name == "auth.conf" else None
        await _stream_works(f"nats://127.0.0.1:{port}", options)
        assert (store / "jetstream").is_dir() and any((store / "jetstream").rglob("*WEIGHTBUS*"))
    finally:
        _stop(proc)


@pytest.mark.nats
async def test_the_cluster_config_starts_on_free_ports_and_temp_stores(tmp_path: Path) -> None:
    with EmbeddedCluster(tmp_path / "cluster", config=OPS / "nats" / "cluster.conf", startup_timeout=60) as running:
        assert ":4222" not in running.urls
        await _stream_works(running.urls.split(",")[0])
        assert any((tmp_path / "cluster").rglob("jetstream"))


@pytest.mark.parametrize("name", ["single.conf", "auth.conf"])
def test_an_unset_config_variable_stops_the_server_naming_it(name: str) -> None:
    env = {k: v for k, v in {**os.environ, **ENV}.items() if not k.startswith("WEIGHTBUS_")}
    env["WEIGHTBUS_CLIENT_LISTEN"] = "127.0.0.1:-1"
    env["WEIGHTBUS_HTTP_LISTEN"] = "127.0.0.1:-1"
    out = subprocess.run(
        [find_nats_server(), "-t", "-c", str(OPS / "nats" / name)], capture_output=True, text=True, env=env
    )
    assert out.returncode != 0 and "WEIGHTBUS_STORE" in out.stdout + out.stderr


def test_shipped_cluster_config_is_what_the_tests_start() -> None:
    shipped = [ln for ln in (OPS / "nats" / "cluster.conf").read_text().splitlines() if not ln.startswith("#")]
    assert "\n".join(shipped).strip() == CLUSTER_CONF.strip()


def test_dashboard_label_values_and_groupings_are_emitted() -> None:
    series = emitted()
    dashboard = json.loads((OPS / "grafana" / "weightbus-dashboard.json").read_text())
    problems = [
        p
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for p in _check_expr(panel["title"], target["expr"].replace("$policy", "p.*"), "", series)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_checks_the_shipped_scrape_config() -> None:
    out = subprocess.run(
        ["promtool", "check", "config", str(OPS / "prometheus" / "prometheus.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
