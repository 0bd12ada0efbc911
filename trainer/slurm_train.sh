#!/bin/bash
# The production trainer on Slurm, any number of nodes, with time limits and preemption handled: at SIGUSR1 every
# rank stops at the same step, saves, the job requeues itself (same id, same folder) and resumes mid-epoch.
#
#   cd <the course folder>                       # ALWAYS submit from here: the job finds the course by it
#   mkdir -p logs                                # once: Slurm does not create logs/
#   sbatch trainer/slurm_train.sh --parallel ddp --epochs 3
#   TRAINER_LAUNCHER=torchrun sbatch --ntasks-per-node=1 trainer/slurm_train.sh --parallel fsdp2
#
# Arguments after the script name go to trainer/train.py (--parallel is required). Log: logs/trainer-<jobid>.out;
# metrics and checkpoints: runs/trainer-<jobid>/ in the course folder (OUTPUT_ROOT changes runs/).
# TRAINER_LAUNCHER=srun (default): srun starts every process, one task per GPU (04_ddp_training/
# slurm_submit_ddp_srun.sh explains the shape). TRAINER_LAUNCHER=torchrun: one task per node runs torchrun,
# which starts NPROC_PER_NODE processes (default: the node's GPUs; 04_ddp_training/slurm_submit_ddp_multinode.sh).
#SBATCH --job-name=trainer
#SBATCH --nodes=2                  # nodes
#SBATCH --ntasks-per-node=2        # srun: ONE task per GPU; torchrun: pass --ntasks-per-node=1 to sbatch
#SBATCH --gpus-per-node=2          # keep equal to --ntasks-per-node (srun)
##SBATCH --gres=gpu:2              # sites that do not know --gpus-per-node: use this line instead
#SBATCH --cpus-per-task=4          # per process (srun) or per node's torchrun: DataLoader workers from it
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out    # relative to the folder you ran sbatch in; %x = job name, %j = job id
#SBATCH --signal=USR1@120          # SIGUSR1 to the job's steps 120 s before the limit: stop, save, requeue
#SBATCH --requeue                  # the job may go back to the queue: on preemption, or by itself on SIGUSR1
#SBATCH --open-mode=append         # a requeued run appends to the same log instead of overwriting it
set -euo pipefail  # the first command: sbatch reads no #SBATCH line below it
source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"  # shared set-up; sites: slurm/site.sh
stage_data  # STAGE_DATA=1 (slurm/site.sh): copy the data set to each node's local disk once, read it there

# --cpus-per-task again: from Slurm 22.05 on, srun may not inherit it from sbatch.
# --resume auto: continue from the newest checkpoint in OUTPUT_DIR (after a requeue), else start fresh.
case "${TRAINER_LAUNCHER:-srun}" in
srun)
    echo "== srun: tasks ${SLURM_NTASKS:-?} (one per GPU) -> world size ${SLURM_NTASKS:-?} | rendezvous $MASTER_ADDR:$MASTER_PORT"
    srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
        python "$COURSE_DIR/trainer/train.py" --output-dir "$OUTPUT_DIR" --resume auto "$@" ;;
torchrun)
    split_cpus_for_torchrun  # NPROC_PER_NODE, CPUS_PER_PROC, NUM_WORKERS (a --num-workers of yours wins)
    echo "== torchrun: one per node, $NPROC_PER_NODE processes each -> world size $((SLURM_NNODES * NPROC_PER_NODE))" \
         "| rendezvous $MASTER_ADDR:$MASTER_PORT (c10d, id $SLURM_JOB_ID)"
    # trap "" USR1: SIGUSR1 would kill torchrun; exec passes the ignore on to it and its workers, whose handler replaces it.
    srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
        bash -c 'trap "" USR1; exec "$@"' _ \
        torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
        --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
        "$COURSE_DIR/trainer/train.py" --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" --resume auto "$@" ;;
*)
    echo "error: TRAINER_LAUNCHER=$TRAINER_LAUNCHER: use srun or torchrun" >&2; exit 2 ;;
esac
