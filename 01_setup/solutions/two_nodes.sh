#!/bin/bash
# Lesson 01, exercise 3 (a solution): two "nodes" on one machine, 2 processes each, one process group of 4.
#
#   bash 01_setup/solutions/two_nodes.sh          # from the course folder; MASTER_PORT=... picks another port
#
# Two torchrun launchers, as on two nodes: each starts 2 processes (local ranks 0 and 1), and both meet at
# the first "node's" address (here 127.0.0.1). --node_rank orders the nodes, so node 1's processes get the
# global ranks 2 and 3. On a cluster, sbatch --nodes=2 01_setup/slurm_submit_setup.sh does the same with srun.
set -euo pipefail
port=${MASTER_PORT:-29533}
node() {
    OMP_NUM_THREADS=1 torchrun --nnodes=2 --node_rank="$1" --nproc_per_node=2 \
        --master_addr=127.0.0.1 --master_port="$port" 01_setup/hello_distributed.py
}
node 0 &     # the first node, in the background: it waits for the second one
first=$!
node 1
wait "$first"
