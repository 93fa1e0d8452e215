"""The documentation is true: every fenced block of README.md and docs/**/*.md runs or parses as written.

One test per block. ``python`` blocks run in a subprocess from the repository root against a nats-server of their
own (``WEIGHTBUS_NATS``) and a CPU reference engine (``ENGINES``); ``bash`` blocks run with ``bash -e`` the same way;
``json``/``toml``/``yaml`` blocks are parsed; ``text`` blocks are diagrams. A block that cannot run here says so in
its info string (```` ```bash no-run=REASON ````) with a reason from ``NO_RUN``: nothing is skipped silently.
The rest of the file checks that links resolve and that the facts the docs quote match the code and the results.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import weightbus
from weightbus.embedded.server import EmbeddedNats, free_port
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

# The only reasons a block may give for not running here. Keep this short: each one is a kind of block that
# needs something a test cannot have.
NO_RUN = {
    "miles": "needs a miles training job (Ray, Megatron, GPUs)",
    "slime": "needs a slime training job (Ray, Megatron, GPUs)",
    "recursive": "`make demo` / `make test`: the suite itself",
    "deployment": "a production server or cluster: fixed ports, named hosts, /var/lib",
}
# Every block that does not run, by page and reason: adding one is a deliberate change to this table.
NO_RUN_BLOCKS = {
    ("README.md", "recursive"): 1,
    ("README.md", "miles"): 1,
    ("docs/integrations/miles.md", "miles"): 1,
    ("docs/integrations/slime.md", "slime"): 2,  # the trainer half's launch, the rollout half's
    ("docs/operations.md", "deployment"): 2,
}
KINDS = {"python", "bash", "json", "toml", "yaml", "text"}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    kind: str
    options: tuple[str, ...]
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def no_run(self) -> str | None:
        found = [o.removeprefix("no-run=") for o in self.options if o.startswith("no-run")]
        return found[0] if found else None

    @property
    def slow(self) -> bool:
        return "slow" in self.options


_FENCE = re.compile(r"^( {0,8})(`{3,}(?=[^`]*$)|~{3,})(.*)$")  # a backtick fence's info string has no backtick


def fenced_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """Every fenced code block of a Markdown page, with its info string and its body, dedented."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    n = 0
    while n < len(lines):
        match = _FENCE.match(lines[n])
        if not match:
            n += 1
            continue
        indent, fence, info = len(match[1]), match[2], match[3].strip()
        start, body = n, []
        n += 1
        while n < len(lines) and lines[n].strip() != fence:
            body.append(lines[n][indent:] if lines[n][:indent].strip() == "" else lines[n])
            n += 1
        assert n < len(lines), f"{path.name}:{start + 1}: unclosed code fence"
        words = info.split()
        kind = words[0] if words else ""
        blocks.append(
            Block(path.relative_to(root).as_posix(), start + 1, kind, tuple(words[1:]), "\n".join(body) + "\n")
        )
        n += 1
    return blocks


BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]


def _param(block: Block) -> object:
    marks: list[pytest.MarkDecorator] = []
    if block.kind in {"python", "bash"} and not block.no_run:
        marks.append(pytest.mark.nats)
    if block.slow:
        marks += [pytest.mark.slow, pytest.mark.torch]
    return pytest.param(block, id=block.id, marks=marks)


def test_every_block_has_a_kind_the_docs_test_knows() -> None:
    bad = [f"{b.id} ```{b.kind}" for b in BLOCKS if b.kind not in KINDS]
    assert not bad, f"give each block one of {sorted(KINDS)} (diagrams: text): {bad}"
    assert len(BLOCKS) >= 20


def test_blocks_that_do_not_run_are_the_listed_ones() -> None:
    counts: dict[tuple[str, str], int] = {}
    for block in BLOCKS:
        if block.no_run is not None:
            assert block.no_run in NO_RUN, f"{block.id}: no-run={block.no_run!r} is not one of {sorted(NO_RUN)}"
            assert block.kind == "bash", f"{block.id}: only shell blocks may be exempt"
            counts[block.page, block.no_run] = counts.get((block.page, block.no_run), 0) + 1
    assert counts == NO_RUN_BLOCKS


@contextlib.contextmanager
def _bus_and_engine() -> Iterator[dict[str, str]]:
    """A nats-server and a reference engine of the block's own: what one block does cannot reach another."""
    server = EmbeddedNats()
    server.start()
    try:
        with ServedEngine(create_app(EngineState())) as engine:
            yield {"WEIGHTBUS_NATS": server.url, "ENGINES": engine.url, "ENGINE": engine.url}
    finally:
        server.stop()


