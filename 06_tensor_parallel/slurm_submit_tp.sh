#!/bin/bash
# Lesson 06 on Slurm, several nodes, 2-D: srun starts ONE torchrun per node, each torchrun starts one
# process per GPU of its node, the torchruns meet on the first node, and --tp GPUs-per-node builds the mesh
# (nodes, GPUs per node): tensor parallelism among the GPUs of a node (an all-reduce per block, on the fast
# links inside the node), FSDP2 across the nodes (all-gathers and reduce-scatters, once per unit).
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch 06_tensor_parallel/slurm_submit_tp.sh --epochs 3 --blocks 4 --hidden 1024
#   sbatch --nodes=4 -A my_account -p my_partition 06_tensor_parallel/slurm_submit_tp.sh
#
# Arguments after the script name go to mnist_tpmodel.py. Log: logs/tp-2d-<jobid>.out;
# checkpoints: runs/tp-2d-<jobid>/ in the course folder (OUTPUT_ROOT changes runs/).
# World size = nodes x GPUs per node. Change --nodes and --gpus-per-node; nothing else.
# TP never crosses a node here: its all-reduces wait on every block. Help and troubleshooting: slurm/README.md.
#SBATCH --job-name=tp-2d
#SBATCH --nodes=2                  # nodes; each runs one torchrun
#SBATCH --ntasks-per-node=1        # ONE task per node: torchrun, which starts the per-GPU processes itself
#SBATCH --gpus-per-node=2          # GPUs per node; each torchrun starts one process per GPU
##SBATCH --gres=gpu:2              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=8          # CPUs per node for ALL its processes, split between them below
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out    # relative to the folder you ran sbatch in; %x = job name, %j = job id
# Preemption: Slurm may requeue the job (same id, same log); --resume auto below continues from the last
# finished epoch. Stopping cleanly before a time limit (SIGUSR1): trainer/slurm_train.sh (trainer/README.md).
#SBATCH --requeue                  # the job may go back to the queue on preemption
#SBATCH --open-mode=append         # a requeued run appends to the same log instead of overwriting it
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # shared set-up; sites: slurm/site.sh
stage_data  # STAGE_DATA=1 (slurm/site.sh): copy the data set to each node's local disk once, read it there

split_cpus_for_torchrun  # NPROC_PER_NODE: one process per GPU (or yours); CPUS_PER_PROC, NUM_WORKERS: their share
echo "== tasks ${SLURM_NTASKS:-?} (one torchrun per node) | GPUs per node ${SLURM_GPUS_ON_NODE:-0} | processes per node $NPROC_PER_NODE -> world size $((SLURM_NNODES * NPROC_PER_NODE)) | CPUs per process $CPUS_PER_PROC (DataLoader workers $NUM_WORKERS)"
echo "== mesh: dp $SLURM_NNODES (FSDP2 across the nodes) x tp $NPROC_PER_NODE (TP inside each node)"
echo "== rendezvous $MASTER_ADDR:$MASTER_PORT (c10d, id $SLURM_JOB_ID)"

# --ntasks/--ntasks-per-node: exactly one torchrun per node, whatever the #SBATCH lines say.
# --cpus-per-task again: from Slurm 22.05 on, srun may not inherit it from sbatch.
# --tp: one TP group per node (the processes of a node are consecutive ranks: the mesh's "tp" rows).
# --resume auto: continue from the newest checkpoint in OUTPUT_DIR (after a requeue), else start fresh.
srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
    "$COURSE_DIR/06_tensor_parallel/mnist_tpmodel.py" --tp "$NPROC_PER_NODE" --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" --resume auto "$@"
