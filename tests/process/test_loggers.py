"""The step logger: one call flattens the drain's metrics and the update's phases to W&B and TensorBoard."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from weightbus.bus import MemoryBus
from weightbus.consumers.drain.decisions import DrainStats
from weightbus.errors import OptionalDependencyError
from weightbus.process import loggers
from weightbus.process.loggers import StepLogger, step_metrics
from weightbus.producers import VersionPublisher


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int | None]] = []
        self.finished = False

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


class FakeWriter:
    def __init__(self, log_dir: str = "") -> None:
        self.log_dir = log_dir
        self.scalars: list[tuple[str, float, int | None]] = []
        self.closed = False

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
        self.scalars.append((tag, scalar_value, global_step))

    def close(self) -> None:
        self.closed = True


def _stats() -> DrainStats:
    return DrainStats(
        kept=3, recycled=1, dropped=0, queue_size=2, staleness_avg=0.5, staleness_max=1, current=4, tracker_current=4
    )


async def test_one_call_logs_the_drain_and_the_update_phases_to_both_loggers() -> None:
    pub = await VersionPublisher(MemoryBus(), "p").start()
    update = pub.update()
    async with update:
        pass
    run, writer = FakeRun(), FakeWriter()
    logged = StepLogger(wandb=run, tensorboard=writer).log(7, drain=_stats(), update=update, extra={"loss": 0.25})
    assert logged["rollout/fully_async/max_staleness"] == 1.0 and logged["weightbus/kept"] == 3.0
    assert logged["weightbus/update/push_seconds"] == update.phases["push"]
    assert {k for k in logged if k.startswith("weightbus/update/")} == {
        f"weightbus/update/{phase}_seconds" for phase in ("take", "push", "announce")
    }
    assert logged["loss"] == 0.25
    assert run.logged == [(logged, 7)]
    assert writer.scalars == [(name, value, 7) for name, value in logged.items()]


def test_plain_dicts_are_taken_as_they_are_and_borrowed_loggers_stay_open() -> None:
    run = FakeRun()
    with StepLogger(wandb=run) as logger:
        logged = logger.log(1, drain=_stats().metrics, update={"push": 2.0})
    assert logged == {**_stats().metrics, "weightbus/update/push_seconds": 2.0}
    assert not run.finished
    assert step_metrics() == {}


def test_open_creates_and_closes_the_loggers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made: dict[str, Any] = {}

    class FakeWandb:
        @staticmethod
        def init(**kwargs: Any) -> FakeRun:
            made["init"] = kwargs
            made["run"] = FakeRun()
            return made["run"]

    class FakeTensorboard:
        SummaryWriter = FakeWriter

    real = importlib.import_module
    fakes = {"wandb": FakeWandb, "torch.utils.tensorboard": FakeTensorboard}
    monkeypatch.setattr(loggers.importlib, "import_module", lambda name: fakes.get(name) or real(name))
    with StepLogger.open(wandb_project="rl", tensorboard_dir=tmp_path, wandb_init={"name": "run-1"}) as logger:
        logger.log(3, update={"push": 1.5})
        writer = logger.tensorboard
        assert isinstance(writer, FakeWriter) and writer.log_dir == str(tmp_path)
    assert made["init"] == {"project": "rl", "name": "run-1"}
    assert made["run"].logged == [({"weightbus/update/push_seconds": 1.5}, 3)]
    assert made["run"].finished and writer.closed


def test_a_missing_package_is_a_typed_error_naming_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(loggers.importlib, "import_module", missing)
    with pytest.raises(OptionalDependencyError, match="pip install wandb") as raised:
        StepLogger.open(wandb_project="rl")
    assert raised.value.package == "wandb" and isinstance(raised.value, ImportError)
    with pytest.raises(OptionalDependencyError, match="pip install tensorboard"):
        StepLogger.open(tensorboard_dir="runs")


def test_a_real_summary_writer_writes_the_step_to_an_event_file(tmp_path: Path) -> None:
    try:
        StepLogger.open(tensorboard_dir=tmp_path / "probe").close()
    except OptionalDependencyError as exc:
        pytest.skip(f"TensorBoard is not installed in this venv: {exc}")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    with StepLogger.open(tensorboard_dir=tmp_path / "run") as logger:
        logger.log(5, drain=_stats(), update={"push": 0.125})
    acc = event_accumulator.EventAccumulator(str(tmp_path / "run"))
    acc.Reload()
    (push,) = acc.Scalars("weightbus/update/push_seconds")
    assert (push.step, push.value) == (5, 0.125)
    (kept,) = acc.Scalars("weightbus/kept")
    assert kept.value == 3.0
