#!/bin/bash
# Lesson 01 on Slurm: is the software ready on a compute node, and can processes talk?
# Runs check_env.py once per node, then hello_distributed.py in one process per GPU (srun).
#
#   cd <the course folder>; mkdir -p logs        # once: Slurm does not create logs/
#   sbatch 01_setup/slurm_submit_setup.sh         # or: sbatch -A my_account -p my_partition 01_setup/...
#   cat logs/setup-check-<jobid>.out              # expect "verdict: READY" and "OK: ... verified on 2 rank(s)"
#
# Shape: 1 node, one task per GPU (srun starts every process). More GPUs: raise --ntasks-per-node
# and --gpus-per-node together. Help and troubleshooting: slurm/README.md.
#SBATCH --job-name=setup-check
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2        # one task per GPU: srun starts every process itself
#SBATCH --gpus-per-node=2          # keep equal to --ntasks-per-node
##SBATCH --gres=gpu:2              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=1          # per process; a collective test needs little
#SBATCH --time=00:05:00
#SBATCH --output=logs/%x-%j.out    # relative to the folder you ran sbatch in; %x = job name, %j = job id
# ================================ SITE SECTION ================================
# The only part that differs between clusters. It is the same in every script of the course:
# edit it once and copy it. Or leave it alone and set what you need when you submit, e.g.
#     VENV=$HOME/envs/torch sbatch -A my_account -p gpu 04_ddp_training/slurm_submit_ddp.sh
# Account and partition: #SBATCH lines cannot read variables, so either delete ONE '#' below
# to switch a line on, or pass them to sbatch (-A/--account, -p/--partition) as above.
##SBATCH --account=my_account
##SBATCH --partition=my_gpu_partition
set -euo pipefail  # the first command of the script: sbatch ignores #SBATCH lines below it
COURSE_DIR=${COURSE_DIR:-}  # the course folder (holds common/); empty: searched upwards from where you ran sbatch
MODULES=${MODULES:-}        # modules to load, e.g. "cuda/12.4 python/3.11" (`module avail`); empty: none
CONDA_ENV=${CONDA_ENV:-}    # conda environment to activate (name or path); empty: none
VENV=${VENV:-}              # virtualenv folder to activate; empty: $COURSE_DIR/.venv if it exists and no CONDA_ENV
WORKSHOP_DATA_DIR=${WORKSHOP_DATA_DIR:-}  # folder holding MNIST/raw; empty: $COURSE_DIR/data
OUTPUT_ROOT=${OUTPUT_ROOT:-}              # folder for the runs' metrics and checkpoints; empty: $COURSE_DIR/runs
# Debugging and network settings, off by default; uncomment one when its situation arises:
# export NCCL_DEBUG=INFO                   # NCCL error or hang at start: each rank prints the GPUs, network and transport NCCL chose
# export NCCL_DEBUG_SUBSYS=INIT,NET        # with NCCL_DEBUG=INFO, when its output is too long: only the init and network lines
# export NCCL_SOCKET_IFNAME=ib0            # multi-node hang at init: the interface the nodes reach each other on (`ip -br addr`)
# export GLOO_SOCKET_IFNAME=ib0            # the same for gloo (CPU runs); never lo when there is more than one node
# export NCCL_IB_DISABLE=1                 # InfiniBand errors, or no working IB: use TCP sockets (slower; tells IB from the rest)
# export TORCH_DISTRIBUTED_DEBUG=DETAIL    # ranks calling different collectives (hang, shape error): checks every call (slow)
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 # a rank died and the rest hang until timeout: abort them all (default in PyTorch >= 2.2)
# export DIST_TIMEOUT_SECONDS=120          # this course's process-group timeout (default 600 s): fail sooner while debugging
# ============================== END OF SITE SECTION =============================

# ---- Nothing below needs editing. -------------------------------------------------------------
[ -n "${SLURM_JOB_ID:-}" ] || { echo "error: not inside a Slurm job: submit it with sbatch $0 ..." >&2; exit 1; }
# What every script of the course does first is in slurm/job_env.sh. sbatch runs a COPY of this script
# from a spool folder, so its own path ($0) says nothing: go up from where sbatch was run to find it.
if [ -z "$COURSE_DIR" ]; then COURSE_DIR=$SLURM_SUBMIT_DIR
    while [ "$COURSE_DIR" != / ] && [ ! -f "$COURSE_DIR/slurm/job_env.sh" ]; do COURSE_DIR=$(dirname "$COURSE_DIR"); done
fi
[ -f "$COURSE_DIR/slurm/job_env.sh" ] || { echo "error: no course folder (one holding slurm/job_env.sh) in COURSE_DIR" \
    "or at or above $SLURM_SUBMIT_DIR: run sbatch from inside the course, or set COURSE_DIR=/path/to/it" >&2; exit 1; }
source "$COURSE_DIR/slurm/job_env.sh"  # environment, PYTHONPATH, MASTER_ADDR/PORT, OUTPUT_DIR; prints the header

echo "== tasks ${SLURM_NTASKS:-?} (one per GPU) | GPUs per node ${SLURM_GPUS_ON_NODE:-0} | CPUs per task ${SLURM_CPUS_PER_TASK:-1} | rendezvous $MASTER_ADDR:$MASTER_PORT"

echo "== check_env.py, once per node"
srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python "$COURSE_DIR/01_setup/check_env.py"
echo "== hello_distributed.py, one process per task"
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python "$COURSE_DIR/01_setup/hello_distributed.py" "$@"
