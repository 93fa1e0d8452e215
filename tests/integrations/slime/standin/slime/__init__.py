"""A stand-in of slime (THUDM/slime at 624b824a) for weightbus' tests: its rollout side under slime's module paths.

Only what the rollout half touches, with slime's control flow: ``rollout.fully_async_rollout`` (the worker thread, its
top-up gate, its queue and its aborted path), ``rollout.sglang_rollout`` (``GenerateState``, ``generate`` posting to
the router, ``generate_and_rm[_group]``), ``rollout.data_source`` (the buffer), ``utils.types.Sample``,
``utils.async_utils`` (the background loop) and ``ray.rollout.RolloutManager`` calling the rollout function per
``rollout_id``. Written for these tests from slime's behaviour, not copied; line references are to slime's files.
"""
