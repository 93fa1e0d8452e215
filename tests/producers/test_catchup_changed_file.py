"""A catch-up whose artifact file changes after its digest was checked: the trainer writes its next version to the
same path while the catch-up pauses the engine, or while the engine loads.

On a real nats-server with a reference engine over real HTTP. The engine client records the sha256 of the bytes at
the path at the moment each load goes out (what an engine reading that path would load), and every test asserts
the invariant from those records and the engine's label: a numeric label never names bytes other than that
version's announced ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from weightbus.bus import subjects
from weightbus.bus.nats import NatsBus
from weightbus.engines.sglang import SGLangClient
from weightbus.errors import ArtifactDigestError
from weightbus.producers import VersionPublisher, catch_up
from weightbus.producers.artifact import check_artifact, checkpoint_artifact, safetensors_artifact
from weightbus.refengine.reference import EngineState
from weightbus.schemas import FleetQuarantined, LoraAdapter

from .conftest import history, write_checkpoint, write_safetensors

pytestmark = pytest.mark.nats

Hook = Callable[[], Awaitable[None]] | None


def _digest(path: Path) -> str:
    if path.is_dir():  # its manifest digest, which test_checkpoint_artifact checks against sha256sum
        return str(checkpoint_artifact(path).manifest_digest)
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _rewrite_in_place(path: Path, seed: int) -> None:
    write_safetensors(path, seed)  # same size and header, other weights; same inode


def _replace_atomically(path: Path, seed: int) -> None:
    fresh = write_safetensors(path.with_suffix(".tmp"), seed)
    os.replace(fresh, path)  # a careful trainer's write: a new inode under the same name


class _RecordingEngine(SGLangClient):
    """An engine client that records what each load would read from disk, and runs a hook at a chosen step."""

    def __init__(self, url: str, *, before_pause: Hook = None, after_load: Hook = None) -> None:
        super().__init__(url)
        self.before_pause, self.after_load = before_pause, after_load
        self.loaded: list[tuple[str, str]] = []  # (path, sha256 of its bytes when the load went out)

    async def pause_generation(self, mode: str = "retract") -> None:  # type: ignore[override]
        hook, self.before_pause = self.before_pause, None
        if hook is not None:
            await hook()
        await super().pause_generation(mode)  # type: ignore[arg-type]

    async def update_weights_from_disk(self, model_path: str, **kwargs: object):  # type: ignore[no-untyped-def,override]
        self.loaded.append((model_path, _digest(Path(model_path))))
        result = await super().update_weights_from_disk(model_path, **kwargs)  # type: ignore[arg-type]
        hook, self.after_load = self.after_load, None
        if hook is not None:
            await hook()
        return result

    async def load_lora_adapter(self, lora_name: str, lora_path: str, **kwargs: object):  # type: ignore[no-untyped-def,override]
        self.loaded.append((lora_path, _digest(Path(lora_path))))
        return await super().load_lora_adapter(lora_name, lora_path, **kwargs)  # type: ignore[arg-type]


def _label_names_announced_bytes(state: EngineState, engine: _RecordingEngine, announced: dict[int, str]) -> bool:
    """The invariant: an engine labelled ``v`` loaded nothing but ``v``'s announced bytes in this catch-up."""
    label = state.weight_version
    if not label.isdigit():
        return True
    return all(digest in announced.values() for _, digest in engine.loaded) and int(label) in announced


async def _announce_at_one_path(bus: NatsBus, policy: str, weights: Path) -> Path:
    """v1 announced with its artifact at the path a trainer writes every version to."""
    path = write_safetensors(weights / "latest.safetensors", 1)
    pub = await VersionPublisher(bus, policy, trainer_id="t").start()
    async with pub.update(artifact=safetensors_artifact(path)):
        pass
    return path


async def _run(bus: NatsBus, policy: str, engine: _RecordingEngine) -> ArtifactDigestError:
    """The catch-up, which must find a file changed after its check; its error."""
    try:
        with pytest.raises(ArtifactDigestError, match="changed after it was checked") as caught:
            await catch_up(bus, policy, engine)
    finally:
        await engine.aclose()
    return caught.value


