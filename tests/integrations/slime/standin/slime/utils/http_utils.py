"""slime/utils/http_utils.py: one shared ``httpx.AsyncClient``, ``post`` with retries, ``get``, the engine count."""

import asyncio
import json

import httpx

_http_client = None


def init_http_client(args):
    global _http_client
    if _http_client is None:
        _http_client = httpx.AsyncClient(timeout=httpx.Timeout(None))


def get_rollout_num_engines(args) -> int:
    if (num_engines := getattr(args, "rollout_num_engines", None)) is not None:
        return int(num_engines)
    rollout_num_gpus = getattr(args, "rollout_num_gpus", None) or 0
    per_engine = getattr(args, "rollout_num_gpus_per_engine", None) or 1
    if rollout_num_gpus <= 0:
        return 0
    return max(1, rollout_num_gpus // per_engine)


async def _post(client, url, payload, max_retries=60, headers=None):
    retry_count = 0
    while True:
        try:
            response = await client.post(url, json=payload or {}, headers=headers)
            response.raise_for_status()
            return json.loads(await response.aread())
        except Exception:
            retry_count += 1
            if retry_count >= max_retries:
                raise
            await asyncio.sleep(1)


async def post(url, payload, max_retries=60, headers=None):
    return await _post(_http_client, url, payload, max_retries, headers=headers)


async def get(url):
    response = await _http_client.get(url)
    response.raise_for_status()
    return json.loads(await response.aread())
