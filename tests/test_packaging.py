"""Packaging: the sdist is complete (a clean machine can run the suite from it), the metadata is what an index
page needs, dependencies are ranges a GPU user can install beside SGLang, the nats-py internals weightbus touches
are there, ``make venv`` asks for CPU torch, and the import contracts hold (and bite)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_sdist_carries_the_suite_the_license_and_the_metadata(tmp_path: Path) -> None:
    from setuptools import build_meta

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        name = build_meta.build_sdist(str(tmp_path))
    finally:
        os.chdir(cwd)
    with tarfile.open(tmp_path / name) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
        pkg_info = sdist.extractfile(f"{name.removesuffix('.tar.gz')}/PKG-INFO").read().decode()  # type: ignore[union-attr]
    for path in (
        "LICENSE",
        "Makefile",
        "tests/conftest.py",
        "tests/fixtures/trace.jsonl",
        "tests/producers/conftest.py",
        "ops/prometheus/weightbus-rules.yml",
        "ops/prometheus/tests/weightbus-rules.test.yml",
        "docs/architecture.md",
        "docs/cli.md",
        "docs/benchmarks.md",
    ):
        assert path in members, path
    assert "src/weightbus/integrations/miles/__init__.py" in members and "src/weightbus/__main__.py" in members
    assert "License-Expression: Apache-2.0" in pkg_info and "License-File: LICENSE" in pkg_info
    assert "Classifier: Typing :: Typed" in pkg_info
    assert "Keywords: " in pkg_info
    assert not any("__pycache__" in m for m in members)


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list[str]:
    return PROJECT["dependencies"] + [r for reqs in PROJECT["optional-dependencies"].values() for r in reqs]


def test_metadata_has_classifiers_and_keywords() -> None:
    # No [project.urls] until the repository has a published address: a made-up one would mislead.
    assert "urls" not in PROJECT
    assert len(PROJECT["keywords"]) >= 5
    classifiers = PROJECT["classifiers"]
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3.11" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers), "the license is the SPDX expression"


def test_nats_py_is_a_range_with_a_lower_bound() -> None:
    for req in (r for r in _requirements() if r.startswith("nats-py")):
        assert "==" not in req, req
        assert re.search(r">=2\.\d+(\.\d+)?,<3$", req), req


def test_torch_is_never_pinned_exactly_in_an_extra() -> None:
    """A GPU user installs the extras beside SGLang, which brings its own torch."""
    torch = [r for r in _requirements() if re.match(r"torch\b", r)]
    assert torch and not any("==" in r for r in torch), torch


def test_the_dev_extra_brings_the_import_linter() -> None:
    assert any(r.startswith("import-linter") for r in PROJECT["optional-dependencies"]["dev"])


def test_make_venv_asks_for_cpu_torch_and_checks_what_it_got() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "download.pytorch.org/whl/cpu" in makefile and '--index-url "$(TORCH_INDEX)"' in makefile
    assert "torch.version.cuda is None" in makefile
    venv = makefile[makefile.index("$(STAMP): pyproject.toml") :]
    assert venv.index("--index-url") < venv.index("-e '.[dev,engine,rl]'") < venv.index("TORCH_CHECK")


def test_the_nats_py_internals_weightbus_touches_are_there() -> None:
    """weightbus.bus reaches into nats-py for what its API does not offer (dropping the reconnect buffer on close,
    reading a push subscription's queue directly). A nats-py release that renames them fails here."""
    import inspect

    import nats
    from nats.aio.client import Client
    from nats.aio.subscription import Subscription
    from nats.js.client import JetStreamContext

    client = Client()
    for attr in ("_pending", "_pending_data_size", "_status"):
        assert hasattr(client, attr), f"nats-py {nats.__version__}: Client.{attr} is gone"
    assert isinstance(Client.CONNECTED, int)
    init = inspect.getsource(Subscription.__init__)
    assert "self._pending_queue" in init and "self._pending_size" in init, f"nats-py {nats.__version__}"
    assert "self._sub" in inspect.getsource(JetStreamContext.PushSubscription.__init__)


def _lint_imports(cwd: Path, src: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[dev]'")
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([exe, "--no-cache", "--no-logo"], cwd=cwd, env=env, capture_output=True, text=True)


def test_the_import_contracts_hold() -> None:
    out = _lint_imports(ROOT, ROOT / "src")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("producers/status.py", "from weightbus.consumers.tracker import VersionTracker", "layers"),
        (
            "consumers/drain/stage.py",
            "from weightbus.consumers.tracker import tracker",
            "the tracker, the drain and admission",
        ),
        (
            "consumers/admission/gate.py",
            "from weightbus.consumers.drain import window",
            "the tracker, the drain and admission",
        ),
        ("rules/chain.py", "from weightbus.bus import subjects", "layers"),
        ("bus/trace.py", "from weightbus.process import eventloop", "layers"),
        ("producers/sync.py", "import nats", "nats-py"),
        ("consumers/monitor.py", "def _f():\n    import torch", "no torch"),
    ],
)
def test_the_import_contracts_catch_a_violation(tmp_path: Path, module: str, line: str, contract: str) -> None:
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "weightbus" / module
    target.write_text(target.read_text() + "\n" + line + "\n")
    out = _lint_imports(tmp_path, tmp_path / "src")
    assert out.returncode == 1, out.stdout + out.stderr
    report = " ".join(out.stdout.split())  # the report wraps long contract names
    broken = report[report.index("Broken contracts") :]
    assert contract in broken and "0 broken" not in report, out.stdout
