"""slime/utils/types.py: the fields of ``Sample`` the rollout side reads, and its response bookkeeping (:93-416)."""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)  # types.py:120, one label per generate call
    rollout_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    session_id: str | None = None

    def append_response_tokens(self, args, *, tokens, log_probs, trainable, meta_info, text):
        self.tokens = self.tokens + list(tokens)
        self.response += text
        self.response_length += len(tokens)
        self.rollout_log_probs = (self.rollout_log_probs or []) + list(log_probs)
        self._apply_meta_info(meta_info)

    def _apply_meta_info(self, meta_info):
        if "weight_version" in meta_info:  # types.py:407-408
            self.weight_versions.append(meta_info["weight_version"])
        match meta_info["finish_reason"]["type"]:
            case "length":
                self.status = Sample.Status.TRUNCATED
            case "abort":
                self.status = Sample.Status.ABORTED
            case "stop":
                self.status = Sample.Status.COMPLETED
