#!/bin/bash
# Lesson 07 on Slurm, several nodes, 2-D: srun starts ONE torchrun per node, each torchrun starts one
# process per GPU of its node, the torchruns meet on the first node, and --dp GPUs-per-node builds the mesh
# (nodes, GPUs per node): one pipeline STAGE per node (node 1 holds stage 0, node 2 stage 1, ...: only the
# activations of each micro-batch and their gradients cross between nodes, point to point), and FSDP2 among
# the GPUs of a node (its all-gathers and reduce-scatters, once per unit, stay on the fast links inside it).
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch 07_pipeline_parallel/slurm_submit_pp.sh --epochs 3 --pp-schedule 1f1b --microbatches 4
#   sbatch --nodes=4 -A my_account -p my_partition 07_pipeline_parallel/slurm_submit_pp.sh
#
# Arguments after the script name go to mnist_ppmodel.py. Log: logs/pp-2d-<jobid>.out;
# checkpoints: runs/pp-2d-<jobid>/ in the course folder (OUTPUT_ROOT changes runs/).
# World size = nodes x GPUs per node; stages = nodes (--blocks nodes - 1 or more: a middle stage holds blocks only).
# Change --nodes and --gpus-per-node; nothing else. More --microbatches, a smaller bubble. Help: slurm/README.md.
#SBATCH --job-name=pp-2d
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
echo "== mesh: pp $SLURM_NNODES (a pipeline stage per node) x dp $NPROC_PER_NODE (FSDP2 inside each node)"
echo "== rendezvous $MASTER_ADDR:$MASTER_PORT (c10d, id $SLURM_JOB_ID)"

# --ntasks/--ntasks-per-node: exactly one torchrun per node, whatever the #SBATCH lines say.
# --cpus-per-task again: from Slurm 22.05 on, srun may not inherit it from sbatch.
# --dp: the processes of a node (consecutive ranks: a row of the (pp, dp) mesh) hold the same stage, FSDP2 among
# them; pp-rank = node. Stage 0 reads the images, the last stage the labels: a pipeline's stages, the same batch.
# --resume auto: continue from the newest checkpoint in OUTPUT_DIR (after a requeue), else start fresh.
srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
    "$COURSE_DIR/07_pipeline_parallel/mnist_ppmodel.py" --dp "$NPROC_PER_NODE" --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" --resume auto "$@"
