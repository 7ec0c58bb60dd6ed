#!/usr/bin/env bash
# Device series for the redesign:  bash devrun/round.sh NAME
# Step times first (8B preset at 4 x 2048 on synthetic tokens, 12 steps; SmolLM2 on examples/chat.jsonl at 8 x 512,
# 60 steps, packed), then the whole test suite as `make test` runs it on a GPU, in the time left of one call.
. devrun/env.sh
name="$1"
W=/root/round_$name; rm -rf $W; mkdir -p $W/logs $W/json
{ echo "tree: $(cat devrun/REV 2>/dev/null)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > $W/logs/env.txt 2>&1
cat $W/logs/env.txt
T0=$SECONDS
run() {  # run TAG SCRIPT ARGS...
    local tag="$1"; shift
    local t0=$SECONDS
    timeout -k 10 150 python3 "$@" --tag "$tag" --overwrite > "$W/logs/$tag.log" 2>&1
    local rc=$?
    cp "results/$tag.json" "$W/json/" 2>/dev/null
    echo "$tag rc=$rc $((SECONDS - t0)) s: $(grep -E '^\| (tokens/s|step time median|peak GPU memory|final eval loss)' "$W/logs/$tag.log" | tr -s ' ' | tr '\n' ' ')"
    [ $rc -eq 0 ] || tail -4 "$W/logs/$tag.log"
}
run t_8b_bf16 finetune_optimized.py --model llama-3.1-8b --batch-size 4 --seq-len 2048 --steps 12
run t_smol_packed finetune_optimized.py --model smollm2-135m --dataset examples/chat.jsonl --seq-len 512 --batch-size 8 --steps 60
left=$((575 - (SECONDS - T0)))
echo "suite gets $left s"
t0=$SECONDS
PYTEST_ARGS="-rfE --timeout 300" timeout -k 10 $left make test > $W/logs/tests.log 2>&1
echo "make test rc=$? in $((SECONDS - t0)) s" | tee -a $W/logs/tests.log
tail -3 $W/logs/tests.log
grep -E "^(FAILED|ERROR)" $W/logs/tests.log | head -30
tar czf $OUT/round.tgz -C $W logs json