def _environment(tmp_path: Path, block: Block, services: dict[str, str]) -> dict[str, str]:
    src = str(Path(weightbus.__file__).resolve().parents[1])
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        **services,
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": sys.prefix,
        "RUN": str(tmp_path),
        "NATS_URL": services["WEIGHTBUS_NATS"],
    }
    env["WEIGHTBUS_POLICY"] = "policy-a"  # as the miles recipe exports it to every worker
    if block.slow:
        env.update({name: str(free_port()) for name in ("E1", "E2", "ROUTER", "ROUTER_METRICS", "ROLLOUT_METRICS")})
        env["STEPS"] = "2"
    if "export WEIGHTBUS_NATS=" in block.code:
        # A block that starts its own NATS must not lean on the caller's: point the inherited variables nowhere.
        env["WEIGHTBUS_NATS"] = env["NATS_URL"] = "nats://127.0.0.1:1"
    return env


# What a block must print, for blocks whose output says they did their job: (page, text in the block, regex).
EXPECTED_OUTPUT = [
    ("README.md", "VersionPublisher(bus", r"^published v1$"),
    ("README.md", "VersionTracker(bus", r"^never_published 1 \{\}$"),
    ("docs/trainer.md", "SyncVersionPublisher(", r"^published v1$"),
    ("docs/trainer.md", "with the adapter", r"^published v1, then v2 with the adapter$"),
    ("docs/trainer.md", "push_lora_adapter(fleet", r"^v2 serves math from /adapters/math-step2$"),
    ("docs/trainer.md", "weightbus status", r'"version": 2'),
    ("docs/rollout.md", "DrainReporter(bus", r"^3 2 \{'stale': 1\} 1$"),
    ("docs/rollout.md", "stage.decide(", r"^recycled stale 2$"),
    ("docs/rollout.md", "admission.slot()", r"^4 groups kept at 1$"),
    ("docs/trace-format.md", "read_trace(", r"^WeightUpdated 1$"),
    ("docs/cli.md", "weightbus replay", r"^replayed: v4 \(advanced"),
    ("docs/demo.md", "weightbus trainer", r"^trained 2 steps; last version v\d+$"),
]


def test_each_expected_output_names_one_block() -> None:
    for page, needle, _ in EXPECTED_OUTPUT:
        found = [b for b in BLOCKS if b.page == page and needle in b.code]
        assert len(found) == 1, f"{page}: {len(found)} blocks contain {needle!r}"


def _expected(block: Block) -> list[str]:
    return [regex for page, needle, regex in EXPECTED_OUTPUT if page == block.page and needle in block.code]


def _run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left behind
    return subprocess.CompletedProcess(command, proc.returncode, out, None)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.kind in {"python", "bash"}])
def test_the_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.no_run is not None:
        assert block.no_run in NO_RUN  # listed and counted above; nothing here can run it
        return
    if block.slow:
        pytest.importorskip("torch")
        pytest.importorskip("sglang_router")
    with _bus_and_engine() as services:
        env = _environment(tmp_path, block, services)
        if block.kind == "python":
            script = tmp_path / "block.py"
            script.write_text(block.code)
            result = _run([sys.executable, str(script)], env, timeout=120)
        else:
            result = _run(["bash", "-e", "-c", block.code], env, timeout=300 if block.slow else 120)
    assert result.returncode == 0, f"{block.id} exited {result.returncode}:\n{result.stdout}"
    for regex in _expected(block):
        assert re.search(regex, result.stdout, flags=re.M), (
            f"{block.id}: no line matching {regex!r} in:\n{result.stdout}"
        )


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.kind in {"json", "toml", "yaml"}])
def test_the_block_parses(block: Block) -> None:
    if block.kind == "json":
        json.loads(block.code)
    elif block.kind == "toml":
        tomllib.loads(block.code)
    else:
        yaml = pytest.importorskip("yaml", reason="a yaml block needs PyYAML to be checked")
        yaml.safe_load(block.code)


