"""The built-in task's reward and the task import path."""

from __future__ import annotations

import random

import pytest

from weightbus.errors import TaskLoadError
from weightbus.rl.task import DEFAULT_TASK, ReverseDigits, Task, load_task


def test_reverse_digits_rewards_position_by_position() -> None:
    task = ReverseDigits(3)
    prompt = task.prompt(random.Random(1))
    assert len(prompt) == 4 and prompt.endswith(".") and prompt[:3].isdigit()
    assert task.reward("407.", "704") == 1.0
    assert task.reward("407.", "407") == pytest.approx((1 + 0.2 + 0.2) / 3)  # middle digit right, others digits
    assert task.reward("407.", "abc") == 0.0
    assert task.reward("407.", "") == 0.0
    assert task.decode(task.encode("704")) == "704"


def test_load_task_builds_the_default_and_refuses_what_is_not_a_task() -> None:
    assert isinstance(load_task(DEFAULT_TASK), Task)
    for bad in ("weightbus.rl.task", "nowhere.at_all:Task", "weightbus.rl.task:Missing", "random:Random"):
        with pytest.raises(TaskLoadError):
            load_task(bad)
