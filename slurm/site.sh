# slurm/site.sh: the ONE place for what differs between Slurm clusters. Every submit script of the course
# reads it (through slurm/job_env.sh) before it starts anything, so edit it once for your cluster; or leave
# it as it is and set the same variables when you submit (sbatch copies your shell's environment into the job):
#     MODULES="cuda/12.4" CONDA_ENV=torch sbatch 04_ddp_training/slurm_submit_ddp.sh
#
# Account and partition are NOT set here: sbatch needs them before the job exists, and #SBATCH lines cannot
# read variables. Use sbatch's own input variables (man sbatch, INPUT ENVIRONMENT VARIABLES), e.g. in ~/.bashrc:
#     export SBATCH_ACCOUNT=my_account SBATCH_PARTITION=my_gpu_partition
# or the command line: sbatch -A my_account -p my_partition ... Command-line options win over SBATCH_*
# variables, which win over the #SBATCH lines of a script.

# ---- The Python environment (each empty by default; slurm/job_env.sh activates them in this order). ----
MODULES=${MODULES:-}      # modules to `module load`, e.g. "cuda/12.4 python/3.11" (`module avail`); empty: none
CONDA_ENV=${CONDA_ENV:-}  # conda environment to activate (name or path); empty: none
VENV=${VENV:-}            # virtualenv folder to activate; empty: $COURSE_DIR/.venv if it exists and no CONDA_ENV
# Batch shells on some sites have no `module` command: source your site's init script here, e.g.
# source /etc/profile.d/lmod.sh

# ---- Data and results. ----
WORKSHOP_DATA_DIR=${WORKSHOP_DATA_DIR:-}  # folder holding MNIST/raw; empty: $COURSE_DIR/data
OUTPUT_ROOT=${OUTPUT_ROOT:-}              # runs go to $OUTPUT_ROOT/<job name>-<job id>/; empty: $COURSE_DIR/runs

# ---- Debugging and network settings, off by default; uncomment one when its situation arises. ----
# export NCCL_DEBUG=INFO                 # NCCL error or hang at start: each rank prints the GPUs, network and transport NCCL chose
# export NCCL_DEBUG_SUBSYS=INIT,NET      # with NCCL_DEBUG=INFO, when its output is too long: only the init and network lines
# export NCCL_SOCKET_IFNAME=ib0          # multi-node hang at init: the interface the nodes reach each other on (`ip -br addr`)
# export GLOO_SOCKET_IFNAME=ib0          # the same for gloo (CPU runs); never lo when there is more than one node
# export NCCL_IB_DISABLE=1               # InfiniBand errors, or no working IB: use TCP sockets (slower; tells IB from the rest)
# export TORCH_DISTRIBUTED_DEBUG=DETAIL  # ranks calling different collectives (hang, shape error): checks every call (slow)
# export DIST_TIMEOUT_SECONDS=120        # this course's process-group timeout (default 600 s): fail sooner while debugging
# Not needed: TORCH_NCCL_ASYNC_ERROR_HANDLING (NCCL only). torch already ends a process whose NCCL collective failed
# or ran past the timeout: the default is 3 (SkipCleanUp, in torch's ProcessGroupNCCL.hpp), torchrun sets 1 (TearDown)
# for its workers, 0 would leave the process hanging. No value makes the surviving ranks stop sooner: the watchdog acts
# only on a collective that NCCL reports failed or that timed out, and a rank not in a collective notices nothing.
# What stops them at once is srun --kill-on-bad-exit=1, in every script: when one task fails, srun ends the others.
