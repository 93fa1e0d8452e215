"""slime/rollout/fully_async_rollout.py: the fully-async rollout (:48-274), its control flow as slime has it.

A worker thread runs its own asyncio loop (``asyncio.run``) for the whole process, created by the first rollout call
with that call's ``data_buffer``. Each iteration reaps finished tasks, then tops up while fewer than ``concurrency``
groups run *and* fewer than ``concurrency`` completed groups wait in the queue (the gate of :151-152), one
``data_buffer.get_samples(1)`` at a time, stopping at an empty answer; then it sleeps ``poll_interval``. A finished
group with an ``ABORTED`` sample goes back through ``data_buffer.add_samples`` (:199-204), any other into the
unbounded queue. A rollout call pulls at most what it still needs from the queue, polling every 50 ms, and returns
the groups sorted by their first ``index``. ``POLL_INTERVAL`` is slime's 1.0 s; tests may lower it.
"""

import asyncio
import atexit
import logging
import queue
import threading

from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.http_utils import get_rollout_num_engines
from slime.utils.types import Sample

logger = logging.getLogger("slime.rollout.fully_async")
POLL_INTERVAL = 1.0

_global_worker = None
_worker_lock = threading.Lock()


def _get_global_worker(args, data_buffer):
    global _global_worker
    with _worker_lock:
        if _global_worker is None or not _global_worker.worker_thread.is_alive():
            concurrency = args.sglang_server_concurrency * get_rollout_num_engines(args)
            _global_worker = AsyncRolloutWorker(args, data_buffer, concurrency=concurrency)
            _global_worker.start()
        return _global_worker


def _stop_global_worker():
    global _global_worker
    with _worker_lock:
        if _global_worker is not None:
            _global_worker.stop()
            _global_worker = None


atexit.register(_stop_global_worker)


class AsyncRolloutWorker:
    def __init__(self, args, data_buffer, concurrency=10):
        self.args = args
        self.data_buffer = data_buffer
        self.concurrency = concurrency
        self.running = True
        self.output_queue = queue.Queue()
        self.poll_interval = POLL_INTERVAL
        self.worker_thread = None
        self.state = GenerateState(args)
        self.active = 0  # stand-in only: groups running, for the tests' records

    def start(self):
        if self.worker_thread is None or not self.worker_thread.is_alive():
            self.worker_thread = threading.Thread(target=self._thread_main, name="fully-async-rollout", daemon=True)
            self.worker_thread.start()

    def stop(self):
        self.running = False
        if self.worker_thread and self.worker_thread.is_alive():
            self.worker_thread.join(timeout=5)

    def get_completed_groups(self, limit=None):
        completed = []
        while limit is None or len(completed) < limit:
            try:
                completed.append(self.output_queue.get_nowait())
            except queue.Empty:
                break
        return completed

    def queue_size(self):
        return self.output_queue.qsize()

    def _thread_main(self):
        asyncio.run(self._loop())

    async def _loop(self):
        active_tasks = set()
        gid_counter = 0
        while self.running:
            try:
                done = {t for t in active_tasks if t.done()}
                for t in done:
                    try:
                        t.result()
                    except Exception as e:
                        logger.warning("fully-async task crashed: %r", e)
                active_tasks -= done
                while (
                    len(active_tasks) < self.concurrency
                    and self.output_queue.qsize() < self.concurrency
                    and self.running
                ):
                    groups = self.data_buffer.get_samples(1)
                    if not groups:
                        break
                    for group in groups:
                        gid = gid_counter
                        gid_counter += 1
                        task = asyncio.create_task(
                            generate_and_rm_group(
                                self.args, group, sampling_params=self.state.sampling_params.copy(), evaluation=False
                            )
                        )
                        task.add_done_callback(self._make_done_cb(gid))
                        active_tasks.add(task)
                self.active = len(active_tasks)
                await asyncio.sleep(self.poll_interval)
            except Exception as e:
                logger.exception("fully-async loop iteration error: %s", e)
                await asyncio.sleep(self.poll_interval)
        if active_tasks:
            await asyncio.wait(active_tasks, timeout=30)

    def _make_done_cb(self, gid):
        def _cb(done_task):
            try:
                result = done_task.result()
            except Exception:
                logger.exception("fully-async: process task raised")
                return
            if not isinstance(result, list):
                return
            if any(getattr(s, "status", None) == Sample.Status.ABORTED for s in result):
                try:
                    self.data_buffer.add_samples([result])
                except Exception:
                    logger.exception("fully-async: failed to requeue aborted group")
                return
            self.output_queue.put((gid, result))

        return _cb


async def _generate_rollout_async(args, rollout_id, data_buffer):
    assert args.rollout_global_dataset
    worker = _get_global_worker(args, data_buffer)
    target = args.rollout_batch_size
    collected = {}
    while len(collected) < target:
        drained = 0
        for gid, group in worker.get_completed_groups(limit=target - len(collected)):
            collected[gid] = group
            drained += 1
        if not drained:
            await asyncio.sleep(0.05)

    def _key(group):
        for s in group:
            if getattr(s, "index", None) is not None:
                return int(s.index)
        return 0

    return sorted(collected.values(), key=_key)


def generate_rollout_fully_async(args, rollout_id, data_buffer, evaluation=False):
    if evaluation:
        raise ValueError("fully-async rollout doesn't support evaluation mode")
    return run(_generate_rollout_async(args, rollout_id, data_buffer))
