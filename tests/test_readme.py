"""The README's code runs as written (only the example URLs, or the ports its shell block reads, are this test's)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from weightbus.embedded.server import free_port
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block(containing: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    matches = [b for b in blocks if containing in b]
    assert len(matches) == 1, f"expected one README python block with {containing!r}"
    return matches[0]


@pytest.mark.nats
def test_the_sync_publisher_example_runs_as_written(nats_url: str) -> None:
    code = python_block("SyncVersionPublisher(")
    state = EngineState()
    with ServedEngine(create_app(state)) as engine:
        code = code.replace("nats://127.0.0.1:4222", nats_url).replace("http://w1:30000", engine.url)
        # A fresh policy id per run: the session's server keeps what earlier tests published.
        code = code.replace('"policy-a"', f'"readme-{id(code)}"')
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the point is to run the README
    assert out.getvalue().strip() == "published v1"
    assert state.weight_version == "1"


# --- links, metrics and figures: the README stays true on the package index page and to the code ---------------

ROOT = README.parent
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


def test_readme_links_into_the_repository_name_files_that_exist() -> None:
    """Links are relative to the repository (it has no published address yet), and each names a file and heading."""
    checked = 0
    for link in _LINK.findall(README.read_text()):
        if link.startswith(("https://", "http://", "mailto:")):
            continue
        path, _, fragment = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), f"{link}: no {path} in the repository"
        if fragment:
            assert fragment in _anchors(target), f"{link}: no heading #{fragment} in {path or 'README.md'}"
        checked += 1
    assert checked >= 5


def test_docs_relative_links_resolve() -> None:
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for link in _LINK.findall(doc.read_text()):
            if link.startswith(("https://", "http://", "mailto:")):
                continue
            path, _, fragment = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            assert target.exists(), f"{doc.name}: {link} does not resolve"
            if fragment and target.suffix == ".md":
                assert fragment in _anchors(target), f"{doc.name}: {link}: no such heading"


def _registered_metric_names() -> set[str]:
    """Every series name the library registers, as Prometheus exposes it (counters with ``_total``)."""
    from prometheus_client import CollectorRegistry

    from weightbus.bus import BusMetrics
    from weightbus.consumers import StalenessMetrics, TrackerMetrics
    from weightbus.consumers.admission import AdmissionMetrics

    registry = CollectorRegistry()
    BusMetrics(registry)
    AdmissionMetrics(registry)
    TrackerMetrics(registry)
    StalenessMetrics(registry)
    return {family.name + ("_total" if family.type == "counter" else "") for family in registry.collect()} | {
        "weightbus_group_staleness"
    }


def test_every_metric_family_is_defined_where_the_names_above_come_from() -> None:
    defining = {
        p.relative_to(ROOT / "src").as_posix()
        for p in (ROOT / "src" / "weightbus").rglob("*.py")
        if re.search(r"\b(Counter|Gauge|Histogram|Summary|\w*MetricFamily)\(", p.read_text())
    }
    assert defining == {
        "weightbus/bus/metrics.py",
        "weightbus/consumers/tracker/metrics.py",
        "weightbus/consumers/drain/metrics.py",
        "weightbus/consumers/admission/metrics.py",
    }, "a new metrics module: add it to _registered_metric_names"


def test_readme_metrics_table_lists_every_registered_metric() -> None:
    text = README.read_text()
    table = text[text.index("### Metrics") :]
    table = table[: table.index("\n\n", table.index("| metric |"))]
    listed = set(re.findall(r"`(weightbus_[a-z_]+)", table))
    missing = _registered_metric_names() - listed
    assert not missing, f"metrics the code registers but the README's table omits: {sorted(missing)}"
    assert listed <= _registered_metric_names(), (
        f"listed but never registered: {sorted(listed - _registered_metric_names())}"
    )


def test_readme_headline_figures_come_from_the_committed_results() -> None:
    import json

    text = " ".join(README.read_text().split())
    results = ROOT / "bench" / "results"
    ratios = json.loads((results / "propagation.json").read_text())["ratios"]
    js = [f"{ratios[m]['weightbus_over_jetstream_p50']:.2f}×" for m in ("1", "8", "64")]
    assert (
        f"{js[0]} raw JetStream's p50 latency with one subscriber process, {js[1]} with 8 and {js[2]} with 64" in text
    )
    redis = sorted(f"{ratios[m]['weightbus_over_redis_p50']:.2f}" for m in ("1", "8", "64"))
    assert f"{redis[0]}–{redis[-1]}× Redis Streams' p50" in text
    poll = [f"{ratios[m]['poll_over_weightbus_p50']:.0f}×" for m in ("1", "8", "64")]
    assert f"{poll[0]} slower at p50 with one subscriber and {poll[1]} with 8" in text
    assert f"only {poll[2]} with 64" in text
    drain = json.loads((results / "drain.json").read_text())
    assert f"{drain['ratio']:.0f}× the throughput" in text
    assert f"{drain['stage']['groups_per_s']:,.0f} groups" in text
    overhead = json.loads((results / "demo-overhead.json").read_text())["summary"]
    assert f"{overhead['weightbus_share'] * 100:.2f} % of the step ({overhead['step_ms_mean']:.0f} ms steps" in text
    tradeoff = json.loads((results / "staleness-tradeoff.json").read_text())
    default = tradeoff["1"]
    assert f"{default['reward_first']:.2f} → {default['reward_last']:.2f}" in text
    assert f"trained in {default['wall_s']:.0f} s" in text
    assert f"threw away {tradeoff['0']['tokens_wasted_share'] * 100:.0f} %" in text
    admission = json.loads((results / "admission-tradeoff.json").read_text())["versus_off"]
    zero, one = admission["0"], admission["1"]
    assert f"untrained at bound 0 (against {zero['off']['tokens_not_trained_share'] * 100:.0f} %" in text
    assert f"{zero['bounded']['tokens_not_trained_share'] * 100:.1f} % of the generated tokens untrained" in text
    assert f"{one['bounded']['tokens_not_trained_share'] * 100:.1f} % at bound 1" in text
    rates = {f"{row['bounded']['rate_vs_off'] * 100:.0f}" for row in (zero, one)}
    assert rates == {"98"} and "generated 98 % as many tokens per second at both bounds" in text
    assert f"({zero['bounded']['trained_rate_vs_off'] * 100:.0f} % per trained token" in text
    for row, bound in ((one, 1), (zero, 0)):
        vs = row["bounded"]
        assert f"{vs['reward_vs_off']:+.3f} ± {vs['reward_vs_off_se']:.3f} at bound {bound}".replace("-", "−") in text
    pooled = json.loads((results / "admission-repeats" / "pooled.json").read_text())["pooled"]
    for bound in ("0", "1"):
        vs = pooled[bound]["bounded"]
        figure = f"{vs['reward_vs_off']:+.3f} ± {vs['reward_vs_off_se']:.3f} at bound {bound}".replace("-", "−")
        assert figure in text and vs["pairs"] == 9


def test_the_group_example_runs_as_written() -> None:
    code = python_block("stage.decide(")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the point is to run the README
    assert out.getvalue().strip() == "recycled stale 2"


def test_the_rollout_example_counts_invalid_events() -> None:
    """Without BusMetrics on connect, ``weightbus_invalid_events_total`` is never exported."""
    code = python_block("VersionTracker(bus")
    assert "connect(" in code and "metrics=BusMetrics(registry)" in code


def test_readme_states_the_install_truth() -> None:
    import tomllib

    text = " ".join(README.read_text().split())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = next(d for d in project["optional-dependencies"]["engine"] if d.startswith("torch"))
    nats = next(d for d in project["dependencies"] if d.startswith("nats-py"))
    assert f"(`{torch.removeprefix('torch')}`)" in text, torch
    assert f"nats-py (`{nats.removeprefix('nats-py')}`)" in text, nats
    assert "nothing can resolve a CUDA build" not in text
    assert "torch.version.cuda" in text


def test_readme_retained_events_match_the_code() -> None:
    from weightbus.bus.stream import DEFAULT_HISTORY

    text = " ".join(README.read_text().split())
    assert f"{DEFAULT_HISTORY} events per subject" in text
    assert re.findall(r"(\d+) (?:retained )?events per subject", text) == [str(DEFAULT_HISTORY)]


async def test_a_publisher_without_a_fleet_announces_no_engines_as_the_readme_says() -> None:
    from weightbus.bus import MemoryBus, subjects
    from weightbus.producers import VersionPublisher
    from weightbus.schemas import WeightUpdated

    text = " ".join(README.read_text().split())
    assert '`VersionPublisher(bus, "policy-a")` with no `fleet` works' in text
    assert "`WeightUpdated.engines` is empty" in text and "unless `--no-engines`" in text
    bus = MemoryBus()
    pub = await VersionPublisher(bus, "policy-a").start()
    async with pub.update() as version:
        pass
    last = await bus.last(subjects.weights("policy-a"))
    assert isinstance(last.event, WeightUpdated) and last.event.version == version
    assert tuple(last.event.engines) == ()
    with pytest.raises(ValueError):
        VersionPublisher(bus, "policy-a", pause="retract")
    await bus.close()


def bash_block(marker: str) -> str:
    """The ```bash block right after ``<!-- readme-test: MARKER -->``."""
    found = re.findall(rf"<!-- readme-test: {re.escape(marker)} -->\n```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert len(found) == 1, f"expected one README bash block marked {marker!r}"
    return found[0]


