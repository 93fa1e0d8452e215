"""slime/rollout/data_source.py: ``RolloutDataSourceWithBuffer`` without a dataset (prompts are numbered).

``get_samples`` serves the buffer first (``pop_first``), then new prompt groups of ``n_samples_per_prompt``
samples sharing a ``group_index``; ``add_samples`` appends whole groups to the buffer (:168-229). The stand-in
records what it served and what came back, for the tests' accounts.
"""

import copy

from slime.utils.types import Sample


class RolloutDataSourceWithBuffer:
    def __init__(self, args):
        self.args = args
        self.sample_group_index = 0
        self.sample_index = 0
        self.buffer = []
        self.served = []  # every group handed out, in order (stand-in only)
        self.added = []  # every group added back (stand-in only)

    def get_samples(self, num_samples):
        samples = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        for _ in range(num_samples - len(samples)):
            prompt = Sample(prompt=f"prompt {self.sample_group_index}", tokens=[1, 2, 3])
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            samples.append(group)
        self.served.extend(samples)
        return samples

    def add_samples(self, samples):
        if not samples:
            return
        assert isinstance(samples, list) and isinstance(samples[0], list)
        for group in samples:
            assert len(group) == self.args.n_samples_per_prompt
            self.buffer.append(group)
            self.added.append(copy.deepcopy(group))  # as it came back (it is regenerated in place)

    def save(self, rollout_id):
        pass

    def load(self, rollout_id=None):
        pass

    def __len__(self):
        return 10**9

    def get_buffer_length(self):
        return len(self.buffer)
