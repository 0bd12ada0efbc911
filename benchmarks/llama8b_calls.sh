#!/usr/bin/env bash
# The 8 B benchmark's GPU calls (benchmarks/llama8b_plan.md): OUT=DIR bash benchmarks/llama8b_calls.sh CALL GPUS
#   CALL 1  a random-weight Llama-3-8B folder (runs/llama8b/folder, kept if there), the four ways to load it
#   CALL 2  seq 8192 with AC at the batch that fits: the course (llama8b_train.py), accelerate, torchtitan
#   CALL 3  the export of the loaded model (export_8b.py; the folder again on a fresh machine); the course in float8
#   CALL 4  (if device time is left) torchtitan in float8; no AC at batch 1: the course, accelerate (4 GPUs only)
# Each launch under its own timeout (a call's add up to under 600 s); JSON rows appended to $OUT/rows.jsonl, each
# launch's output in $OUT/NAME.log; the large files (folder, export, logits) under runs/llama8b.
# TINY=1: the same steps on the CPU with benchmarks/llama3_tiny.json (gloo, seq 32, no compile, no float8, torchtitan's
# config and spec only: its Trainer needs CUDA): the sheet's proof. TIMEOUT_SCALE=N: every limit N times longer.
set -uo pipefail
call=${1:?CALL: 1, 2, 3 or 4}
gpus=${2:?GPUS: 4 or 2}
cd "$(dirname "$0")/.."
out=${OUT:-runs/llama8b/out}
py=${PYTHON:-python3}
mkdir -p "$out" runs/llama8b
export DIST_TIMEOUT_SECONDS=300 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ -n "${TINY:-}" ]; then
    config=benchmarks/llama3_tiny.json seq=32 ac_batch=2 shard=0.05 vocab=512 flavor=debugmodel
    steps=(--warmup 1 --steps 2) compile=() device=(--device cpu) folder=runs/llama8b/tiny
else
    config=08_your_model/configs/llama3_8b.json seq=8192 shard=5000 vocab=4096 flavor=8B
    steps=(--warmup 2 --steps 5) compile=(--compile) device=() folder=runs/llama8b/folder
    ac_batch=$([ "$gpus" = 4 ] && echo 5 || echo 2)  # will_it_fit.py's largest "fits" with fsdp2-ac on H200s
fi
ac_batch=${BATCH:-$ac_batch}
torchrun=("$py" -m torch.distributed.run --standalone --nproc_per_node="$gpus")

launch() {  # NAME SECONDS COMMAND...: the command's rows into rows.jsonl; its last lines if it failed
    local name=$1 limit=$2 began=$SECONDS
    shift 2
    timeout -k 15 $((limit * ${TIMEOUT_SCALE:-1})) "$@" > "$out/$name.log" 2>&1
    local rc=$?
    grep -h '^{"what"' "$out/$name.log" >> "$out/rows.jsonl"
    echo "== $name: exit $rc after $((SECONDS - began)) s"
    [ $rc = 0 ] || tail -n 4 "$out/$name.log"
}

wheels() {  # accelerate, torchao, torchtitan and its imports: benchmarks/peers/get_wheels.sh
    [ -n "${TINY:-}" ] || "$py" -m pip install -q --no-deps benchmarks/peers/wheels/*.whl 2>&1 | tail -n 2
}

folder() {
    [ -f $folder/model.safetensors.index.json ] || launch folder 150 "$py" benchmarks/llama_folder.py \
        --config "$config" --out $folder --shard-mb $shard --tokenizer-vocab $vocab
}

train() {  # NAME SECONDS FLAGS...: lesson 08's model class, llama8b_train.py
    local name=$1 limit=$2
    shift 2
    launch "$name" "$limit" "${torchrun[@]}" benchmarks/llama8b_train.py --config "$config" --seq $seq "${steps[@]}" \
        "${device[@]}" "$@"
}

titan() {  # NAME SECONDS FLAGS...: torchtitan's Trainer (a dry run of its config on the CPU)
    local name=$1 limit=$2
    shift 2
    local flags=(--job.config_file benchmarks/peers/titan_llama3_8b.toml --model.flavor "$flavor"
                 --training.seq_len $seq --training.steps 7 --job.dump_folder runs/llama8b/titan "$@")
    if [ -n "${TINY:-}" ]; then
        launch "$name" "$limit" "$py" benchmarks/peers/titan_synthetic.py --peer-dry-run "${flags[@]}"
    else
        launch "$name" "$limit" "${torchrun[@]}" benchmarks/peers/titan_synthetic.py "${flags[@]}"
    fi
}

case $call in
1)
    folder
    rm -f runs/llama8b/logits_?.pt
    for way in a b c d; do  # c and d: from_pretrained in float32 (32 GB per process that calls it)
        launch "load_$way" $([ $way = a ] || [ $way = b ] && echo 90 || echo 130) "${torchrun[@]}" \
            benchmarks/load_ways.py --folder $folder --way $way --out runs/llama8b "${device[@]}"
    done
    ;;
2)
    wheels
    train train_ac 190 --batch $ac_batch --ac "${compile[@]}"
    launch accelerate_ac 190 "${torchrun[@]}" benchmarks/peers/accelerate_fsdp2.py --config "$config" --seq $seq \
        --batch $ac_batch --ac "${compile[@]}" "${steps[@]}"
    titan titan_ac 190 --training.local_batch_size $ac_batch
    ;;
3)
    wheels
    folder
    launch export 240 "${torchrun[@]}" benchmarks/export_8b.py --folder $folder --out runs/llama8b/export "${device[@]}"
    if [ -n "${TINY:-}" ]; then
        echo "float8: H100/H200 only (skipped on the CPU)"
    else
        train train_fp8 190 --batch $ac_batch --ac --compile --float8 rowwise
    fi
    ;;
4)
    wheels
    [ -n "${TINY:-}" ] || titan titan_fp8 190 --training.local_batch_size $ac_batch \
        --model.converters quantize.linear.float8
    if [ "$gpus" = 4 ] || [ -n "${TINY:-}" ]; then  # fsdp2 at batch 1 is "tight" on 2 H200s (will_it_fit.py)
        train train_noac 190 --batch 1 "${compile[@]}"
        launch accelerate_noac 190 "${torchrun[@]}" benchmarks/peers/accelerate_fsdp2.py --config "$config" \
            --seq $seq --batch 1 "${compile[@]}" "${steps[@]}"
    fi
    ;;
*) echo "CALL: 1, 2, 3 or 4"; exit 2 ;;
esac
echo "rows: $out/rows.jsonl"
