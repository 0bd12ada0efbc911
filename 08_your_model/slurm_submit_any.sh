#!/bin/bash
# Any torchrun script on Slurm, on one node or several: the script and its arguments are the sbatch arguments.
# srun starts ONE torchrun per node, each torchrun one process per GPU of its node; they meet at a c10d rendezvous
# on the job's first node.
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch 08_your_model/slurm_submit_any.sh 08_your_model/port/train_ddp.py --epochs 2
#   sbatch --nodes=2 -J fsdp-port 08_your_model/slurm_submit_any.sh 08_your_model/port/train_fsdp.py --epochs 2
#   sbatch --nodes=2 08_your_model/slurm_submit_any.sh 08_your_model/digits_lm.py --epochs 10 --resume auto
#
# The first argument is the Python script (its path from the course folder, or absolute); the others go to it
# unchanged: this template adds no flag, so it runs scripts that are not the course's. They run in the folder you
# submitted from, where a relative --data-dir or --checkpoint is read. Log: logs/<job name>-<jobid>.out (-J names it).
# World size = nodes x GPUs per node: change --nodes and --gpus-per-node (sbatch's options win over these lines).
# Not here, unlike the lessons' scripts: stage_data (it points WORKSHOP_DATA_DIR, which only the course's scripts
# read, elsewhere). Help and troubleshooting: slurm/README.md; what differs between clusters: slurm/site.sh.
#SBATCH --job-name=any
#SBATCH --nodes=1                  # nodes; each runs one torchrun
#SBATCH --ntasks-per-node=1        # ONE task per node: torchrun, which starts the per-GPU processes itself
#SBATCH --gpus-per-node=2          # GPUs per node; each torchrun starts one process per GPU
##SBATCH --gres=gpu:2              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=8          # CPUs per node for ALL its processes, split between them below
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out    # relative to the folder you ran sbatch in; %x = job name, %j = job id
# Time limit and preemption, as lesson 04's scripts: Slurm sends SIGUSR1 120-180 s before the time limit to the
# processes of the job's steps. digits_lm.py then saves a checkpoint and requeues the job, which keeps its id and
# restarts with the same arguments: give it --resume auto (the first run starts fresh, the restart continues from
# the checkpoint in its --output-dir; slurm/README.md, "Time limits"). A script that does not handle SIGUSR1 ignores
# it (trap below) and runs into the time limit; a requeued one (preemption) starts again unless it resumes.
#SBATCH --signal=USR1@120          # raise the 120 if saving a checkpoint takes longer than a minute
#SBATCH --requeue                  # the job may go back to the queue: on preemption, or by itself on SIGUSR1
#SBATCH --open-mode=append         # a requeued run appends to the same log instead of overwriting it
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # sites: slurm/site.sh

(( $# >= 1 )) || { echo "error: name the script to run: sbatch $0 path/to/script.py [its arguments]" >&2; exit 1; }
SCRIPT=$1
shift
[[ "$SCRIPT" == /* ]] || SCRIPT=$COURSE_DIR/$SCRIPT
[ -f "$SCRIPT" ] || { echo "error: $SCRIPT not found: give the script's path from the course folder" >&2; exit 1; }

split_cpus_for_torchrun  # NPROC_PER_NODE: one process per GPU (or yours); CPUS_PER_PROC: their share (OMP_NUM_THREADS)
echo "== script $SCRIPT | arguments: $*"
echo "== tasks $SLURM_NNODES (one torchrun per node) | processes per node $NPROC_PER_NODE" \
     "-> world size $((SLURM_NNODES * NPROC_PER_NODE)) | CPUs per process $CPUS_PER_PROC"
echo "== rendezvous $MASTER_ADDR:$MASTER_PORT (c10d, id $SLURM_JOB_ID)"

# --ntasks/--ntasks-per-node: exactly one torchrun per node, whatever the #SBATCH lines say.
# --cpus-per-task again: from Slurm 22.05 on, srun may not inherit it from sbatch.
# trap "" USR1: SIGUSR1 would kill torchrun; exec passes the ignore on to it and its workers (their handler wins).
srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    bash -c 'trap "" USR1; exec "$@"' _ \
    torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
    "$SCRIPT" "$@"
