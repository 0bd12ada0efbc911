#!/bin/bash
# Lesson 01 on Slurm: is the software ready on a compute node, and can processes talk?
# Runs check_env.py once per node, then hello_distributed.py in one process per GPU (srun).
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
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
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # shared set-up; sites: slurm/site.sh

echo "== tasks ${SLURM_NTASKS:-?} (one per GPU) | GPUs per node ${SLURM_GPUS_ON_NODE:-0} | CPUs per task ${SLURM_CPUS_PER_TASK:-1} | rendezvous $MASTER_ADDR:$MASTER_PORT"

show_tasks  # one line per task: its node, local rank and the GPUs it sees
echo "== check_env.py, once per node"
srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python "$COURSE_DIR/01_setup/check_env.py" "$@"
echo "== hello_distributed.py, one process per task"
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    python "$COURSE_DIR/01_setup/hello_distributed.py" "$@"
