#!/usr/bin/env bash
# Device series for this stop:  bash devrun/series.sh SERIES   (suite | timing)
# suite:  the whole test suite as make test runs it on a GPU
# timing: (SKIP_PEERS=1: without the peers) the 8B bf16 / --fp8 / --lora-r 16 steps (synthetic tokens, 4 x 2048, 12 steps), SmolLM2 on
#         examples/chat.jsonl at 8 x 512 (packed default, --no-packing, 60 steps), and the two peers of peers.py
set -u
series="$1"
export PYTHONPATH=/root/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PLAYBOOK_MODEL_CACHE=/root/mc PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"
W=/root/work_$series
mkdir -p "$W/logs" "$W/json"
git_rev="$(cat devrun/REV 2>/dev/null)"
{ echo "tree: $git_rev"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$W/logs/env.txt" 2>&1
cat "$W/logs/env.txt"

run() {  # run TAG SCRIPT ARGS...
    local tag="$1"; shift
    local t0=$SECONDS
    timeout -k 10 150 python3 "$@" --tag "$tag" --overwrite > "$W/logs/$tag.log" 2>&1
    local rc=$?
    cp "results/$tag.json" "$W/json/" 2>/dev/null
    echo "$tag rc=$rc $((SECONDS - t0)) s: $(grep -E '^\| (tokens/s|padding \(%|final eval loss|step mode|step time median|peak GPU memory)' "$W/logs/$tag.log" | tr -s ' ' | tr '\n' ' ')"
    [ $rc -eq 0 ] || tail -4 "$W/logs/$tag.log"
}

case "$series" in
suite)
    t0=$SECONDS
    PYTEST_ARGS="-vv --timeout 300" PYTEST_FAILURES_FILE=$W/logs/failures.txt timeout -k 10 520 make test > "$W/logs/suite.log" 2>&1
    echo "make test rc=$? in $((SECONDS - t0)) s"
    tail -3 "$W/logs/suite.log"
    grep -E "^(FAILED|ERROR)" "$W/logs/suite.log" | head -30
    ;;
timing)
    B="--model llama-3.1-8b --batch-size 4 --seq-len 2048 --steps 12"
    run t_8b_bf16 finetune_optimized.py $B
    run t_8b_fp8  finetune_optimized.py $B --fp8
    run t_8b_lora finetune_optimized.py $B --lora-r 16
    S="--model smollm2-135m --dataset examples/chat.jsonl --seq-len 512 --batch-size 8 --steps 60"
    run t_smol_packed finetune_optimized.py $S
    run t_smol_padded finetune_optimized.py $S --no-packing
    [ -n "${SKIP_PEERS:-}" ] || timeout -k 10 150 python3 devrun/peers.py > "$W/logs/smol_peers.log" 2>&1; echo "peers rc=$?"; grep -E "^hf_" "$W/logs/smol_peers.log"; tail -3 "$W/logs/smol_peers.log" | cut -c1-400
    ;;
esac
tar czf "$OUT/$series.tgz" -C "$W" logs json
