#!/bin/bash
# Lesson 04 on Slurm, any number of nodes, without torchrun: srun starts every training process
# (one task per GPU) and common/distributed.py reads SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS.
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch 04_ddp_training/slurm_submit_ddp_srun.sh --epochs 3
#   sbatch --nodes=4 -A my_account -p my_partition 04_ddp_training/slurm_submit_ddp_srun.sh
#
# Arguments after the script name go to mnist_ddpmodel.py. Log: logs/ddp-srun-<jobid>.out;
# checkpoints: runs/ddp-srun-<jobid>/ in the course folder (OUTPUT_ROOT changes runs/).
# World size = nodes x tasks per node. Keep --ntasks-per-node equal to --gpus-per-node. Sites that bind
# one GPU to each task: add --gpus-per-task=1 (below, or on the sbatch line); each task then sees only its
# own GPU, as cuda:0, and the training code uses that one whatever its local rank.
# The same job with torchrun: slurm_submit_ddp_multinode.sh. Help and troubleshooting: slurm/README.md.
#SBATCH --job-name=ddp-srun
#SBATCH --nodes=2                  # nodes
#SBATCH --ntasks-per-node=2        # ONE task per GPU: srun starts every training process itself
#SBATCH --gpus-per-node=2          # keep equal to --ntasks-per-node
##SBATCH --gres=gpu:2              # sites that do not know --gpus-per-node: use this line instead
##SBATCH --gpus-per-task=1         # sites that want each task bound to one GPU: switch this line on too
#SBATCH --cpus-per-task=4          # per process: DataLoader workers = this - 1
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out    # relative to the folder you ran sbatch in; %x = job name, %j = job id
# Preemption: a requeued job keeps its id and resumes from its last finished epoch (--resume auto below). The
# lesson script saves only after each epoch: a time-limit warning (--signal) would find nothing to act on; the
# trainer's template, trainer/slurm_train.sh, saves and requeues on it (trainer/README.md).
#SBATCH --requeue                  # the job may go back to the queue on preemption
#SBATCH --open-mode=append         # a requeued run appends to the same log instead of overwriting it
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # shared set-up; sites: slurm/site.sh
stage_data  # STAGE_DATA=1 (slurm/site.sh): copy the data set to each node's local disk once, read it there

GPUS_ON_NODE=${SLURM_GPUS_ON_NODE:-0}
if (( GPUS_ON_NODE > 0 )) && [ "${SLURM_NTASKS_PER_NODE:-$GPUS_ON_NODE}" != "$GPUS_ON_NODE" ]; then
    echo "warning: $SLURM_NTASKS_PER_NODE tasks per node but $GPUS_ON_NODE GPUs per node: this style wants one task per GPU" >&2
fi
echo "== tasks ${SLURM_NTASKS:-?} (one per GPU) -> world size ${SLURM_NTASKS:-?} | GPUs per node $GPUS_ON_NODE" \
     "${SLURM_GPUS_PER_TASK:+(per task $SLURM_GPUS_PER_TASK) }| CPUs per task ${SLURM_CPUS_PER_TASK:-1}"
echo "== rendezvous $MASTER_ADDR:$MASTER_PORT (env://, rank 0 listens)"
show_tasks  # one line per task: its node, local rank and the GPUs it sees

# --cpus-per-task again: from Slurm 22.05 on, srun may not inherit it from sbatch.
# --resume auto: continue from the newest checkpoint in OUTPUT_DIR (after a requeue), else start fresh.
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python "$COURSE_DIR/04_ddp_training/mnist_ddpmodel.py" --output-dir "$OUTPUT_DIR" --resume auto "$@"
