#!/bin/bash
# Lesson 04 on Slurm in an Apptainer container: slurm_submit_ddp_multinode.sh with torchrun and the training
# processes inside a container image. Slurm, srun, the rendezvous address and this script stay on the host;
# srun starts one `apptainer exec --nv <image> torchrun ...` per node.
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   apptainer pull pytorch.sif docker://pytorch/pytorch:<tag>    # once, on a login node: an image with torch
#   APPTAINER_IMAGE=$PWD/pytorch.sif sbatch 04_ddp_training/slurm_submit_ddp_apptainer.sh --epochs 3
#
# Arguments after the script name go to mnist_ddpmodel.py. Log: logs/ddp-apptainer-<jobid>.out; checkpoints:
# runs/ddp-apptainer-<jobid>/ (OUTPUT_ROOT changes runs/; it is bound into the container, so an
# --output-dir of yours must be a bound folder too). The image (APPTAINER_IMAGE) and the host's NCCL network
# plugin (NCCL_PLUGIN_DIR) are set in slurm/site.sh. World size = nodes x GPUs per node.
#
# What the container gets (Apptainer's documentation: "Environment and Metadata", "Bind Paths and Mounts", "GPU
# Support"):
#   --nv       the host's NVIDIA devices and driver libraries, on LD_LIBRARY_PATH inside
#   --bind     the course (code, and PYTHONPATH points there), the data and the output folder, at the same paths.
#              $HOME, /tmp and the current folder are bound by default on most sites; the rest is not
#   environment: the host's is passed in by default (not with --cleanenv), except PATH and LD_LIBRARY_PATH,
#              which the container resets, and variables the image itself sets. What matters here passes: the
#              rendezvous (MASTER_ADDR, MASTER_PORT), SLURM_* (the training reads SLURM_JOB_ID), NCCL_* and
#              TORCH_* of slurm/site.sh, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS and PYTHONPATH. To set a variable
#              only inside: APPTAINERENV_<NAME>=value.
# Preemption by the site (PreemptMode=REQUEUE) requeues the job, which resumes from its last finished epoch. After a
# time limit, submit again with --output-dir runs/ddp-apptainer-<old job id>: it resumes the same way.
#SBATCH --job-name=ddp-apptainer
#SBATCH --nodes=2                  # nodes; each runs one container with one torchrun
#SBATCH --ntasks-per-node=1        # ONE task per node: torchrun, which starts the per-GPU processes itself
#SBATCH --gpus-per-node=2          # GPUs per node; each torchrun starts one process per GPU
##SBATCH --gres=gpu:2              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=8          # CPUs per node for ALL its processes, split between them below
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out    # relative to the folder you ran sbatch in; %x = job name, %j = job id
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # shared set-up; sites: slurm/site.sh
stage_data  # STAGE_DATA=1 (slurm/site.sh): copy the data set to each node's local disk once, read it there

[ -n "${APPTAINER_IMAGE:-}" ] || { echo "error: APPTAINER_IMAGE is not set: name your image (.sif) in slurm/site.sh" \
    "or on the sbatch line (APPTAINER_IMAGE=/path/to/pytorch.sif sbatch ...)" >&2; exit 1; }
command -v apptainer >/dev/null || { echo "error: no apptainer command on $(hostname): load it" \
    "(MODULES=\"apptainer\" in slurm/site.sh) or ask your site which container runtime it has" >&2; exit 1; }
split_cpus_for_torchrun  # NPROC_PER_NODE: one process per GPU (or yours); CPUS_PER_PROC, NUM_WORKERS: their share
mkdir -p "$OUTPUT_DIR"   # a bind source must exist
BINDS=(--bind "$COURSE_DIR" --bind "$WORKSHOP_DATA_DIR" --bind "$OUTPUT_DIR")
# Fabrics that need a network plugin (AWS EFA, HPE Slingshot: aws-ofi-nccl, see slurm/site.sh): the image's NCCL
# must load the HOST's plugin, built for the host's fabric libraries. Bind its folder (read-only) and put it on the
# container's library path, which Apptainer otherwise resets. Some sites need more binds for the plugin's own
# libraries (libfabric, e.g. /opt/amazon/efa): add them to NCCL_PLUGIN_DIR's line in slurm/site.sh as you find them.
if [ -n "${NCCL_PLUGIN_DIR:-}" ]; then
    BINDS+=(--bind "$NCCL_PLUGIN_DIR:$NCCL_PLUGIN_DIR:ro")
    export APPTAINERENV_LD_LIBRARY_PATH=$NCCL_PLUGIN_DIR:/.singularity.d/libs  # /.singularity.d/libs: --nv's libraries
fi
echo "== tasks ${SLURM_NTASKS:-?} (one container + torchrun per node) | GPUs per node ${SLURM_GPUS_ON_NODE:-0} | processes per node $NPROC_PER_NODE -> world size $((SLURM_NNODES * NPROC_PER_NODE)) | CPUs per process $CPUS_PER_PROC (DataLoader workers $NUM_WORKERS)"
echo "== image $APPTAINER_IMAGE | ${BINDS[*]} | rendezvous $MASTER_ADDR:$MASTER_PORT (c10d, id $SLURM_JOB_ID)"

# As in slurm_submit_ddp_multinode.sh, with torchrun inside the container.
srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    apptainer exec --nv "${BINDS[@]}" "$APPTAINER_IMAGE" \
    torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
    "$COURSE_DIR/04_ddp_training/mnist_ddpmodel.py" --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" --resume auto "$@"
