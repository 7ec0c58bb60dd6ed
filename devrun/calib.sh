#!/usr/bin/env bash
# Calibration of the walkthrough's settings: the 8B preset (random weights) and SmolLM2-135M-Instruct on
# examples/chat.jsonl, baseline against the kernels with the same optimizer arithmetic (rounding to nearest), at
# several learning rates with warm-up and linear decay; and SmolLM2's three roundings.
. devrun/env.sh
W=/root/calib; mkdir -p $W/logs $W/json
run() {  # TAG SCRIPT ARGS...
    local tag=$1; shift
    timeout -k 10 240 python3 "$@" --tag "$tag" --overwrite > $W/logs/$tag.log 2>&1; local rc=$?
    cp results/$tag.json $W/json/ 2>/dev/null
    echo "$tag rc=$rc: $(grep -E 'eval loss|^\| (tokens/s \(job|peak GPU)' $W/logs/$tag.log | tr -s ' ' | tr '\n' ' ' | cut -c1-600)"
}
D="--dataset examples/chat.jsonl --packing"
B8="$D --model llama-3.1-8b --batch-size 4 --seq-len 2048 --steps 12 --lr-schedule linear --warmup-ratio 0.1 --eval-every 3"
S="--model smollm2-135m --dataset examples/chat.jsonl --batch-size 8 --seq-len 512 --epochs 3 --lr-schedule linear --warmup-ratio 0.1 --eval-every 2 --log-every 2"
( for lr in 2e-5 5e-5 1e-4; do
    run c8_base_$lr finetune_baseline.py $B8 --lr $lr
    run c8_near_$lr finetune_optimized.py $B8 --lr $lr --optimizer-rounding nearest
  done ) > $W/logs/chain8.txt 2>&1 &
sleep 5
python3 finetune_baseline.py --model smollm2-135m --dataset examples/chat.jsonl --batch-size 8 --seq-len 512 --steps 2 --timing-warmup-steps 1 --tag c_s_warm --overwrite > $W/logs/c_s_warm.log 2>&1  # converts the GGUF once
for lr in 2e-5 5e-5 1e-4; do
    pids=()
    run cs_base_$lr finetune_baseline.py $S --lr $lr & pids+=($!)
    run cs_near_$lr finetune_optimized.py $S --lr $lr --optimizer-rounding nearest & pids+=($!)
    run cs_kahan_$lr finetune_optimized.py $S --lr $lr & pids+=($!)
    run cs_fp32_$lr finetune_optimized.py $S --lr $lr --master-weights fp32 & pids+=($!)
    wait "${pids[@]}"
done > $W/logs/chains.txt 2>&1
wait
cat $W/logs/chain8.txt $W/logs/chains.txt
tail -5 $W/logs/c_s_warm.log
tar czf $OUT/calib.tgz -C $W logs json
