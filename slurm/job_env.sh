# slurm/job_env.sh: the set-up that every Slurm script of the course shares. Each 0*/slurm_submit_*.sh
# sources it once it has found the course (COURSE_DIR); it is not a script to run on its own.
# It reads the site settings (slurm/site.sh) and leaves the calling script with:
#   the Python environment of slurm/site.sh activated and the course on PYTHONPATH,
#   MASTER_ADDR, MASTER_PORT  where the processes of a multi-node job meet: the job's first node and a
#                             port made from the job id (one-node torchrun --standalone does not need them)
#   OUTPUT_DIR                where a training run writes metrics and checkpoints: $OUTPUT_ROOT/<job name>-<job id>.
#                             A requeued job keeps its id, so its restart finds its own checkpoints
#   OMP_NUM_THREADS           the CPUs of one task (the torchrun scripts split them: split_cpus_for_torchrun)
#   show_tasks                srun-style scripts: one log line per task, with the GPUs it sees
# and prints the first lines of the log's header (the lines starting with ==).
# What differs between clusters is in slurm/site.sh; nothing here needs editing.

[ -n "${SLURM_JOB_ID:-}" ] || { echo "error: not inside a Slurm job: submit it with sbatch $0 ..." >&2; exit 1; }
source "$COURSE_DIR/slurm/site.sh"
export PYTHONPATH=$COURSE_DIR${PYTHONPATH:+:$PYTHONPATH}  # `import common` works without pip install -e
export WORKSHOP_DATA_DIR=${WORKSHOP_DATA_DIR:-$COURSE_DIR/data}
export PYTHONUNBUFFERED=1  # lines reach the log when printed, not when a buffer fills

# ---- The Python environment of slurm/site.sh: modules, then conda, then a virtualenv (each only if named). ----
set +u  # module and activate scripts often read unset variables
if [ -n "$MODULES" ]; then
    command -v module >/dev/null || { echo "error: MODULES is set but this shell has no 'module' command" \
        "(source your site's modules init script in slurm/site.sh, or use #!/bin/bash -l)" >&2; exit 1; }
    module load $MODULES
fi
if [ -n "$CONDA_ENV" ]; then eval "$(conda shell.bash hook)"; conda activate "$CONDA_ENV"; fi
if [ -n "$VENV" ]; then
    [ -f "$VENV/bin/activate" ] || { echo "error: VENV=$VENV is not a virtualenv (no bin/activate)" >&2; exit 1; }
    source "$VENV/bin/activate"
elif [ -z "$CONDA_ENV" ] && [ -f "$COURSE_DIR/.venv/bin/activate" ]; then source "$COURSE_DIR/.venv/bin/activate"; fi
set -u

# ---- Rendezvous: every process of a multi-node job must reach one address and port on its first node. ----
# The port comes from the job id (as in common/distributed.py), so jobs sharing a node differ.
export MASTER_ADDR=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
[ -n "$MASTER_ADDR" ] || { echo "error: scontrol show hostnames gave no node name for $SLURM_JOB_NODELIST" >&2; exit 1; }
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE  # left over from your shell, they would beat the launcher's
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}

# ---- Where a training run writes. The training scripts pass it with --resume auto, so a requeued job
# (same id) continues from its newest checkpoint and a new submission (new id) starts fresh.
OUTPUT_DIR=${OUTPUT_ROOT:-$COURSE_DIR/runs}/$SLURM_JOB_NAME-$SLURM_JOB_ID

# ---- torchrun scripts only: ONE task per node holds the CPUs of all the node's processes. ----
# Sets NPROC_PER_NODE (one process per GPU Slurm gave this node; NPROC_PER_NODE=N overrides it, e.g. on a
# cluster without GPUs: NPROC_PER_NODE=2 sbatch ... --device cpu), CPUS_PER_PROC, and splits the CPUs so
# that each process does not start as many threads and DataLoader workers as the whole task has CPUs.
split_cpus_for_torchrun() {
    NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-1}}}
    NPROC_PER_NODE=${NPROC_PER_NODE##*:}  # --gpus-per-node=a100:2 arrives as "a100:2"
    CPUS_PER_PROC=$(( ${SLURM_CPUS_PER_TASK:-1} / NPROC_PER_NODE )); (( CPUS_PER_PROC >= 1 )) || CPUS_PER_PROC=1
    export OMP_NUM_THREADS=$CPUS_PER_PROC
    NUM_WORKERS=$(( CPUS_PER_PROC - 1 )); (( NUM_WORKERS <= 8 )) || NUM_WORKERS=8  # a --num-workers of yours wins
}

# ---- srun-style scripts (one task per GPU): one line per task, sorted by rank. With --gpus-per-task=1 (or
# --gpu-bind) each task sees ONE GPU in CUDA_VISIBLE_DEVICES, which the training code then uses as cuda:0.
show_tasks() {
    local line='echo "== task $SLURM_PROCID on $SLURMD_NODENAME: local rank $SLURM_LOCALID, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-none}"'
    srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" bash -c "$line" | sort -k3,3n
}

# SLURM_RESTART_COUNT: set once the job has been requeued (by preemption, or by itself on the time-limit warning)
echo "== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_NNODES node(s): $SLURM_JOB_NODELIST${SLURM_RESTART_COUNT:+ | restart $SLURM_RESTART_COUNT}"
echo "== python $(command -v python) | course $COURSE_DIR | data $WORKSHOP_DATA_DIR"
