"""Lesson 04's exercises (04_ddp_training/README.md#exercises): each solution patch applied to a COPY of the
lesson script in a tmp folder, run on CPU with gloo and 2 ranks, and the outcome the exercise asks for asserted."""
import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

from common.distributed import free_port
from lessons import ROOT, SCRIPTS, assert_clean

SOLUTIONS = ROOT / "04_ddp_training" / "solutions"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture
def small(synthetic_dir):
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0", "--test-samples", 64]


def patched_copy(folder, *patches):
    """The lesson script copied into `folder` (never the lesson folder), with the solution patches applied in order."""
    copy = folder / "ddp.py"
    shutil.copy(SCRIPTS["04"], copy)
    for name in patches:
        subprocess.run(["patch", "--quiet", str(copy), str(SOLUTIONS / name)], check=True)
    return copy


def torchrun(script, *args, launch=("--standalone", "--nproc_per_node=2")):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, str(script), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)


def finish(proc, timeout=120):
    """Wait for a launch; fail on a non-zero exit or a Python warning; its stdout."""
    out, err = proc.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert_clean(done)
    return done.stdout


def first_indices(out):
    """{(rank, epoch): the first five training indices that rank printed for that epoch} (exercise 1's patch)."""
    return {(int(rank), int(epoch)): ast.literal_eval(indices)
            for rank, epoch, indices in re.findall(r"^\[rank (\d+)\] epoch (\d+): first indices (\[.*\])$", out, re.M)}


def test_ex1_without_set_epoch_every_epoch_repeats_the_order(tmp_path, small):
    args = [*small, "--train-samples", 256, "--epochs", 3]
    with_it = first_indices(finish(torchrun(patched_copy(tmp_path, "ex1_show_order.patch"), *args,
                                            "--output-dir", tmp_path / "with")))
    without = first_indices(finish(torchrun(patched_copy(tmp_path, "ex1_show_order.patch", "ex1_no_set_epoch.patch"),
                                            *args, "--output-dir", tmp_path / "without")))
    assert sorted(with_it) == sorted(without) == [(r, e) for r in (0, 1) for e in (1, 2, 3)]
    for rank in (0, 1):
        assert len({tuple(with_it[rank, e]) for e in (1, 2, 3)}) == 3  # set_epoch: a new order every epoch
        assert without[rank, 1] == without[rank, 2] == without[rank, 3]  # without it: the same order again
    for epoch in (1, 2, 3):  # either way the two ranks draw disjoint shards
        assert not set(with_it[0, epoch]) & set(with_it[1, epoch])


def shards_line(folder, patches, args):
    """Exercise 2's launch: two torchrun "nodes" of one process each on localhost; rank 0's `shards:` line."""
    script, port = patched_copy(folder, *patches), free_port()
    nodes = [torchrun(script, *args, "--output-dir", folder / "run",
                      launch=("--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                              f"--master_port={port}")) for node in (0, 1)]
    try:
        out = "".join(finish(node) for node in nodes)
    finally:  # one node failed: the other would wait for it until the timeout
        for node in nodes:
            node.kill()
    assert sorted(re.findall(r"^rank (\d) of 2 on cpu", out, re.M)) == ["0", "1"]  # two nodes of one process
    return re.search(r"^shards: .*$", out, re.M).group(0)


def test_ex2_local_rank_sharding_duplicates_samples_across_nodes(tmp_path, small):
    args = [*small, "--train-samples", 512, "--epochs", 1]
    (tmp_path / "global").mkdir(), (tmp_path / "local").mkdir()
    assert shards_line(tmp_path / "global", ["ex2_count_shards.patch"], args) == \
        "shards: 512 indices drawn, 512 distinct of 512 images"  # global rank: every image once
    assert shards_line(tmp_path / "local", ["ex2_count_shards.patch", "ex2_local_rank.patch"], args) == \
        "shards: 512 indices drawn, 256 distinct of 512 images"  # local rank: both nodes train on shard 0


def test_ex3_grad_accumulation_equals_a_larger_batch(tmp_path, small):
    script = patched_copy(tmp_path, "ex3_grad_accum.patch", "ex3_no_dropout.patch")
    args = [*small, "--train-samples", 512, "--epochs", 1]
    runs = {name: finish(torchrun(script, *args, *flags, "--output-dir", tmp_path / name))
            for name, flags in [("batch64", ["--batch-size", 64]), ("accum4", ["--batch-size", 16, "--grad-accum", 4]),
                                ("batch32", ["--batch-size", 32])]}
    loss = {name: float(re.search(r"^epoch 1: test loss (\S+),", out, re.M).group(1)) for name, out in runs.items()}
    assert loss["batch64"] == pytest.approx(loss["accum4"], abs=1e-4)

    def largest_difference(first, second):
        compare = subprocess.run([sys.executable, str(SOLUTIONS / "ex3_compare.py"), tmp_path / first,
                                  tmp_path / second], capture_output=True, text=True, env=ENV, cwd=tmp_path)
        assert_clean(compare)
        return float(re.fullmatch(r"epoch 1: largest difference over 1,199,882 weights: (\S+)\n", compare.stdout)[1])

    # Rounding only (summing 4 means of 16 is not bitwise the mean of 64), where twice the steps differ by far more.
    assert largest_difference("batch64", "accum4") < 1e-3 < largest_difference("batch64", "batch32")