async def _alerts(bus: NatsBus, policy: str) -> list[FleetQuarantined]:
    return [e.event for e in await history(bus, subjects.alerts(policy)) if isinstance(e.event, FleetQuarantined)]


@pytest.mark.parametrize("rewrite", [_rewrite_in_place, _replace_atomically])
async def test_a_file_the_trainer_rewrites_after_the_check_is_never_served_under_the_checked_number(
    nats_bus: NatsBus,
    policy: str,
    served: tuple[EngineState, str],
    tmp_path: Path,
    rewrite: Callable[[Path, int], None],
) -> None:
    state, url = served
    path = await _announce_at_one_path(nats_bus, policy, tmp_path)
    announced = {1: _digest(path)}

    async def trainer_writes_its_next_version() -> None:  # after the digest check, before the load
        rewrite(path, 2)

    engine = _RecordingEngine(url, before_pause=trainer_writes_its_next_version)
    error = await _run(nats_bus, policy, engine)
    assert engine.loaded and engine.loaded[0][1] != announced[1]  # the engine did read other bytes
    assert _label_names_announced_bytes(state, engine, announced)
    assert error.quarantined and state.weight_version == "quarantine:1" and state.pause_mode is None
    [alert] = await _alerts(nats_bus, policy)
    assert alert.engines == (url,) and "digest_mismatch" in alert.detail


