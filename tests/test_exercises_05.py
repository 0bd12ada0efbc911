"""Lesson 05's exercises (05_multigpu_fsdp_training/README.md#exercises), on CPU with gloo: each solution run as the
learner runs it, and the outcome the exercise asks the learner to see asserted. Everything is written under tmp_path."""
import os
import re
import subprocess
import sys

from lessons import ROOT, assert_clean, run_script

SOLUTIONS = ROOT / "05_multigpu_fsdp_training" / "solutions"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(script, nproc: int, *args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(script), *map(str, args)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=180)


def test_ex1_a_checkpoint_of_2_ranks_loads_on_3_with_the_same_weights(synthetic_dir, tmp_path):
    flags = ["--data", "synthetic", "--data-dir", synthetic_dir, "--test-samples", 101]
    trained = run_script("05", *flags, "--train-samples", 256, "--epochs", 1, "--num-workers", 0,
                         "--output-dir", tmp_path, nproc=2)
    assert_clean(trained)
    checkpoint = tmp_path / "checkpoints" / "05-epoch-001"
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    proc = torchrun(SOLUTIONS / "same_weights.py", 3, checkpoint, *flags)
    assert_clean(proc)
    rows = sorted(re.findall(r"^\[rank (\d)\] loaded my shards: fc1.weight rows (\d+) of 128$", proc.stdout, re.M))
    assert rows == [("0", "43"), ("1", "43"), ("2", "42")], proc.stdout  # torch.chunk: 43 + 43 + 42
    assert "OK: loaded on 3 ranks and gathered, the weights equal the checkpoint's: all 8 tensors, bit for bit\n" \
        in proc.stdout, proc.stdout
    printed = re.search(r"^epoch 1: test loss \S+, accuracy (\d+)/101,", trained.stdout, re.M)
    assert f"OK: a plain Net with these weights scores {printed.group(1)}/101 on the test set" in proc.stdout, \
        (trained.stdout, proc.stdout)


def test_ex2_each_rank_holds_its_rows_and_adamw_keeps_a_whole_step_counter():
    proc = torchrun(SOLUTIONS / "shard_bytes.py", 3)
    assert_clean(proc)
    rows = dict(re.findall(r"^\[rank (\d)\] fc1\.weight rows (\d+) of 256", proc.stdout, re.M))
    assert rows == {"0": "86", "1": "86", "2": "84"}, proc.stdout  # torch.chunk: ceil(256 / 3) = 86, the rest 84
    assert proc.stdout.count("step counters 48 B (Tensor, shape (), torch.float32, cpu)") == 3  # 12 tensors x 4 B
    assert re.search(r"^OK: the 3 shards add up to the whole model, 10,050,088 B", proc.stdout, re.M)
    assert "OK: the largest rank holds 0.336 of it (1/3 = 0.333), every rank its torch.chunk rows exactly" in proc.stdout
    assert "OK: AdamW state = 2 x params + 4 B x 12 tensors on every rank" in proc.stdout


def test_ex3_reshard_after_forward_false_keeps_full_weights_and_skips_backward_all_gathers():
    proc = torchrun(SOLUTIONS / "reshard_probe.py", 2)
    assert_clean(proc)
    assert ("reshard_after_forward=True: after forward 0 B of full weights held (model 10,050,088 B); backward: "
            "5 all-gathers, 5 reduce-scatters (5 units)") in proc.stdout
    assert ("reshard_after_forward=False: after forward 10,050,088 B of full weights held (model 10,050,088 B); "
            "backward: 0 all-gathers, 5 reduce-scatters (5 units)") in proc.stdout
    assert proc.stdout.count("\nOK: ") == 3
