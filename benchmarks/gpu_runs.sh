#!/usr/bin/env bash
# The GPU measurements behind the READMEs and docs/, in three batches of under 10 minutes each, on one machine with
# 4 GPUs (2 where noted). Real MNIST must be in .mnist/MNIST/raw (the four .gz files); results go to OUT.
#
#   bash benchmarks/gpu_runs.sh fsdp   OUT   # lesson 05: OOM against fits, memory curve, tools, where time goes
#   bash benchmarks/gpu_runs.sh step   OUT   # lesson 04: recipe over seeds, course step against a plain loop, overlap
#   bash benchmarks/gpu_runs.sh bench  OUT   # the reference-parity runs and the benchmark page's suites
#
# Every run is the course's own code at the current commit; each part writes what it measured as it goes.
set -euo pipefail
part=${1:?usage: gpu_runs.sh fsdp|step|bench OUT}
OUT=${2:?usage: gpu_runs.sh fsdp|step|bench OUT}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
GPUS=$(nvidia-smi -L | wc -l)
R="python3 -m torch.distributed.run --standalone"
DATA=.mnist
SEEDS=1,2,3,4,5
{ nvidia-smi; nvidia-smi topo -m; python3 -c "import torch; print('torch', torch.__version__)"; echo "commit $COMMIT"; } \
    > "$OUT/machine-$part.txt" 2>&1
log() { echo "== $(date +%T) $*"; }

case $part in
fsdp)
    log "lesson 05 benchmark (budget 300 s)"
    python3 benchmarks/fsdp_gpu.py --data-dir "$DATA" --commit "$COMMIT" --budget-s 300 --out "$OUT/fsdp" \
        > "$OUT/fsdp.txt" 2>&1 || log "fsdp_gpu.py failed: see $OUT/fsdp.txt"
    log "all_reduce bandwidth on 2 and $GPUS GPUs"
    $R --nproc_per_node=2 01_setup/allreduce_bandwidth.py --json "$OUT/bw2.json" > "$OUT/bw2.txt" 2>&1
    [ "$GPUS" -ge 4 ] && $R --nproc_per_node=4 01_setup/allreduce_bandwidth.py --json "$OUT/bw4.json" > "$OUT/bw4.txt" 2>&1
    log "NCCL transports"
    NPROC=2 timeout 150 bash troubleshooting/nccl_transports.sh "$OUT/nccl" > "$OUT/nccl.txt" 2>&1 || log "nccl: see log"
    ;;
step)
    rec() {  # rec GPUS VISIBLE NAME VARIANTS...: benchmarks/recipe.py on those GPUs, seeds 1-5
        local n=$1 visible=$2 name=$3; shift 3
        local variants=(); for v in "$@"; do variants+=(--variant "$v"); done
        CUDA_VISIBLE_DEVICES=$visible $R --nproc_per_node="$n" --master_port=$((29500 + RANDOM % 1000)) \
            benchmarks/recipe.py --data-dir "$DATA" --seeds $SEEDS "${variants[@]}" --json "$OUT/recipe-$name.json" \
            > "$OUT/recipe-$name.txt" 2>&1
    }
    log "recipe: 1 GPU (GPU 0) and 2 GPUs (GPUs 2,3) side by side"
    rec 1 0 1gpu "512x6e-3=" "512x1e-2=--lr 1e-2" &
    rec 2 2,3 2gpu "512x6e-3=" "512x1e-2=--lr 1e-2" &
    wait
    if [ "$GPUS" -ge 4 ]; then
        log "recipe: 4 GPUs, strong-scaling candidates"
        rec 4 0,1,2,3 4gpu "512x6e-3=" "256x6e-3=--batch-size 256" "256x1e-2=--batch-size 256 --lr 1e-2" \
            "128x6e-3=--batch-size 128" "256x8e-3-6ep=--batch-size 256 --lr 8e-3 --epochs 6"
    fi
    log "the course's step against a plain loop, 1 GPU"
    CUDA_VISIBLE_DEVICES=0 $R --nproc_per_node=1 benchmarks/recipe.py --data-dir "$DATA" --profile "$OUT/course-step" \
        > "$OUT/course-step.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/plain_loop.py --data-dir "$DATA" --seeds 1 --profile --out "$OUT/plain-step" \
        > "$OUT/plain-step.txt" 2>&1 &
    wait
    log "plain loop, 1 / 2 / $GPUS GPUs, seeds 1-3"
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/plain_loop.py --data-dir "$DATA" --seeds 1,2,3 --json "$OUT/plain1.json" \
        > "$OUT/plain1.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=2,3 $R --nproc_per_node=2 --master_port=29611 benchmarks/plain_loop.py --data-dir "$DATA" \
        --seeds 1,2,3 --json "$OUT/plain2.json" > "$OUT/plain2.txt" 2>&1 &
    wait
    [ "$GPUS" -ge 4 ] && $R --nproc_per_node=4 benchmarks/plain_loop.py --data-dir "$DATA" --seeds 1,2,3 \
        --json "$OUT/plain4.json" > "$OUT/plain4.txt" 2>&1
    log "DDP overlap picture, 2 GPUs"
    CUDA_VISIBLE_DEVICES=0,1 $R --nproc_per_node=2 benchmarks/ddp_overlap.py --out "$OUT/overlap" > "$OUT/overlap.txt" 2>&1
    ;;
bench)
    log "reference parity: pytorch/examples mnist/main.py @77f55b9 (copied to .gpu/ref) and lesson 02, seeds 1-3"
    mkdir -p .gpu/ref-run/data .gpu/ref-run/work && cp -r "$DATA/MNIST" .gpu/ref-run/data/
    for seed in 1 2 3; do
        (cd .gpu/ref-run/work && CUDA_VISIBLE_DEVICES=$((seed - 1)) python3 ../../ref/main.py --seed "$seed" \
            > "$OUT/ref-seed$seed.txt" 2>&1) &
    done
    lesson02() { CUDA_VISIBLE_DEVICES=$1 python3 02_singlegpu_training/mnist_singlegpu.py --data-dir "$DATA" --seed "$2" \
        --output-dir "$OUT/runs/02-seed$2" > "$OUT/02-seed$2.txt" 2>&1; }
    lesson02 3 1 &
    wait
    lesson02 0 2 & lesson02 1 3 &
    log "DataParallel on GPUs 2,3 meanwhile"
    CUDA_VISIBLE_DEVICES=2,3 python3 benchmarks/bench.py --suite dp --gpus 2 --data-dir "$DATA" --out "$OUT/bench-dp" \
        > "$OUT/bench-dp.txt" 2>&1 || log "bench.py dp: see log"
    wait
    log "benchmark page: throughput on 1, 2, $GPUS GPUs"
    python3 benchmarks/bench.py --suite throughput --data-dir "$DATA" --out "$OUT/bench" --gpus 1,2,$GPUS \
        > "$OUT/bench.txt" 2>&1 || log "bench.py throughput: see log"
    ;;
*) echo "error: unknown part $part: use fsdp, step or bench" >&2; exit 2 ;;
esac
log "done"