async def test_a_change_during_the_load_quarantines_too_since_what_the_engine_read_cannot_be_told(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    # The engine may have read the checked bytes, or a torn mix of both: it errs toward stale, loudly.
    state, url = served
    path = await _announce_at_one_path(nats_bus, policy, tmp_path)

    async def trainer_writes_its_next_version() -> None:
        _rewrite_in_place(path, 2)

    await _run(nats_bus, policy, _RecordingEngine(url, after_load=trainer_writes_its_next_version))
    assert state.weight_version == "quarantine:1" and state.pause_mode is None


async def test_an_adapter_rewritten_after_the_check_never_gets_the_number(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    base = write_safetensors(tmp_path / "weights-v1.safetensors", 1)
    async with pub.update(artifact=safetensors_artifact(base)):
        pass
    adapter = write_safetensors(tmp_path / "adapter.safetensors", 2)  # the trainer's one adapter path
    async with pub.update(
        lora=LoraAdapter(name="lora-v2", path=str(adapter)), artifact=safetensors_artifact(adapter, 1)
    ):
        pass
    announced = {1: _digest(base), 2: _digest(adapter)}

    async def trainer_writes_its_next_adapter() -> None:
        _replace_atomically(adapter, 3)

    engine = _RecordingEngine(url, before_pause=trainer_writes_its_next_adapter)
    await _run(nats_bus, policy, engine)
    assert _label_names_announced_bytes(state, engine, announced)
    assert state.weight_version == "quarantine:2" and state.pause_mode is None


async def test_a_file_left_alone_is_caught_up_as_before(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    state, url = served
    path = await _announce_at_one_path(nats_bus, policy, tmp_path)
    engine = _RecordingEngine(url)
    try:
        result = await catch_up(nats_bus, policy, engine)
    finally:
        await engine.aclose()
    assert (result.outcome, state.weight_version) == ("caught_up", "1")
    assert engine.loaded == [(str(path), _digest(path))]


def test_a_checked_file_tells_when_it_was_written_again_even_with_the_same_bytes(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "w.safetensors", 1)
    checked = check_artifact(safetensors_artifact(path))
    assert not isinstance(checked, tuple) and checked.changed() is None
    _rewrite_in_place(path, 1)  # what a load reads now cannot be told from its identity: counted as a change
    assert checked.changed() is not None
    path.unlink()
    assert "no longer" in (checked.changed() or "")


def test_a_file_written_while_its_digest_is_computed_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightbus.producers import artifact as module

    path = write_safetensors(tmp_path / "w.safetensors", 1)
    announced = safetensors_artifact(path)
    digest = module._file_digest

    def digest_then_rewrite(at: Path) -> str:
        value = digest(at)
        _rewrite_in_place(at, 1)  # the hash read the old bytes; the file moved on before the check ended
        return value

    monkeypatch.setattr(module, "_file_digest", digest_then_rewrite)
    problem = check_artifact(announced)
    assert isinstance(problem, tuple) and problem[0] == "digest_mismatch" and "while it was checked" in problem[1]


async def test_a_checkpoint_directory_is_caught_up_to_and_a_shard_replaced_under_the_load_quarantines(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    # What SGLang loads: a directory. v1 and v2 each in a directory of their own; v2's shard replaced under its load.
    state, url = served
    pub = await VersionPublisher(nats_bus, policy, trainer_id="t").start()
    first = write_checkpoint(tmp_path / "step-1", seed=1)
    async with pub.update(artifact=checkpoint_artifact(first)):
        pass
    engine = _RecordingEngine(url)
    try:
        result = await catch_up(nats_bus, policy, engine)
    finally:
        await engine.aclose()
    assert (result.outcome, state.weight_version, state.model_path) == ("caught_up", "1", str(first))

    second = write_checkpoint(tmp_path / "step-2", seed=2)
    async with pub.update(artifact=checkpoint_artifact(second)):
        pass

    async def trainer_rewrites_a_shard() -> None:
        _replace_atomically(second / "model-00001-of-00002.safetensors", 9)

    error = await _run(nats_bus, policy, _RecordingEngine(url, before_pause=trainer_rewrites_a_shard))
    assert "model-00001-of-00002.safetensors" in error.detail
    assert error.quarantined and state.weight_version == "quarantine:2" and state.pause_mode is None


async def test_the_check_hashes_beside_the_loop_so_the_bus_and_other_engines_go_on(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightbus.producers import artifact as module

    state, url = served
    await _announce_at_one_path(nats_bus, policy, tmp_path)
    digest = module._file_digest

    def slow_digest(at: Path) -> str:  # a checkpoint of many gigabytes
        time.sleep(0.5)
        return digest(at)

    monkeypatch.setattr(module, "_file_digest", slow_digest)
    ticks = 0

    async def loop_goes_on() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(loop_goes_on())
    engine = _RecordingEngine(url)
    try:
        result = await catch_up(nats_bus, policy, engine)
    finally:
        ticker.cancel()
        await engine.aclose()
    assert result.outcome == "caught_up" and state.weight_version == "1"
    assert ticks >= 10  # about 50 in the half second the hash took; a blocked loop gives 0 to 2


async def test_a_catch_up_cancelled_during_its_load_never_leaves_a_number_on_unchecked_bytes(
    nats_bus: NatsBus, policy: str, served: tuple[EngineState, str], tmp_path: Path
) -> None:
    # As `catchup --watch --duration` or a SIGTERM does: cancelled while the engine loads a file the trainer rewrites.
    state, url = served
    path = await _announce_at_one_path(nats_bus, policy, tmp_path)
    state.weight_update_delay = 1.0
    engine = _RecordingEngine(url)
    try:
        task = asyncio.create_task(catch_up(nats_bus, policy, engine))
        while not state.recorded("/update_weights_from_disk"):
            await asyncio.sleep(0.01)
        _rewrite_in_place(path, 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while state.model_path != str(path) or state.pause_mode is not None:  # the load lands, the engine resumes
            assert not state.weight_version.isdigit()
            await asyncio.sleep(0.01)
    finally:
        await engine.aclose()
    assert state.weight_version == "quarantine:1"  # loaded under it; the number never came: no check passed


def test_a_checkpoint_of_any_depth_is_walked(tmp_path: Path) -> None:
    deep = leaf = tmp_path / "ckpt"
    deep.mkdir()
    levels = [leaf]
    try:
        for _ in range(1100):  # deeper than Python's recursion limit (one level at a time: mkdir(parents) recurses)
            leaf = leaf / "d"
            leaf.mkdir()
            levels.append(leaf)
        (leaf / "w.bin").write_bytes(b"w")
        checked = check_artifact(checkpoint_artifact(deep))
        assert not isinstance(checked, tuple) and checked.changed() is None
    finally:
        # Removed here, leaf first: shutil.rmtree recurses, so pytest's own clean-up of old temporary directories
        # would fail on this tree in a later run (and leave a ResourceWarning that fails that run).
        (leaf / "w.bin").unlink(missing_ok=True)
        for level in reversed(levels):
            level.rmdir()
