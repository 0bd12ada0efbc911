#!/bin/bash
# Lesson 05 on Slurm, several nodes: srun starts ONE torchrun per node, each torchrun starts one process per
# GPU of its node, the torchruns meet on the first node, and the lesson's 1-D mesh shards over ALL of them.
# HSDP (sharded within a node, replicated across nodes) is the trainer's: trainer/train.py --parallel fsdp2
# --hsdp (trainer/README.md).
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch 05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh --epochs 3
#   sbatch --nodes=4 -A my_account -p my_partition 05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh
#
# Arguments after the script name go to mnist_fsdpmodel.py. Log: logs/fsdp-multinode-<jobid>.out;
# checkpoints: runs/fsdp-multinode-<jobid>/ in the course folder (OUTPUT_ROOT changes runs/).
# World size = nodes x GPUs per node. Change --nodes and --gpus-per-node; nothing else.
# Help and troubleshooting: slurm/README.md.
#SBATCH --job-name=fsdp-multinode
#SBATCH --nodes=2                  # nodes; each runs one torchrun
#SBATCH --ntasks-per-node=1        # ONE task per node: torchrun, which starts the per-GPU processes itself
#SBATCH --gpus-per-node=2          # GPUs per node; each torchrun starts one process per GPU
##SBATCH --gres=gpu:2              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=8          # CPUs per node for ALL its processes, split between them below
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
echo "== tasks ${SLURM_NTASKS:-?} (one torchrun per node) | GPUs per node ${SLURM_GPUS_ON_NODE:-0} | processes per node $NPROC_PER_NODE -> world size $((SLURM_NNODES * NPROC_PER_NODE)) | CPUs per process $CPUS_PER_PROC (DataLoader workers $NUM_WORKERS)"
echo "== rendezvous $MASTER_ADDR:$MASTER_PORT (c10d, id $SLURM_JOB_ID)"

# --ntasks/--ntasks-per-node: exactly one torchrun per node, whatever the #SBATCH lines say.
# --cpus-per-task again: from Slurm 22.05 on, srun may not inherit it from sbatch.
# --resume auto: continue from the newest checkpoint in OUTPUT_DIR (after a requeue), else start fresh.
srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
    "$COURSE_DIR/05_multigpu_fsdp_training/mnist_fsdpmodel.py" --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" --resume auto "$@"
