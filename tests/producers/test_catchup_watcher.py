"""``FleetCatchup``: engines that fall behind are caught up; a bad artifact is tried once per version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from weightbus.bus import subjects
from weightbus.bus.nats import NatsBus
from weightbus.errors import ArtifactDigestError
from weightbus.producers import EngineFleet, FleetCatchup, VersionPublisher
from weightbus.refengine.reference import EngineState, create_app
from weightbus.refengine.serve import ServedEngine
from weightbus.schemas import FleetQuarantined

from .conftest import announce_full, history, loads, truthful, write_safetensors

pytestmark = pytest.mark.nats


@pytest.fixture
def two() -> Iterator[list[tuple[EngineState, str]]]:
    states = [EngineState(), EngineState()]
    with ServedEngine(create_app(states[0])) as a, ServedEngine(create_app(states[1])) as b:
        yield [(states[0], a.url), (states[1], b.url)]


async def test_engines_behind_are_caught_up_and_a_bad_artifact_is_tried_once_per_version(
    nats_bus: NatsBus, policy: str, two: list[tuple[EngineState, str]], tmp_path: Path
) -> None:
    (a, url_a), (b, url_b) = two
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    files = dict([await announce_full(pub, tmp_path)])
    b.weight_version, b.model_path = "1", str(files[1])  # b serves v1 already; a restarted
    async with EngineFleet([url_a, url_b]) as fleet:
        watcher = FleetCatchup(nats_bus, policy, fleet)
        done = await watcher.poll_once()
        assert list(done) == [url_a] and a.weight_version == "1" and truthful(a, files) and loads(b) == []
        assert await watcher.poll_once() == {}  # nothing behind

        version, path = await announce_full(pub, tmp_path)
        write_safetensors(path, 99)  # changed after the announcement
        done = await watcher.poll_once()
        assert all(isinstance(e, ArtifactDigestError) for e in done.values()) and set(done) == {url_a, url_b}
        assert a.weight_version == b.weight_version == f"quarantine:{version}"
        assert await watcher.poll_once() == {}  # not again for the same version: alerted once
        quarantines = [
            e for e in await history(nats_bus, subjects.alerts(policy)) if isinstance(e.event, FleetQuarantined)
        ]
        assert len(quarantines) == 2

        version, path = await announce_full(pub, tmp_path)
        files[version] = path
        done = await watcher.poll_once()
        assert set(done) == {url_a, url_b} and a.weight_version == b.weight_version == str(version)
        assert truthful(a, files) and truthful(b, files) and watcher.failed == {}


async def test_an_engine_that_does_not_answer_is_logged_once_and_caught_up_when_it_does(
    nats_bus: NatsBus, policy: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    files = dict([await announce_full(pub, tmp_path)])
    state = EngineState()
    engine = ServedEngine(create_app(state))
    url = engine.url  # its port, before it serves
    async with EngineFleet([url], timeout=2.0) as fleet:
        watcher = FleetCatchup(nats_bus, policy, fleet)
        with caplog.at_level("WARNING", logger="weightbus.producers"):
            assert await watcher.poll_once() == {} and await watcher.poll_once() == {}
        down = [r for r in caplog.records if "cannot be read" in r.getMessage()]
        assert len(down) == 1 and watcher.unreachable == {url}
        with engine:
            done = await watcher.poll_once()
        assert list(done) == [url] and state.weight_version == "1" and truthful(state, files)
        assert watcher.unreachable == set()