def test_a_broken_block_fails(tmp_path: Path) -> None:
    """The runner reports failure: a block that raises, or a shell line that fails, is not passed."""
    env = {**os.environ, "PYTHONPATH": str(Path(weightbus.__file__).resolve().parents[1])}
    script = tmp_path / "broken.py"
    script.write_text("import weightbus\nraise SystemExit(weightbus.no_such_name)\n")
    assert _run([sys.executable, str(script)], env, timeout=60).returncode != 0
    assert _run(["bash", "-e", "-c", "false\necho unreachable"], env, timeout=60).returncode != 0
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nprint(1)\n```\n\n  ```bash no-run=miles\n  make\n  ```\n")
    one, two = fenced_blocks(page, root=tmp_path)
    assert (one.kind, one.code, one.line) == ("python", "print(1)\n", 3)
    assert (two.kind, two.no_run, two.code) == ("bash", "miles", "make\n")


# --- the demo's processes block: it names its NATS and binds loopback -----------------------------------------


def _one_block(page: str, needle: str) -> Block:
    found = [b for b in BLOCKS if b.page == page and needle in b.code]
    assert len(found) == 1, f"expected one block of {page} with {needle!r}"
    return found[0]


def test_the_processes_block_names_its_nats_and_binds_loopback() -> None:
    block = _one_block("docs/demo.md", "weightbus trainer").code
    assert "4222" not in block
    lines = block.splitlines()
    exported = next(n for n, line in enumerate(lines) if line.startswith("export WEIGHTBUS_NATS="))
    for n, line in enumerate(lines):
        command = line.removeprefix("start ")  # the block's own function: run in the background under its trap
        if command.startswith("weightbus ") and not command.startswith("weightbus server"):
            assert n > exported or "--nats" in line, line
    router = block[block.index("sglang_router") :].split("\nup ", 1)[0]
    # The demo's router flags (weightbus.process.demo): loopback only, quiet, its metrics port loopback too.
    for needle in (
        "--host 127.0.0.1",
        "--log-level warn",
        "--health-check-interval-secs 1",
        "--prometheus-host 127.0.0.1",
    ):
        assert needle in router


def test_no_block_uses_the_machines_own_nats() -> None:
    for block in BLOCKS:
        if block.kind == "python":
            for line in block.code.splitlines():
                if "4222" in line:
                    assert "os.environ.get(" in line, f"{block.id}: {line!r} (read the URL from WEIGHTBUS_NATS)"


# --- links: relative to the repository, each names a file and a heading ---------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    for link in _LINK.findall(page.read_text()):
        if link.startswith(("https://", "http://", "mailto:")):
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} does not resolve"
        if fragment and target.suffix == ".md":
            assert fragment in _anchors(target), f"{page.name}: {link}: no such heading"


def test_docs_pages_named_by_the_code_exist() -> None:
    """Module docstrings and comments point into docs/ (``docs/design.md#the-update-protocol-step-by-step``)."""
    named = 0
    for folder in ("src", "tests", "ops", "examples", "bench"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or path.suffix not in {".py", ".yml", ".yaml", ".conf", ".md", ".sh"}:
                continue
            for page, fragment in re.findall(r"\b(docs/[\w/.-]+\.md)(?:#([\w-]+))?", path.read_text()):
                target = ROOT / page
                assert target.exists(), f"{path.relative_to(ROOT)} names {page}, which does not exist"
                if fragment:
                    assert fragment in _anchors(target), f"{path.relative_to(ROOT)}: no heading #{fragment} in {page}"
                named += 1
    assert named > 0


def test_the_readme_indexes_every_docs_page() -> None:
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in _LINK.findall(README.read_text())}
    missing = [p.relative_to(ROOT).as_posix() for p in sorted(DOCS.rglob("*.md")) if p.resolve() not in linked]
    assert not missing, f"pages the README's index omits: {missing}"


# --- facts: one home each, and that home matches the code -------------------------------------------------------


def _text(page: str) -> str:
    return " ".join((ROOT / page).read_text().split())


def test_the_subjects_table_lists_every_family_the_code_has() -> None:
    from weightbus.bus.subjects import FAMILY_NAMES

    text = (DOCS / "events.md").read_text()
    table = text[text.index("| subject |") :].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `weightbus\.<policy>\.([a-z]+)`", table, flags=re.M)
    assert sorted(listed) == sorted(FAMILY_NAMES)
    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}
    assert f"Every policy owns {words[len(FAMILY_NAMES)]} subjects" in _text("docs/events.md")
    for page in PAGES:
        counted = re.findall(r"\b(four|five|six|seven) subjects\b", " ".join(page.read_text().split()))
        assert set(counted) <= {words[len(FAMILY_NAMES)]}, f"{page.name} counts the subjects as {counted}"


def test_the_retained_events_are_told_once_and_match_the_code() -> None:
    from weightbus.bus.stream import DEFAULT_HISTORY

    assert f"{DEFAULT_HISTORY} events per subject" in _text("docs/events.md")
    told = [p.name for p in PAGES for _ in re.findall(r"\d+ events per subject", " ".join(p.read_text().split()))]
    assert told == ["events.md"], f"the stream's retention is told in {told}: one home, docs/events.md"


def test_the_update_order_has_one_home() -> None:
    """The step-by-step protocol is docs/design.md's; the guides and the map link to it."""
    assert "## The update protocol, step by step" in (DOCS / "design.md").read_text()
    for page in ("README.md", "docs/trainer.md", "docs/architecture.md"):
        text = _text(page)
        assert "**Announce** `WeightUpdated" not in text and "0. A counter that has issued" not in text, page
    for page in ("docs/trainer.md", "docs/architecture.md"):
        assert "design.md#the-update-protocol-step-by-step" in (ROOT / page).read_text(), page


