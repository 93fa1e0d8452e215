"""The README's code runs as written (only the example URLs are pointed at this test's servers)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

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
