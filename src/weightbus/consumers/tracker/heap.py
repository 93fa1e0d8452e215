"""``freeze_startup_heap``: the collector's start-up heap frozen once, for a long-running process.

``gc.freeze`` keeps full collections short; it acts on the whole process, so only the host opts in (``freeze_heap``).
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