def test_the_processes_block_names_its_nats_and_binds_loopback() -> None:
    block = bash_block("processes")
    assert "4222" not in block
    lines = block.splitlines()
    exported = next(n for n, line in enumerate(lines) if line.startswith("export WEIGHTBUS_NATS="))
    for n, line in enumerate(lines):
        if line.startswith("weightbus ") and not line.startswith("weightbus server"):
            assert n > exported or "--nats" in line, line
    router = block[block.index("sglang_router") :].split("&", 1)[0]
    # The demo's router flags (weightbus.process.demo): loopback only, quiet, its metrics port loopback too.
    for needle in (
        "--host 127.0.0.1",
        "--log-level warn",
        "--health-check-interval-secs 1",
        "--prometheus-host 127.0.0.1",
    ):
        assert needle in router


@pytest.mark.slow
@pytest.mark.nats
@pytest.mark.torch
def test_the_processes_block_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sglang_router")
    ports = {name: free_port() for name in ("E1", "E2", "ROUTER", "ROUTER_METRICS", "ROLLOUT_METRICS")}
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        **{name: str(port) for name, port in ports.items()},
        "RUN": str(tmp_path),
        "STEPS": "2",
        "VIRTUAL_ENV": sys.prefix,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        # Whatever the caller's shell points at must not matter: the block exports its own.
        "WEIGHTBUS_NATS": "nats://127.0.0.1:1",
        "NATS_URL": "nats://127.0.0.1:1",
    }
    proc = subprocess.Popen(
        ["bash", "-e", "-c", bash_block("processes")],
        cwd=README.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left behind
    assert proc.returncode == 0, out
    assert re.search(r"^trained 2 steps; last version v\d+$", out, flags=re.M), out
    steps = [json.loads(line) for line in (tmp_path / "train" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    # The router was told --log-level warn: the whole run prints a screenful, not its INFO stream.
    assert len(out.splitlines()) < 100, out
