"""Evaluation's sampler. DistributedSampler pads: 10,000 test images on 3 ranks become 10,002, two counted twice,
harmless for training but a (small) lie in a test accuracy. EvalSampler gives every example to exactly one rank.
"""
import math
from typing import Iterator, Sized

from torch.utils.data import Sampler

from common.distributed import get_rank, get_world_size


class EvalSampler(Sampler[int]):
    """Rank r takes examples r, r + W, r + 2W, ...: shards may differ by one, so reduce SUMS, not averages."""

    def __init__(self, data_source: Sized | int, num_replicas: int | None = None, rank: int | None = None):
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self.num_replicas = get_world_size() if num_replicas is None else num_replicas
        self.rank = get_rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside 0..{self.num_replicas - 1}")

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))

    def most_batches(self, batch_size: int) -> int:
        """The batches of the busiest rank (rank 0's shard is the longest): what every rank must run under FSDP."""
        return math.ceil(math.ceil(self.length / self.num_replicas) / batch_size)
