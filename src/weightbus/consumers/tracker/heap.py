"""``freeze_startup_heap``: the collector's start-up heap frozen once, for a long-running process.

A consumer process allocates most of its long-lived objects while it starts (imports, connections,
the replayed history). Moving them into the collector's permanent generation (``gc.freeze``) keeps
later full collections short, so they do not stall event delivery. It acts on the whole process,
so library objects never call it on their own: the host opts in (``VersionTracker(freeze_heap=True)``,
or a call from its own start-up, as the CLI's long-running commands do).

Invariant: the heap is frozen at most once per process (after one ``gc.collect``).
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]

_frozen = False


def freeze_startup_heap() -> bool:
    """Collect once, then move everything allocated so far into the permanent generation (once per process).

    Returns:
        Whether this call froze the heap (False: it was frozen before).
    """
    global _frozen
    if _frozen:
        return False
    _frozen = True
    gc.collect()
    gc.freeze()
    return True
