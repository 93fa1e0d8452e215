"""Verifiable tasks for the RL loop: a prompt generator, a tokenizer and a reward function, pluggable by import path.

Every task tokenizes with the engine's character vocabulary, so ids mean the same text everywhere; no torch here.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from weightbus.errors import TaskLoadError
from weightbus.refengine.model import decode, encode

__all__ = ["DEFAULT_TASK", "ReverseDigits", "Task", "load_task"]

# A wrong digit still earns a little: the policy first learns the answer's alphabet, then the order.
_DIGIT_CREDIT = 0.2

#: The import path of the built-in task.
DEFAULT_TASK = "weightbus.rl.task:ReverseDigits"


@runtime_checkable
class Task(Protocol):
    """What the rollout (prompts, reward) and the trainer (nothing but the tokenizer) need from a task."""

    name: str
    """A short name, reported in ``report.json``."""
    max_new_tokens: int
    """The response length the rollout asks the engines for."""

    def prompt(self, rng: random.Random) -> str:
        """A new prompt, drawn from ``rng``."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        ...

    def reward(self, prompt: str, response: str) -> float:
        """The reward of ``response`` to ``prompt``, in ``[0, 1]``."""
        ...


class ReverseDigits:
    """Reverse ``digits`` random digits: ``"407."`` -> ``"704"``; reward = mean over positions (1 right, 0.2 a digit).

    Args:
        digits: the length of the digit string.
    """

    name = "reverse-digits"

    def __init__(self, digits: int = 3) -> None:
        if not 1 <= digits <= 5:
            raise ValueError("digits must be between 1 and 5")
        self.digits = digits
        self.max_new_tokens = digits

    def prompt(self, rng: random.Random) -> str:
        return "".join(rng.choice("0123456789") for _ in range(self.digits)) + "."

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return decode(ids)

    def reward(self, prompt: str, response: str) -> float:
        target = prompt.rstrip(".")[::-1]
        pairs = zip(target, response, strict=False)
        score = sum(1.0 if a == b else _DIGIT_CREDIT if b.isdigit() else 0.0 for a, b in pairs)
        return score / len(target)


def load_task(path: str) -> Task:
    """The task built by the factory at ``module:attribute`` (called with no argument).

    Raises:
        TaskLoadError: the module or attribute does not exist, or the result lacks the :class:`Task` attributes.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise TaskLoadError(f"task {path!r} must be 'package.module:factory'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise TaskLoadError(f"cannot import task {path!r}: {exc}") from None
    task = factory()
    if not isinstance(task, Task):
        raise TaskLoadError(f"{path!r} built a {type(task).__name__}, which lacks the Task attributes")
    return task