def test_the_module_map_names_modules_that_exist() -> None:
    src = ROOT / "src" / "weightbus"
    text = (DOCS / "architecture.md").read_text()
    section = text[text.index("## The package map") : text.index("## Who may import whom")]
    rows = re.findall(r"^\| `([a-z_]+)/?` \| (.*) \|$", section, flags=re.M)
    assert len(rows) >= 10
    packages = {p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in src.glob("*.py") if p.stem != "__init__"} - {"__main__", "py"}
    mapped = packages | (modules & {"errors", "backoff"})
    assert {name for name, _ in rows} == mapped, "the map lists every top-level package"
    for name, role in rows:
        base = src / name
        known = {p.stem for p in base.rglob("*.py")} | {p.name for p in base.rglob("*") if p.is_dir()}
        for token in re.findall(r"`([a-z_]+)/?`", role):
            assert token in known, f"architecture.md: `{token}` is no module or package under {name}/"
    for path in re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", text):
        assert (src / path).exists() or (ROOT / path).exists(), f"architecture.md names {path}, which does not exist"


_PACKAGES = "errors|schemas|rules|bus|engines|embedded|producers|consumers|integrations|cli|demo|process|rl|refengine"


def _resolves(dotted: str) -> bool:
    """Whether ``weightbus.a.b.c`` names a module, or an attribute reachable from one."""
    import importlib

    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:n]))
            break
        except ImportError:
            continue
    else:
        return False
    for attr in parts[n:]:
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        try:
            obj = importlib.import_module(f"{getattr(obj, '__name__', '')}.{attr}")
        except ImportError:
            return False
    return True


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_dotted_names_the_docs_give_exist(page: Path) -> None:
    """`weightbus.rules.chain.decide`, `producers.coverage`: every module path or attribute quoted is real."""
    if page.name == "upgrading.md":
        return  # it names the old paths on purpose, beside the new ones
    pattern = rf"`((?:weightbus\.)?(?:{_PACKAGES})(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`"
    missing = [
        name
        for name in sorted(set(re.findall(pattern, page.read_text())))
        if not name.endswith(".py") and not _resolves(name if name.startswith("weightbus.") else f"weightbus.{name}")
    ]
    assert not missing, f"{page.name} names what the code does not have: {missing}"


def _registered_metric_names() -> set[str]:
    """Every series name the library registers, as Prometheus exposes it (counters with ``_total``)."""
    from prometheus_client import CollectorRegistry

    from weightbus.bus import BusMetrics
    from weightbus.consumers import StalenessMetrics, TrackerMetrics
    from weightbus.consumers.admission import AdmissionMetrics
    from weightbus.consumers.replicas import ConvergenceMetrics, RequestMetrics
    from weightbus.producers import CatchupMetrics, PublisherMetrics

    registry = CollectorRegistry()
    BusMetrics(registry)
    PublisherMetrics(registry)
    CatchupMetrics(registry)
    AdmissionMetrics(registry)
    TrackerMetrics(registry)
    StalenessMetrics(registry)
    ConvergenceMetrics(registry)
    RequestMetrics(registry)
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
        "weightbus/consumers/replicas/metrics.py",
        "weightbus/producers/metrics.py",
    }, "a new metrics module: add it to _registered_metric_names"


def test_the_metrics_table_lists_every_registered_metric() -> None:
    text = (DOCS / "operations.md").read_text()
    table = text[text.index("## Metrics") :]
    table = table[: table.index("\n\n", table.index("| metric |"))]
    listed = set(re.findall(r"`(weightbus_[a-z_]+)", table))
    missing = _registered_metric_names() - listed
    assert not missing, f"metrics the code registers but docs/operations.md's table omits: {sorted(missing)}"
    assert listed <= _registered_metric_names(), (
        f"listed but never registered: {sorted(listed - _registered_metric_names())}"
    )


