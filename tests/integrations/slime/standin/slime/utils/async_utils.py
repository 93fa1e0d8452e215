"""slime/utils/async_utils.py: one background event loop per process; ``run`` blocks on a coroutine scheduled on it."""

import asyncio
import threading

__all__ = ["get_async_loop", "run"]


class AsyncLoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._start_loop, daemon=True, name="slime-async-loop")
        self._thread.start()

    def _start_loop(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self):
        # Stand-in only (tests): a rollout still waiting is cancelled, so the thread blocked in run() returns.
        def cancel_all():
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_soon(self.loop.stop)

        self.loop.call_soon_threadsafe(cancel_all)
        self._thread.join(timeout=5)


async_loop = None


def get_async_loop():
    global async_loop
    if async_loop is None:
        async_loop = AsyncLoopThread()
    return async_loop


def run(coro):
    return get_async_loop().run(coro)
