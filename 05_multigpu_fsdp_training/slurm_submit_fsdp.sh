#!/bin/bash
# Lesson 05 on Slurm, one node: FSDP2 (fully_shard), torchrun starts one process per GPU.
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch 05_multigpu_fsdp_training/slurm_submit_fsdp.sh --epochs 3
#   sbatch -A my_account -p my_partition 05_multigpu_fsdp_training/slurm_submit_fsdp.sh
#
# Arguments after the script name go to mnist_fsdpmodel.py. Log: logs/fsdp-<jobid>.out;
# checkpoints: runs/fsdp-<jobid>/ in the course folder (OUTPUT_ROOT changes runs/).
# Shape: 1 node, 1 task: torchrun, which starts one process per GPU (--nproc_per_node is read
# from the GPUs Slurm gave). More GPUs: change --gpus-per-node (and --cpus-per-task) only.
# More nodes: see slurm_submit_ddp_multinode.sh. Help and troubleshooting: slurm/README.md.
#SBATCH --job-name=fsdp
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1        # ONE task: torchrun, which starts the per-GPU processes itself
#SBATCH --gpus-per-node=2          # GPUs to use; torchrun starts one process per GPU
##SBATCH --gres=gpu:2              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=8          # CPUs for ALL processes of the node, split between them below
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out    # relative to the folder you ran sbatch in; %x = job name, %j = job id
# Preemption: a requeued job keeps its id and continues from its last finished epoch (--resume auto below).
# A checkpoint on Slurm's warning before the time limit (--signal=USR1@120) is the trainer's: trainer/README.md.
#SBATCH --requeue                  # the job may go back to the queue on preemption
#SBATCH --open-mode=append         # a requeued run appends to the same log instead of overwriting it
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # shared set-up; sites: slurm/site.sh
stage_data  # STAGE_DATA=1 (slurm/site.sh): copy the data set to each node's local disk once, read it there

split_cpus_for_torchrun  # NPROC_PER_NODE: one process per GPU (or yours); CPUS_PER_PROC, NUM_WORKERS: their share
echo "== 1 task (torchrun) | GPUs ${SLURM_GPUS_ON_NODE:-0} | processes $NPROC_PER_NODE | CPUs ${SLURM_CPUS_PER_TASK:-1}, per process $CPUS_PER_PROC (DataLoader workers $NUM_WORKERS)"
echo "== rendezvous: localhost, a free port (torchrun --standalone)"

# srun, although one task needs no launcher: `scancel` and Slurm's signals reach the processes of the job's
# srun steps, not this batch shell or what it runs itself.
# --resume auto: continue from the newest checkpoint in OUTPUT_DIR (after a requeue), else start fresh.
srun --kill-on-bad-exit=1 --ntasks=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" \
    "$COURSE_DIR/05_multigpu_fsdp_training/mnist_fsdpmodel.py" --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" --resume auto "$@"
