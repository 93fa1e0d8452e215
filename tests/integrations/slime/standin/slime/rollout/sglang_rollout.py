"""slime/rollout/sglang_rollout.py: the per-sample generate path (:83-336).

``generate`` posts slime's payload (no ``rid``) to the router's ``/generate`` through this module's ``post`` and
appends the answer to the sample; ``generate_and_rm`` takes a permit of ``GenerateState.semaphore``, calls the
custom generate function when ``args.custom_generate_function_path`` is set (with ``evaluation`` when its signature
has it), skips the reward of an aborted sample; ``generate_and_rm_group`` gathers a group's samples.
"""

import asyncio
import inspect
import uuid

from slime.utils.http_utils import get_rollout_num_engines, post
from slime.utils.misc import SingletonMeta, load_function
from slime.utils.types import Sample


class GenerateState(metaclass=SingletonMeta):
    def __init__(self, args):
        self.args = args
        self.semaphore = asyncio.Semaphore(args.sglang_server_concurrency * get_rollout_num_engines(args))
        self.sampling_params = dict(
            temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.rollout_max_response_len, no_stop_trim=True
        )
        self.reset()

    def reset(self):
        self.remaining_batch_size = 0
        self.pendings = set()
        self.aborted = False


async def generate(args, sample, sampling_params):
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    assert sample.status in (Sample.Status.PENDING, Sample.Status.ABORTED), f"Sample status is {sample.status}"
    prompt_ids = sample.tokens
    sampling_params["max_new_tokens"] -= sample.response_length
    if sampling_params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}
    output = await post(url, payload)
    pairs = output["meta_info"].get("output_token_logprobs", [])
    sample.append_response_tokens(
        args,
        tokens=[item[1] for item in pairs],
        log_probs=[item[0] for item in pairs],
        trainable=True,
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return sample


async def generate_and_rm(args, sample, sampling_params, evaluation=False):
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        custom = getattr(sample, "generate_function_path", None) or args.custom_generate_function_path
        if custom is not None:
            fn = load_function(custom)
            if "evaluation" in inspect.signature(fn).parameters:
                sample = await fn(args, sample, sampling_params, evaluation=evaluation)
            else:
                sample = await fn(args, sample, sampling_params)
        else:
            sample = await generate(args, sample, sampling_params)
    if sample.status == Sample.Status.ABORTED:
        return sample
    if sample.reward is None:
        sample.reward = float(len(sample.response) % 2)
    return sample


async def generate_and_rm_group(args, group, sampling_params, evaluation=False):
    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    tasks = [
        asyncio.create_task(generate_and_rm(args, sample, sampling_params.copy(), evaluation=evaluation))
        for sample in group
    ]
    return await asyncio.gather(*tasks)
