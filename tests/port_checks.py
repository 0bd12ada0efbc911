"""tests/test_port.py's checks: what each rank's record and the printed lines of a port's run (tests/port_runs.py) must
show. Each check raises AssertionError when its item is missing:
  finishes        every process exits 0 within the deadline, with no Python warning
  shards          each epoch, the ranks trained on disjoint shards that together are the training set once
  new_order       each rank's order differs between epochs
  one_writer      torch.save ran on rank 0 only (seen by a sitecustomize wrapped around torch.save, outside the port)
  train_loss      the printed train loss is the sum of every rank's losses over the sum of their images
  exact_test      the saved epoch's printed test line equals one plain process evaluating the saved weights
  replicas        the ranks hold the same weights after each epoch (a checksum each rank records)
  plain_keys      the saved weights load into train.py's Net: its names, no "module." prefix
  leaves_group    every rank called destroy_process_group (seen by the same sitecustomize)
  same_as_ddp     train_fsdp.py's weights equal train_ddp.py's, same flags
  starts_from     every rank starts from the --init-from file's weights (the whole of them, or its shard)
  schedule_ends   every rank's cosine (--cosine) ends at a learning rate of 0: the run took the steps it was built for
What each rank trained on, its checksum and learning rate come from the ports' test hook (debug_record,
PORT_DEBUG_DIR).
"""
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from port_runs import TRAIN, TRAIN_PY


def weights(run) -> dict:
    return torch.load(run.checkpoint, weights_only=True)


def check_finishes(run, reference=None):
    assert not run.hung and run.returncodes == [0] * len(run.returncodes) and "Warning" not in run.output, \
        f"did not finish ({'stopped at the deadline' if run.hung else run.returncodes}): {run.output[-3000:]}"


def check_shards(run, reference=None):
    for e in range(2):
        shards = [run.records[r][e]["indices"] for r in (0, 1)]
        assert sorted(shards[0] + shards[1]) == list(range(TRAIN)), f"epoch {e + 1}: shards overlap or miss images"


def check_new_order(run, reference=None):
    for r in (0, 1):
        assert run.records[r][0]["indices"] != run.records[r][1]["indices"], f"rank {r}: same order in both epochs"


def check_one_writer(run, reference=None):
    assert run.saves and set(run.saves) == {"0"}, f"torch.save called by ranks {run.saves}"


def check_train_loss(run, reference=None):
    assert len(run.epochs) == 2, run.output[-2000:]
    for e, printed in enumerate(run.epochs):
        loss_sum, seen = (sum(run.records[r][e]["train"][i] for r in (0, 1)) for i in (0, 1))
        assert seen == TRAIN and printed["train_loss"] == pytest.approx(loss_sum / seen, abs=6e-5), \
            f"epoch {e + 1}: printed train loss {printed['train_loss']}, all ranks' mean {loss_sum / seen:.4f}"


def check_exact_test(run, reference=None):
    """One plain process (train.py's own evaluate) on the saved weights and the whole test set, against the line of
    the epoch whose weights were saved last: the one with the lowest printed test loss."""
    best = min(run.epochs, key=lambda e: e["test_loss"])
    assert run.saved_epochs[-1] == best["epoch"], f"saved epochs {run.saved_epochs}, printed {run.epochs}"
    model = TRAIN_PY.Net()
    model.load_state_dict(weights(run))
    _, test_set = TRAIN_PY.load_data(SimpleNamespace(data_dir=run.data_dir, train_samples=1,
                                                     test_samples=run.test_samples))
    loss_sum, correct, total = TRAIN_PY.evaluate(model, DataLoader(test_set, batch_size=1000), torch.device("cpu"))
    assert (best["correct"], best["total"]) == (correct, total) == (correct, run.test_samples), \
        f"test counts: printed {best}, one process {correct}/{total}"
    assert best["test_loss"] == pytest.approx(loss_sum / total, abs=1e-4), \
        f"test loss: printed {best}, one process {loss_sum / total:.4f}"


def check_replicas(run, reference=None):
    for e in range(2):
        assert run.records[0][e]["checksum"] == run.records[1][e]["checksum"], f"epoch {e + 1}: replicas differ"


def check_plain_keys(run, reference=None):
    names = sorted(weights(run))
    assert names == sorted(TRAIN_PY.Net().state_dict()), f"saved names are not Net's: {names[:2]}, ..."


def check_leaves_group(run, reference=None):
    assert sorted(run.destroys) == ["0", "1"], f"destroy_process_group called by ranks {run.destroys}"


def check_same_as_ddp(run, reference):
    mine, ddp = weights(run), weights(reference)
    assert mine.keys() == ddp.keys()
    for name in ddp:
        torch.testing.assert_close(mine[name], ddp[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def check_starts_from(run, reference=None):
    """Each rank's checksum before training: DDP's replicas hold the whole file, FSDP2's ranks their chunk (dim 0)."""
    net = TRAIN_PY.Net()
    net.load_state_dict(torch.load(run.init_from, map_location="cpu", weights_only=True))
    for r in (0, 1):
        whole, shard = (sum(x.sum().item() for x in xs) for xs in
                        (net.parameters(), [p.chunk(2)[r] for p in net.parameters() if len(p.chunk(2)) > r]))
        assert any(run.starts[r] == [pytest.approx(s, abs=1e-4)] for s in (whole, shard)), \
            f"rank {r} starts from other weights than the file's: checksum {run.starts[r]}, the file's {whole:.4f}"


def check_schedule_ends(run, reference=None):
    for r in (0, 1):
        lr = run.records[r][-1]["lr"]
        assert lr < 1e-8, f"rank {r}: learning rate at the end {lr:.2e}, not 0: the cosine was built for other steps"


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}
FAILS_WITH = {"finishes": "did not finish", "shards": "shards overlap", "new_order": "same order",
              "one_writer": "torch.save called by ranks", "train_loss": "printed train loss", "exact_test": "printed",
              "replicas": "replicas differ", "plain_keys": "saved names are not Net's",
              "leaves_group": "destroy_process_group called by ranks",
              "same_as_ddp": "not close", "starts_from": "starts from other weights",
              "schedule_ends": "learning rate at the end"}  # the message that says the check failed, not another error
DDP_CHECKS = ["finishes", "shards", "new_order", "one_writer", "train_loss", "exact_test", "replicas", "plain_keys",
              "leaves_group", "schedule_ends"]