def test_the_metrics_table_names_every_rejection_reason() -> None:
    from typing import get_args

    from weightbus.schemas.alerts import RejectReason

    row = next(
        line for line in (DOCS / "operations.md").read_text().splitlines() if "weightbus_events_rejected" in line
    )
    assert set(re.findall(r"`([a-z_]+)`", row.split("|")[3])) == set(get_args(RejectReason))


def test_headline_figures_come_from_the_committed_results() -> None:
    text = _text("README.md")
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


def test_the_demo_figures_come_from_the_committed_results() -> None:
    text = _text("docs/demo.md")
    results = ROOT / "bench" / "results"
    tradeoff = json.loads((results / "staleness-tradeoff.json").read_text())
    default = tradeoff["1"]
    assert f"{default['reward_first']:.2f} → {default['reward_last']:.2f}" in text
    assert f"trained in {default['wall_s']:.0f} s" in text
    assert f"threw away {tradeoff['0']['tokens_not_trained_share'] * 100:.0f} %" in text
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
    for key in ("0", "1"):
        vs = pooled[key]["bounded"]
        figure = f"{vs['reward_vs_off']:+.3f} ± {vs['reward_vs_off_se']:.3f} at bound {key}".replace("-", "−")
        assert figure in text and vs["pairs"] == 9


def test_the_install_truth() -> None:
    readme, development = _text("README.md"), _text("docs/development.md")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = next(d for d in project["optional-dependencies"]["engine"] if d.startswith("torch"))
    nats = next(d for d in project["dependencies"] if d.startswith("nats-py"))
    assert f"(`{torch.removeprefix('torch')}`)" in readme, torch
    assert f"nats-py (`{nats.removeprefix('nats-py')}`)" in readme, nats
    assert "nothing can resolve a CUDA build" not in development
    assert "torch.version.cuda" in development


async def test_a_publisher_without_a_fleet_announces_no_engines_as_the_trainer_guide_says() -> None:
    from weightbus.bus import MemoryBus, subjects
    from weightbus.producers import VersionPublisher
    from weightbus.schemas import WeightUpdated

    text = _text("docs/trainer.md")
    assert '`VersionPublisher(bus, "policy-a")` with no `fleet` works' in text
    assert "`WeightUpdated.engines` is empty" in text and "unless `--no-engines`" in text
    bus = MemoryBus()
    pub = await VersionPublisher(bus, "policy-a").start()
    async with pub.update() as version:
        pass
    last = await bus.last(subjects.weights("policy-a"))
    assert last is not None and isinstance(last.event, WeightUpdated) and last.event.version == version
    assert tuple(last.event.engines) == ()
    with pytest.raises(ValueError):
        VersionPublisher(bus, "policy-a", pause="retract")
    await bus.aclose()


def test_the_rollout_example_counts_invalid_events() -> None:
    """Without BusMetrics on connect, ``weightbus_invalid_events_total`` is never exported."""
    code = _one_block("docs/rollout.md", "DrainReporter(bus").code
    assert "connect(" in code and "metrics=BusMetrics(registry)" in code


def test_every_contract_clause_names_a_test_that_exists() -> None:
    """docs/contract.md's rows and tests/test_contract.py name each other: a clause without a test, a test named by no
    clause, or a renamed test fails here, so the page and the tests cannot drift apart."""
    import ast

    tree = ast.parse((ROOT / "tests" / "test_contract.py").read_text())
    tests = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }
    rows = [
        line
        for line in (DOCS / "contract.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith(("| clause |", "| concept |"))
    ]
    assert len(rows) >= 30, "the clause tables are missing"
    named: set[str] = set()
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 5, f"contract.md: a clause row has 5 cells: {row[:80]}"
        found = re.findall(r"`(test_[a-z0-9_]+)`", cells[-1])
        assert found and "".join(f"`{name}`" for name in found) == cells[-1].replace(", ", ""), (
            f"contract.md: the last cell names the clause's tests, and only them: {cells[0]}"
        )
        missing = set(found) - tests
        assert not missing, f"contract.md: {cells[0]!r} names tests that tests/test_contract.py lacks: {missing}"
        named |= set(found)
    assert tests - named == set(), f"tests/test_contract.py tests no clause row names: {sorted(tests - named)}"
