#!/bin/bash
# Lesson 02 on Slurm: the baseline, one process on one GPU.
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch 02_singlegpu_training/slurm_submit_singlegpu.sh --epochs 3
#   sbatch -A my_account -p my_partition 02_singlegpu_training/slurm_submit_singlegpu.sh
#
# Arguments after the script name go to mnist_singlegpu.py. Log: logs/mnist-1gpu-<jobid>.out;
# checkpoints: runs/mnist-1gpu-<jobid>/ in the course folder (OUTPUT_ROOT changes runs/).
# Shape: 1 task, 1 GPU. Help: slurm/README.md.
#SBATCH --job-name=mnist-1gpu
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
##SBATCH --gres=gpu:1              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=4          # DataLoader workers = this - 1 (the script reads SLURM_CPUS_PER_TASK)
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out    # relative to the folder you ran sbatch in; %x = job name, %j = job id
# No --signal here: the lesson script catches no signal. It saves a checkpoint after every epoch, and a job
# cut short continues from the last finished one when resubmitted with its OUTPUT_DIR (--resume auto below).
# Stopping cleanly before the time limit, and requeueing: the trainer's template (trainer/README.md).
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # shared set-up; sites: slurm/site.sh
stage_data  # STAGE_DATA=1 (slurm/site.sh): copy the data set to each node's local disk once, read it there

echo "== 1 process | GPUs ${SLURM_GPUS_ON_NODE:-0} (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-none}) | CPUs ${SLURM_CPUS_PER_TASK:-1}"

# srun, although one process needs no launcher: the job's processes then run as a job step, as in lessons 04-05.
# --resume auto: continue with the epoch after the newest checkpoint in OUTPUT_DIR (a resubmission with the same
# OUTPUT_DIR), else start fresh.
srun --kill-on-bad-exit=1 --ntasks=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python "$COURSE_DIR/02_singlegpu_training/mnist_singlegpu.py" --output-dir "$OUTPUT_DIR" --resume auto "$@"
