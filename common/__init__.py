"""Plumbing shared by the lessons and the trainer; what each lesson teaches is written out in its own script.

What the lesson scripts take (at most eight names each):
  cli                the flags: lesson_parser (the lessons' 14), base_parser (the trainer's); one-line mistakes
  data               MNIST (or synthetic digits) as datasets; rank 0 prepares the files, the others wait
  distributed        launch_env (torchrun or srun -> what init_process_group reads), pick_device (cuda:LOCAL_RANK)
  samplers           EvalSampler: the test set sharded without padding, every image counted once
  model              Net, the classic MNIST CNN of pytorch/examples
  epoch_checkpoints  EpochCheckpoints: one checkpoint per epoch, renamed into place, a used folder refused
  exits              run(main): a mistake a user can fix is one line and exit 2; Ctrl-C one line and exit 130
What the trainer and lesson 08 use besides (each in docs/common.md):
  checkpoints        CheckpointDir: mid-epoch checkpoints, resume rules, best and newest N
  config             --config files and the config.yaml a run writes
  curves             curves.png from metrics.json
  download           the MNIST files checked, extracted or downloaded; the synthetic ones written
  early_stopping     --target-accuracy and --patience
  errors             CourseError, one_line
  files              all-or-nothing files and folders; relative paths are the course folder's
  gpus               which GPUs a node has, and why torch may not use them
  history            the epoch line, metrics.json, curves, TensorBoard
  hostlist           Slurm node lists expanded
  launcher           N gloo workers started from a notebook
  loaders            the default --num-workers; DataLoader options; the data set on the device
  log                log0, log_all, progress lines
  metrics            EpochMeter: loss and accuracy sums, all_reduced
  position           where an interrupted epoch stopped
  rank_states        every rank's random state for a checkpoint
  signals            StopSignals: SIGINT/SIGTERM/SIGUSR1 as a stop the ranks vote on
  synthetic          deterministic synthetic digits as IDX files
"""
import importlib.util as _util
import sys as _sys

# A lesson run by a Python whose torch came from elsewhere (a cluster's `module load`) may lack the course's
# other packages: one line naming the fix, not a ModuleNotFoundError traceback. (pip name, import name)
_missing = [pip for pip, module in (("torch", "torch"), ("tqdm", "tqdm"), ("pyyaml", "yaml"),
                                    ("matplotlib", "matplotlib")) if _util.find_spec(module) is None]
if _missing:
    raise SystemExit(f"error: {', '.join(_missing)} not installed for {_sys.executable}: activate the course's "
                     f"environment (source .venv/bin/activate, or conda activate dist-pytorch-course), or "
                     f"`pip install {' '.join(_missing)}` into this Python")
