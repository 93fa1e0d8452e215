"""``OverheadMeter``: weightbus's own time = weightbus spans − excluded spans − engine HTTP, each instant once."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests._builders import wait_until
from weightbus.process.overhead import BusyTimer, HttpCall, OverheadMeter, covered


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_report_counts_overlapping_engine_calls_once_and_skips_excluded_and_outside_time() -> None:
    clock = _Clock()
    meter = OverheadMeter(clock)
    with meter.step():
        clock.t = 1.0
        with meter.weightbus():
            clock.t = 2.0
            with meter.excluded():
                clock.t = 3.0
            clock.t = 5.0
        clock.t = 10.0
    # Two engines answering at once (1.5-2.5 and 1.8-4.0), and generation traffic outside any weightbus span.
    meter.http_calls.extend(
        [
            _call(1.5, 2.5),
            _call(1.8, 4.0),
            _call(6.0, 7.0),
        ]
    )
    report = meter.report()
    assert report.steps == 1
    assert report.step_s == pytest.approx(10.0)
    assert report.weightbus_s == pytest.approx(3.0)  # 1-2 and 3-5
    assert report.engine_http_s == pytest.approx(1.5)  # 1.5-2 and 3-4
    assert report.own_s == pytest.approx(1.5)
    assert report.share == pytest.approx(0.15)
    assert report.as_dict()["share"] == pytest.approx(0.15)


def test_report_before_any_step_is_zero() -> None:
    report = OverheadMeter().report()
    assert (report.steps, report.step_s, report.own_s, report.share) == (0, 0.0, 0.0, 0.0)


def test_a_window_reports_one_step_only() -> None:
    clock = _Clock()
    meter = OverheadMeter(clock)
    for start in (0.0, 10.0):
        clock.t = start
        with meter.step():
            clock.t = start + 1.0
            with meter.weightbus():
                clock.t = start + 3.0
            clock.t = start + 4.0
    meter.http_calls.extend([_call(1.5, 2.0), _call(11.0, 12.5)])
    last = meter.report(meter.steps[-1])
    assert (last.steps, last.step_s, last.weightbus_s) == (1, pytest.approx(4.0), pytest.approx(2.0))
    assert last.engine_http_s == pytest.approx(1.5)
    assert last.share == pytest.approx(0.5 / 4.0)
    assert meter.report().own_s == pytest.approx(1.5 + 0.5)
    assert meter.report((20.0, 30.0)).steps == 0
    meter.reset()
    assert (meter.report().steps, meter.http_calls) == (0, [])


async def test_busy_timer_counts_the_coroutines_own_time_not_its_suspensions() -> None:
    clock = _Clock()
    resume = asyncio.Event()

    async def drain() -> str:
        clock.t += 1.0  # its own work
        await resume.wait()  # suspended while others run
        clock.t += 2.0
        return "drained"

    async def others() -> None:
        await asyncio.sleep(0)
        clock.t += 100.0
        resume.set()

    timer = BusyTimer(drain(), clock)
    result, _ = await asyncio.gather(timer, others())
    assert result == "drained"
    assert timer.seconds == pytest.approx(3.0)


async def test_busy_timer_passes_errors_and_cancellation_through() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad group")

    with pytest.raises(ValueError, match="bad group"):
        await BusyTimer(fails())

    cleaned: list[bool] = []
    entered: list[bool] = []

    async def waits() -> None:
        entered.append(True)
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append(True)

    async def run() -> None:
        await BusyTimer(waits())

    task = asyncio.create_task(run())
    await wait_until(lambda: entered, 5, "the timed call to start waiting")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]


def test_covered_merges_overlaps_and_clips_to_the_window() -> None:
    assert covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], 1.0, 5.5) == pytest.approx(2.5)
    assert covered([(0.0, 2.0)], 3.0, 2.0) == 0.0


async def test_http_hooks_record_each_answered_request_and_nothing_for_a_failed_one() -> None:
    meter = OverheadMeter()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/broken":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200 if request.url.path == "/model_info" else 400, json={"weight_version": "3"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), event_hooks=meter.http_hooks()) as client:
        before = meter.now()
        assert (await client.get("http://engine/model_info")).json() == {"weight_version": "3"}
        await client.post("http://engine/pause_generation", json={})
        with pytest.raises(httpx.ConnectError):
            await client.get("http://engine/broken")
        after = meter.now()
    assert [(c.method, c.path, c.status) for c in meter.http_calls] == [
        ("GET", "/model_info", 200),
        ("POST", "/pause_generation", 400),
    ]
    assert all(before <= c.start <= c.end <= after for c in meter.http_calls)
    assert meter.http_time(before, after, paths={"/model_info"}) == pytest.approx(
        meter.http_calls[0].end - meter.http_calls[0].start
    )


def _call(start: float, end: float) -> HttpCall:
    return HttpCall("POST", "/x", 200, start, end)
