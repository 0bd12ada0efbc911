"""The evaluation sampler counts every example exactly once; DistributedSampler is used by GLOBAL rank."""
import pytest
from torch.utils.data import DistributedSampler

from common.samplers import EvalSampler


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 10, 101, 10_000])
def test_eval_sampler_covers_every_index_once(world_size, n):
    shards = [list(EvalSampler(n, world_size, r)) for r in range(world_size)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert [len(EvalSampler(n, world_size, r)) for r in range(world_size)] == [len(s) for s in shards]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_ten_thousand_over_three_ranks():
    assert [len(EvalSampler(10_000, 3, r)) for r in range(3)] == [3334, 3333, 3333]


def test_distributed_sampler_pads_which_is_why_eval_needs_its_own():
    padded = [list(DistributedSampler(range(10_000), 3, r, shuffle=False)) for r in range(3)]
    assert sum(map(len, padded)) == 10_002  # two test images would be counted twice


def test_two_nodes_must_shard_by_global_rank():
    # 2 nodes x 2 GPUs: sharding by LOCAL rank would give node 2 the same data as node 1.
    by_global = [set(DistributedSampler(range(1000), 4, r, shuffle=True, seed=0)) for r in range(4)]
    assert set().union(*by_global) == set(range(1000))
    assert all(not (by_global[a] & by_global[b]) for a in range(4) for b in range(a + 1, 4))


def test_eval_sampler_rejects_a_bad_rank():
    with pytest.raises(ValueError):
        EvalSampler(10, 2, 2)
