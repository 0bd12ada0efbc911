#!/usr/bin/env bash
# Which transport does NCCL use between this machine's GPUs, and what bandwidth does each give?
#
#   bash troubleshooting/nccl_transports.sh OUT [allreduce_bandwidth.py flags]     # needs >= 2 GPUs
#   NPROC=2 bash troubleshooting/nccl_transports.sh OUT --max-bytes 64M           # 2 GPUs, smaller sweep
#
# Runs 01_setup/allreduce_bandwidth.py on NPROC GPUs (default: all visible) three times, each with
# NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET, switching transports off one by one:
#   default      NCCL's own choice: P2P (NVLink, or PCIe peer to peer) between GPUs of one host
#   no_p2p       NCCL_P2P_DISABLE=1: through shared host memory (SHM)
#   no_p2p_shm   NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: through the network stack (NET/IB or NET/Socket)
# For each: OUT/<name>.log (all output: NCCL's lines and the table), OUT/<name>.table.txt (the table),
# OUT/<name>.json (the rows). The environment is inherited as it is (NCCL settings of the site stay).
# PYTHON picks the interpreter (default python3). The three runs take about 1-2 minutes on 2-4 GPUs.
set -euo pipefail

out=${1:?usage: $0 OUT_DIR [flags for 01_setup/allreduce_bandwidth.py]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: we move to the course folder next
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}  # the interpreter that has torch (a venv or conda env provides python3)
nproc=${NPROC:-$("$python" -c 'import torch; print(torch.cuda.device_count())')}
if [ "$nproc" -lt 2 ]; then
  echo "error: $nproc GPU(s) visible; NCCL transports need at least 2 (set NPROC)" >&2
  exit 2
fi

run() {  # run NAME [VAR=VALUE ...]: one bandwidth sweep with NCCL's INIT and NET logging
  local name=$1
  shift
  echo "== $name: ${*:-NCCL defaults} ($nproc GPUs)"
  env "$@" NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET \
    "$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
    01_setup/allreduce_bandwidth.py --device cuda --json "$out/$name.json" ${extra[@]+"${extra[@]}"} > "$out/$name.log" 2>&1 \
    || echo "   FAILED (exit $?): see $out/$name.log"
  # The table: our lines start with '#' or a size; NCCL's start with host:pid:tid.
  grep -E '^(#| +[0-9])' "$out/$name.log" > "$out/$name.table.txt" || true
  # What to look for first: the transport of each channel, the network NCCL picked, and the peak.
  grep -E 'via |NET/Socket : Using|NET/IB : |Using network|Init COMPLETE' "$out/$name.log" | sort -u | head -n 8 \
    | sed 's/^/   /' || true
  grep -E '^# avg bus bandwidth' "$out/$name.table.txt" | sed 's/^/   /' || true
}

extra=("$@")
run default
run no_p2p NCCL_P2P_DISABLE=1
run no_p2p_shm NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
echo "logs, tables and JSON in $out"
