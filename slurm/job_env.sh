# slurm/job_env.sh: the set-up that every Slurm script of the course shares. Each 0*/slurm_*.sh sources it
# with its one line `source "${SLURM_SUBMIT_DIR:?...}/slurm/job_env.sh"`; it is not a script to run on its own.
# It finds the course (the folder above this file), reads the site settings (slurm/site.sh) and leaves the
# calling script with:
#   COURSE_DIR                the course folder
#   the Python environment of slurm/site.sh activated and the course on PYTHONPATH,
#   MASTER_ADDR, MASTER_PORT  where the processes of a multi-node job meet: the job's first node and a
#                             port made from the job id (each task of an array has its own)
#                             (one-node torchrun --standalone does not need them)
#   OUTPUT_DIR                where a training run writes metrics and checkpoints: $OUTPUT_ROOT/<job name>-<job id>,
#                             or $OUTPUT_ROOT/<job name>-<array job id>/task-<index> in an array. A requeued job
#                             keeps its id, so its restart finds its own checkpoints
#   OMP_NUM_THREADS           the CPUs of one task (the torchrun scripts split them: split_cpus_for_torchrun)
#   stage_data                STAGE_DATA=1: copy the data set to node-local disk once per node, read it from there
#   sweep_row                 array jobs: the lesson's flags from one row of a table (slurm_sweep_array.sh)
#   show_tasks                srun-style scripts: one log line per task, with the GPUs it sees
# and prints the first lines of the log's header (the lines starting with ==).
# What differs between clusters is in slurm/site.sh; nothing here needs editing.

