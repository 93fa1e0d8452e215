"""The trainer's announcements carry the artifact it wrote: the file the engines load, its digests, its lineage."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from weightbus.bus import MemoryBus, subjects  # noqa: E402
from weightbus.bus.history import read_subject_history  # noqa: E402
from weightbus.consumers import VersionTracker  # noqa: E402
from weightbus.producers import VersionPublisher  # noqa: E402
from weightbus.rl.trainer import TrainerConfig, _Trainer  # noqa: E402
from weightbus.schemas import WeightUpdated  # noqa: E402

pytestmark = pytest.mark.torch


class _Engine:
    """Stands for an engine client: records what it was told to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    async def update_weights_from_disk(self, path: str, *, weight_version: str) -> None:
        self.loaded.append(path)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.loaded.append(path)

    async def unload_lora_adapter(self, name: str) -> None:
        pass


def _check(artifact: Any, loaded: str) -> None:
    path = Path(artifact.uri)
    assert artifact.uri == loaded  # the very file the engines loaded
    assert artifact.manifest_digest == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    tensors = load_file(str(path))
    assert [name for name, _ in artifact.tensors] == sorted(tensors)
    for name, digest in artifact.tensors:
        raw = tensors[name].contiguous().view(torch.uint8).numpy().tobytes()
        assert digest == "sha256:" + hashlib.sha256(raw).hexdigest()


@pytest.mark.parametrize("lora_rank", [None, 2])
async def test_every_push_announces_the_file_it_wrote_with_its_digests(tmp_path: Path, lora_rank: int | None) -> None:
    config = TrainerConfig(
        nats_url="nats://unused", router_url="http://unused", policy="p", run_dir=str(tmp_path), lora_rank=lora_rank
    )
    trainer = _Trainer(config)
    bus = MemoryBus()
    engine = _Engine()
    fleet: Any = SimpleNamespace(clients=[engine])
    pub = await VersionPublisher(bus, "p", trainer_id="t").start()
    registry = CollectorRegistry()
    async with VersionTracker(bus, "p", registry=registry) as tracker:
        for _ in range(3):
            await trainer.push(pub, fleet)
        assert await tracker.wait_for(3, timeout=5) == 3
        # The tracker took every one (no delta named a base it did not see), none with its lineage unchecked.
        assert tracker.current == 3
        assert registry.get_sample_value("weightbus_unverified_bases_total", {"policy": "p"}) == 0
    announced = await _history(bus)
    assert [e.version for e in announced] == [1, 2, 3]
    if lora_rank is None:
        for event, loaded in zip(announced, engine.loaded, strict=True):
            assert event.artifact is not None and event.artifact.lineage == "full" and event.artifact.base is None
            _check(event.artifact, loaded)
    else:
        # The first adapter has no announced version to name as its base; each later one is a delta on the one before.
        assert announced[0].artifact is None
        for event, loaded in zip(announced[1:], engine.loaded[1:], strict=True):
            assert event.artifact is not None and event.artifact.lineage == "delta"
            assert event.artifact.base == event.version - 1
            _check(event.artifact, loaded)


async def _history(bus: MemoryBus) -> list[WeightUpdated]:
    history = await read_subject_history(bus, subjects.weights("p"))
    return [e.event for e in history.events if isinstance(e.event, WeightUpdated)]
