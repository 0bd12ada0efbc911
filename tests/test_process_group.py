"""Real gloo process groups: the notebook launcher, SUM reductions, DDP equivalence."""
import pytest
import torch
import torch.nn.functional as F

import workers
from common.launcher import WorkerError, launch
from common.model import Net


def test_launcher_returns_each_ranks_result():
    assert launch(workers.sum_rank, nprocs=3, args=(None,), timeout_s=60) == [[3.0, 3.0]] * 3


def test_without_a_forkserver_the_launcher_spawns(monkeypatch):
    """Where multiprocessing has no forkserver (Windows), the workers start with spawn: slower, the same results."""
    import common.launcher as launcher

    monkeypatch.setattr(launcher.mp, "get_all_start_methods", lambda: ["spawn"])
    assert launcher._context().get_start_method() == "spawn"
    monkeypatch.undo()
    assert launcher._context().get_start_method() == "forkserver"  # Linux and macOS


def test_launcher_reraises_a_workers_exception_without_hanging():
    with pytest.raises(WorkerError, match="rank 1 failed: ValueError: boom from rank 1") as info:
        launch(workers.raise_on_rank, nprocs=2, args=(1,), timeout_s=60)
    assert info.value.rank == 1 and "Traceback" in info.value.worker_traceback


def test_sum_reduction_over_unequal_ranks_equals_one_process():
    # 3 ranks with 3, 1 and 2 examples: the mean of rank means would be wrong, the SUMs are right.
    per_rank = [[(0.5, 1), (1.5, 0), (1.0, 1)], [(4.0, 0)], [(0.25, 1), (0.75, 1)]]
    results = launch(workers.reduce_unequal, nprocs=3, args=(per_rank,), timeout_s=60)
    flat = [x for r in per_rank for x in r]
    expected_loss = sum(loss for loss, _ in flat) / len(flat)
    for out in results:
        assert out["count"] == 6 and out["correct"] == 4
        assert out["loss"] == pytest.approx(expected_loss, abs=1e-12)
        assert out["accuracy"] == pytest.approx(4 / 6)
    mean_of_means = sum(sum(l for l, _ in r) / len(r) for r in per_rank) / 3
    assert abs(mean_of_means - expected_loss) > 0.1  # the bug we avoid would be visible


def test_ddp_2x32_equals_one_process_with_64():
    torch.manual_seed(0)
    state = Net().state_dict()
    data, target = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    lr = 0.1
    ref = Net()
    ref.load_state_dict(state)
    ref.eval()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    F.nll_loss(ref(data), target).backward()
    opt.step()
    results = launch(workers.ddp_one_step, nprocs=2, args=(state, data, target, lr), timeout_s=120)
    for params in results:
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0)
        assert not torch.equal(params["fc2.weight"], state["fc2.weight"])  # the step did change weights
