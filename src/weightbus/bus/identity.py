"""Who this process is on the bus: one name for the trainer id, the tracker's observer and a consumer's name.

The name is readable (host and pid) rather than unique; uniqueness comes from elsewhere (a trainer's incarnation, a
consumer's boot id).
"""

from __future__ import annotations

import os
import socket

__all__ = ["process_identity"]


def process_identity(role: str | None = None) -> str:
    """``<hostname>:<pid>``, or ``<role>:<hostname>:<pid>`` (``role``: ``miles``, say), for this process."""
    base = f"{socket.gethostname()}:{os.getpid()}"
    return f"{role}:{base}" if role else base
