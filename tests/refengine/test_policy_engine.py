"""The engine serving the RL policy: safetensors loads carrying weight_version, logprobs, and a prompt SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from weightbus.embedded.server import free_port  # noqa: E402
from weightbus.refengine.policy_model import WindowLM, save_safetensors  # noqa: E402
from weightbus.refengine.reference import EngineState, create_app  # noqa: E402
from weightbus.rl.policy import Policy, token_windows  # noqa: E402

pytestmark = pytest.mark.torch

PROMPT = [29, 30, 31, 37]


def _client(state: EngineState) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://engine")


async def test_disk_load_of_safetensors_changes_weights_and_label_in_one_call(tmp_path: Path) -> None:
    state = EngineState(model=WindowLM(seed=0))
    trained = Policy(seed=7)
    path = tmp_path / "w.safetensors"
    trained.save_weights(str(path))
    async with _client(state) as http:
        greedy = {"input_ids": PROMPT, "sampling_params": {"temperature": 0}}
        before = (await http.post("/generate", json=greedy)).json()
        r = await http.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "5"})
        assert r.status_code == 200 and r.json()["success"] is True
        assert (await http.get("/model_info")).json()["weight_version"] == "5"
        after = (await http.post("/generate", json=greedy)).json()
    assert after["meta_info"]["weight_version"] == "5"
    assert after["output_ids"] != before["output_ids"]
    for name, tensor in trained.module.state_dict().items():
        assert torch.equal(state.model.state_dict()[name], tensor)


async def test_bad_safetensors_is_refused_and_keeps_weights_and_label(tmp_path: Path) -> None:
    state = EngineState(model=WindowLM(seed=0))
    original = state.model.state_dict()
    wrong = tmp_path / "wrong.safetensors"
    save_safetensors({"embed.weight": torch.zeros(3, 3)}, str(wrong))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    async with _client(state) as http:
        for path in (wrong, garbage, tmp_path / "missing.safetensors"):
            r = await http.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "9"})
            assert r.status_code == 400 and r.json()["success"] is False
        assert (await http.get("/model_info")).json()["weight_version"] == "default"
    assert all(torch.equal(original[k], v) for k, v in state.model.state_dict().items())


async def test_output_token_logprobs_match_the_trainers_recomputation() -> None:
    state = EngineState(model=WindowLM(seed=3, sampling_seed=1))
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    async with _client(state) as http:
        plain = await http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
        answer = (await http.post("/generate", json=body)).json()
    assert "output_token_logprobs" not in plain.json()["meta_info"]
    entries = answer["meta_info"]["output_token_logprobs"]
    assert [token for _, token, _ in entries] == answer["output_ids"]
    assert all(text is None and logprob <= 0 for logprob, _, text in entries)
    # The trainer's policy, built from the same seed, assigns the same logprobs to the same tokens.
    tokens = PROMPT + answer["output_ids"]
    mine = Policy(seed=3).token_logprobs(token_windows(tokens, 4), answer["output_ids"]).tolist()
    assert mine == pytest.approx([logprob for logprob, _, _ in entries], abs=1e-5)


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "engine exited during startup"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "engine did not start"
            time.sleep(0.05)


def _generate_ignoring_errors(url: str) -> None:
    try:
        httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 50}}, timeout=30)
    except httpx.HTTPError:
        pass  # the engine is killed under it; what matters is how fast it goes


def _has_parked_request(port: int) -> bool:
    # /flush_cache refuses while any request is running or waiting: a cheap probe of the engine's queue.
    return httpx.post(f"http://127.0.0.1:{port}/flush_cache", timeout=5).status_code == 400


@pytest.mark.slow
def test_engine_exits_within_5s_of_sigterm_with_the_router_attached_and_a_request_parked() -> None:
    port, router_port = free_port(), free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "weightbus.cli", "engine", "--port", str(port), "--model", "policy"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    router = None
    try:
        _wait_port(port, engine)
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(router_port),
                "--worker-urls",
                f"http://127.0.0.1:{port}",
                "--health-check-interval-secs",
                "1",
                "--log-level",
                "warn",
                # Not its default 0.0.0.0:29000, which another router on the host may hold (the router then panics).
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                workers = httpx.get(f"{url}/workers", timeout=1).json()["workers"]
                if workers and workers[0]["is_healthy"]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, "router did not register the engine"
            time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=10) as keepalive:
            # The router now holds pooled keep-alive connections to the engine.
            assert keepalive.post("/generate", json={"input_ids": PROMPT}).status_code == 200
            direct = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
            direct.post("/pause_generation", json={"mode": "retract"}).raise_for_status()
            # A request through the router parks on the paused engine and holds its connection open.
            parked = threading.Thread(target=_generate_ignoring_errors, args=(url,), daemon=True)
            parked.start()
            deadline = time.monotonic() + 10
            while not _has_parked_request(port):
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.05)
            engine.send_signal(signal.SIGTERM)
            started = time.monotonic()
            engine.wait(timeout=5)
            assert time.monotonic() - started < 5
            direct.close()
    finally:
        for proc in (engine, router):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
