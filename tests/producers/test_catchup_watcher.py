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
