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
# Node-local staging (stage_data in slurm/job_env.sh): 1 = copy WORKSHOP_DATA_DIR's MNIST/ and synthetic/ once per
# node to NODE_LOCAL_DIR and read them from there: many processes reading a shared file system slow it for everyone.
STAGE_DATA=${STAGE_DATA:-0}               # 1: stage; 0 (default): every node reads WORKSHOP_DATA_DIR
NODE_LOCAL_DIR=${NODE_LOCAL_DIR:-}        # a folder on each node's local disk; empty: $TMPDIR if set, else /tmp

# ---- Containers (04_ddp_training/slurm_submit_ddp_apptainer.sh). ----
APPTAINER_IMAGE=${APPTAINER_IMAGE:-}      # the image with torch, e.g. $HOME/pytorch.sif (apptainer pull ... docker://...)
NCCL_PLUGIN_DIR=${NCCL_PLUGIN_DIR:-}      # host folder of the fabric's NCCL net plugin, bound into the container; empty: none

# ---- Debugging and network settings, off by default; uncomment one when its situation arises. ----
# export NCCL_DEBUG=INFO                 # NCCL error or hang at start: each rank prints the GPUs, network and transport NCCL chose
# export NCCL_DEBUG_SUBSYS=INIT,NET      # with NCCL_DEBUG=INFO, when its output is too long: only the init and network lines
# export NCCL_SOCKET_IFNAME=ib0          # multi-node hang at init: the interface the nodes reach each other on (`ip -br addr`);
#                                        # a prefix list (ib matches ib0, ib1), =ib0 exactly that one, ^docker excludes
# export GLOO_SOCKET_IFNAME=ib0          # the same for gloo (CPU runs); never lo when there is more than one node
# export NCCL_IB_DISABLE=1               # InfiniBand errors, or no working IB: use TCP sockets (slower; tells IB from the rest)
# export NCCL_DEBUG_FILE=nccl.%h.%p.log  # NCCL_DEBUG output to one file per process (%h host, %p process id)
# export TORCH_DISTRIBUTED_DEBUG=DETAIL  # ranks calling different collectives (hang, shape error): checks every call (slow)
# export DIST_TIMEOUT_SECONDS=120        # this course's process-group timeout (default 600 s): fail sooner while debugging
# Not needed: TORCH_NCCL_ASYNC_ERROR_HANDLING (NCCL only). torch already ends a process whose NCCL collective failed
# or ran past the timeout: the default is 3 (SkipCleanUp, in torch's ProcessGroupNCCL.hpp), torchrun sets 1 (TearDown)
# for its workers, 0 would leave the process hanging. No value makes the surviving ranks stop sooner: the watchdog acts
# only on a collective that NCCL reports failed or that timed out, and a rank not in a collective notices nothing.
# What stops them at once is srun --kill-on-bad-exit=1, in every script: when one task fails, srun ends the others.

# ---- NCCL on real fabrics (GPU jobs; gloo ignores all of these). Your site's documentation wins: it knows its
# fabric and its plugin. Sources: NCCL's "Environment Variables" and "Logging" pages (docs.nvidia.com/deeplearning/
# nccl), NCCL's ext-net/README.md (plugins), aws-ofi-nccl's doc/efa-env-var.md, CSCS's Alps NCCL page (Slingshot).
# InfiniBand / RoCE (NCCL's own IB transport, no plugin needed):
# export NCCL_IB_HCA=mlx5_0:1,mlx5_1:1   # which RDMA adapters (:port) NCCL uses; a prefix (mlx5) takes all, ^ excludes
# AWS EFA and HPE Slingshot: NCCL talks to them through libfabric (OFI), via the aws-ofi-nccl plugin that the site
# installs (a module, or a folder such as /opt/amazon/ofi-nccl/lib). NCCL loads it from the library search path:
# export LD_LIBRARY_PATH=/path/to/aws-ofi-nccl/lib:$LD_LIBRARY_PATH  # the folder holding libnccl-net-ofi.so
# export NCCL_NET_PLUGIN=ofi             # load libnccl-net-ofi.so (NCCL loads libnccl-net-<value>.so; unset: libnccl-net.so)
# export NCCL_NET="AWS Libfabric"        # use only this network (the plugin's name) and fail at start instead of falling
#                                        # back to slow TCP sockets (CSCS sets this one, and not NCCL_NET_PLUGIN)
# export FI_PROVIDER=efa                 # libfabric provider; aws-ofi-nccl <= 1.5.0 on EFA needed it, newer ones do not
# export FI_EFA_USE_HUGE_PAGE=0          # EFA: os.fork() fails with "Cannot allocate memory" (DataLoader workers)
# HPE Slingshot (libfabric's cxi provider), the values CSCS sets on Alps for NCCL with aws-ofi-nccl:
# export FI_CXI_DISABLE_HOST_REGISTER=1 FI_MR_CACHE_MONITOR=userfaultfd FI_CXI_DEFAULT_CQ_SIZE=131072
# Check what NCCL chose: with NCCL_DEBUG=INFO each process logs "Using network <name>" (AWS Libfabric, IB, ...).
# In a container (slurm_submit_ddp_apptainer.sh) the image's NCCL needs the HOST's plugin: set NCCL_PLUGIN_DIR above.