[ -n "${SLURM_JOB_ID:-}" ] || { echo "error: not inside a Slurm job: submit it with sbatch $0 ..." >&2; exit 1; }
COURSE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# sbatch runs a copy of the script; `scontrol show job` still names the file you submitted (Command=). A script of
# another copy of the course would silently run THIS copy's code, so refuse it.
SUBMITTED=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.* Command=\(\/[^ ]*\).*/\1/p') || true
if [ -n "$SUBMITTED" ] && [[ "$(realpath -m "$SUBMITTED")" != "$(realpath "$COURSE_DIR")"/* ]]; then
    echo "error: $SUBMITTED is not in the course folder $COURSE_DIR you submitted from:" \
         "cd to the course that holds the script and run sbatch there" >&2; exit 1
fi
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
# The port comes from the job id (as in common/distributed.py), so jobs sharing a node differ. In a job array every
# task is a job with its own SLURM_JOB_ID; what sbatch printed (SLURM_ARRAY_JOB_ID, %A) is the same in all tasks,
# so a port made from it would collide on a shared node ("Address already in use"): slurm/README.md, "Sweeps".
export MASTER_ADDR=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
[ -n "$MASTER_ADDR" ] || { echo "error: scontrol show hostnames gave no node name for $SLURM_JOB_NODELIST" >&2; exit 1; }
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE  # left over from your shell, they would beat the launcher's
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}

# ---- Where a training run writes. The training scripts pass it with --resume auto, so a requeued job
# (same id) continues from its newest checkpoint and a new submission (new id) starts fresh.
OUTPUT_DIR=${OUTPUT_ROOT:-$COURSE_DIR/runs}/$SLURM_JOB_NAME-${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}
[ -z "${SLURM_ARRAY_JOB_ID:-}" ] || OUTPUT_DIR=$OUTPUT_DIR/task-$SLURM_ARRAY_TASK_ID  # one folder per array task

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

# ---- Node-local data, STAGE_DATA=1 (slurm/site.sh): every node reads the data set from its own disk instead of
# the shared file system. One srun task per node copies WORKSHOP_DATA_DIR's MNIST/ and synthetic/ to
# $NODE_LOCAL_DIR/course-data-<checksum of the file list> (under a lock, so that jobs sharing a node copy once and
# the others wait), and WORKSHOP_DATA_DIR then points there. Changed data gets a new folder, never a mixed one.
stage_data() {
    [ "${STAGE_DATA:-0}" = 1 ] || return 0
    local src=$WORKSHOP_DATA_DIR root=${NODE_LOCAL_DIR:-${TMPDIR:-/tmp}} items=() item sum
    for item in MNIST synthetic; do [ ! -d "$src/$item" ] || items+=("$item"); done
    (( ${#items[@]} )) || { echo "error: STAGE_DATA=1 but $src holds no MNIST/ or synthetic/ folder: fetch it first" \
        "(python 01_setup/download_mnist.py --data-dir $src) or set WORKSHOP_DATA_DIR" >&2; exit 1; }
    sum=$(cd "$src" && find "${items[@]}" -type f -printf '%p %s %T@\n' | LC_ALL=C sort | cksum | cut -d' ' -f1)
    srun --kill-on-bad-exit=1 --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task=1 \
        bash -c "$(declare -f copy_once_per_node); copy_once_per_node \"\$@\"" _ "$src" "$root/course-data-$sum" "${items[@]}"
    export WORKSHOP_DATA_DIR=$root/course-data-$sum
    echo "== data: staged on each node's local disk, $WORKSHOP_DATA_DIR (from $src)"
}
copy_once_per_node() {  # SRC DEST ITEM...: the first caller on a node copies, under flock; later ones find DEST
    local src=$1 dest=$2 tmp; shift 2
    mkdir -p "$(dirname "$dest")" || { echo "error: cannot create $(dirname "$dest") on $(hostname): set NODE_LOCAL_DIR" \
        "in slurm/site.sh to a writable node-local folder" >&2; return 1; }
    exec 9>"$dest.lock"
    flock 9  # held until this shell exits; a second job on this node waits here, then finds DEST complete
    if [ -d "$dest" ]; then
        echo "$(date +%s.%N) $(hostname) job $SLURM_JOB_ID reused" >> "$dest.log"
        return 0
    fi
    rm -rf "$dest".partial.*  # left by a copy that was killed: nobody else copies while we hold the lock
    tmp=$dest.partial.$$
    mkdir "$tmp" && (cd "$src" && cp -r "$@" "$tmp/") && mv -T "$tmp" "$dest" || {  # one rename: whole or absent
        echo "error: copying $src to $dest on $(hostname) failed: free space there, or set NODE_LOCAL_DIR" >&2; return 1; }
    echo "$(date +%s.%N) $(hostname) job $SLURM_JOB_ID copied" >> "$dest.log"
}

# ---- Job arrays (slurm_sweep_array.sh): the flags of one configuration. TABLE: a header of flag names
# (e.g. `lr  seed`), then one configuration per line, tab- or space-separated; `#` lines and blank lines are
# skipped. Array task N takes the N-th configuration (from 0) and sets SWEEP_ARGS, e.g. (--lr 0.01 --seed 1).
sweep_row() {
    local table=$1 rows
    [ -n "${SLURM_ARRAY_TASK_ID:-}" ] || { echo "error: not an array job: submit with sbatch --array=0-N" \
        "(one index per row of $table)" >&2; exit 1; }
    [ -f "$table" ] || { echo "error: sweep table $table not found: set SWEEP_TABLE to your table file" >&2; exit 1; }
    rows=$(awk '!/^[[:space:]]*(#|$)/ { n++ } END { print n - 1 }' "$table")
    (( SLURM_ARRAY_TASK_ID < rows )) || { echo "error: array index $SLURM_ARRAY_TASK_ID but $table has $rows" \
        "configuration(s): submit with --array=0-$((rows - 1))" >&2; exit 1; }
    mapfile -t SWEEP_ARGS < <(awk -v row="$SLURM_ARRAY_TASK_ID" '!/^[[:space:]]*(#|$)/ {
        if (n == 0) split($0, names); else if (n == row + 1) for (i = 1; i <= NF; i++) print "--" names[i] "\n" $i
        n++ }' "$table")
}

# SLURM_RESTART_COUNT: set once the job has been requeued (by preemption, or by itself on the time-limit warning)
echo "== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_NNODES node(s): $SLURM_JOB_NODELIST${SLURM_RESTART_COUNT:+ | restart $SLURM_RESTART_COUNT}"
echo "== python $(command -v python) | course $COURSE_DIR | data $WORKSHOP_DATA_DIR"
