#!/bin/bash
# The production trainer's DDP on Slurm, a hyperparameter sweep: a job ARRAY, one task per configuration (one row of a table,
# 04_ddp_training/sweep.tsv: learning rate x seed). The tasks are independent jobs that Slurm runs side by side,
# several on one node if it has room; each gets its own port, output folder and log.
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch 04_ddp_training/slurm_sweep_array.sh --epochs 3            # the 4 rows of sweep.tsv: --array=0-3
#   sbatch --array=0-3%2 04_ddp_training/slurm_sweep_array.sh         # at most 2 tasks running at a time
#   SWEEP_TABLE=my_sweep.tsv sbatch --array=0-7 04_ddp_training/slurm_sweep_array.sh
#   python slurm/gather_sweep.py runs/sweep-<array job id>             # all tasks: one table, one plot
#
# Arguments after the script name go to trainer/train.py --parallel ddp (lesson 04's DDP with the trainer's
# metrics.json, which slurm/gather_sweep.py reads), after the row's flags (so they win over the table).
# Log: logs/sweep-<array job id>_<task>.out; metrics: runs/sweep-<array job id>/task-<task>/ (OUTPUT_ROOT
# changes runs/). Shape of EACH task: srun style, one task per GPU; 1 GPU by default (the configurations run side
# by side); raise --ntasks-per-node and --gpus-per-node together for DDP inside each configuration.
#SBATCH --job-name=sweep
#SBATCH --array=0-3                # one index per configuration of the table, from 0; %N limits running tasks
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1        # one task per GPU: srun starts every training process itself
#SBATCH --gpus-per-node=1          # keep equal to --ntasks-per-node
##SBATCH --gres=gpu:1              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=4          # per process: DataLoader workers = this - 1
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%A_%a.out # %x = job name, %A = the array's job id, %a = this task's index
# Time limit and preemption, as in slurm_submit_ddp_srun.sh: each task stops at SIGUSR1, saves, requeues itself
# (its own job id, so the same folder) and resumes (slurm/README.md, "Time limits").
#SBATCH --signal=USR1@120          # raise the 120 if saving a checkpoint takes longer than a minute
#SBATCH --requeue                  # the task may go back to the queue: on preemption, or by itself on SIGUSR1
#SBATCH --open-mode=append         # a requeued task appends to the same log instead of overwriting it
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # shared set-up; sites: slurm/site.sh
stage_data  # STAGE_DATA=1 (slurm/site.sh): copy the data set to each node's local disk once, read it there

sweep_row "${SWEEP_TABLE:-$COURSE_DIR/04_ddp_training/sweep.tsv}"  # SWEEP_ARGS: this task's row, as flags
echo "== array job $SLURM_ARRAY_JOB_ID task $SLURM_ARRAY_TASK_ID (of ${SLURM_ARRAY_TASK_COUNT:-?}) on $(hostname):" \
     "${SWEEP_ARGS[*]} | rendezvous $MASTER_ADDR:$MASTER_PORT | output $OUTPUT_DIR"

# --cpus-per-task again: from Slurm 22.05 on, srun may not inherit it from sbatch.
# --resume auto: continue from the newest checkpoint in OUTPUT_DIR (after a requeue), else start fresh.
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python "$COURSE_DIR/trainer/train.py" --parallel ddp "${SWEEP_ARGS[@]}" --output-dir "$OUTPUT_DIR" --resume auto "$@"
