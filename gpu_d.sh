#!/bin/bash
# H100 run: does the optimized 4 x 2048 step fit 80 GB; RoPE / SwiGLU / CE benchmarks; profile with every kernel.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/logs/gpu.txt
for spec in "e2e_all_b4_h100|finetune_optimized.py|" "e2e_base_b4_h100|finetune_baseline.py|"; do
  IFS='|' read -r name script rest <<< "$spec"
  timeout 200 python3 $script --model llama-3.1-8b --batch-size 4 --seq-len 2048 --steps 8 --warmup-steps 2 --tag $name > $OUT/logs/$name.log 2>&1
  echo "$name rc=$?"; grep -E "tokens/s \(job\)|peak GPU|final loss|Out of GPU" $OUT/logs/$name.log | head -5
done
cp results/e2e_*h100.json $OUT/logs/ 2>/dev/null
timeout 150 python3 profile_baseline.py --model llama-3.1-8b --batch-size 1 --seq-len 512 --use-custom-rmsnorm --use-custom-flce --use-custom-swiglu --use-custom-rope > $OUT/logs/profile_all_b1_h100.log 2>&1
echo "profile rc=$?"; head -40 $OUT/logs/profile_all_b1_h100.log | tail -28
timeout 200 python3 benchmark_kernels.py --kernel rope > $OUT/logs/bench_rope_h100.log 2>&1; echo "rope rc=$?"; tail -14 $OUT/logs/bench_rope_h100.log | cut -c1-240
cp results/benchmark_H100_80GB_HBM3.json $OUT/logs/benchmark_rope_H100.json
timeout 100 python3 benchmark_kernels.py --kernel swiglu --sizes 8192 > $OUT/logs/bench_swiglu_h100.log 2>&1; echo "swiglu rc=$?"; tail -6 $OUT/logs/bench_swiglu_h100.log | cut -c1-240
cd $OUT && tar czf h100_$(date +%s).tgz logs && rm -rf logs
