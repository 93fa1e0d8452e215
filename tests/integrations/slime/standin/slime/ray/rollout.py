"""slime/ray/rollout.py: the ``RolloutManager``'s rollout side (:370-600), without ray or engines.

It builds the data source from ``args.data_source_path``, loads ``args.rollout_function_path``, and each
``generate(rollout_id)`` calls it through ``call_rollout_fn`` with the data source, then flattens the groups.
"""

import itertools

from slime.rollout.base_types import call_rollout_fn
from slime.utils.http_utils import init_http_client
from slime.utils.misc import load_function


class RolloutManager:
    def __init__(self, args):
        self.args = args
        init_http_client(args)
        self.data_source = load_function(args.data_source_path)(args)
        self.generate_rollout = load_function(args.rollout_function_path)
        self.rollout_id = -1
        self.metrics = []  # every rollout's metrics (stand-in only)

    def generate(self, rollout_id):
        """The rollout's groups (slime flattens them into train data here; the stand-in returns them)."""
        self.rollout_id = rollout_id
        output = call_rollout_fn(self.generate_rollout, self.args, rollout_id, self.data_source, evaluation=False)
        self.metrics.append(output.metrics)
        groups = output.samples
        assert len(groups) == self.args.rollout_batch_size, (len(groups), self.args.rollout_batch_size)
        flat = groups
        while isinstance(flat[0], list):
            flat = list(itertools.chain.from_iterable(flat))
        return groups
