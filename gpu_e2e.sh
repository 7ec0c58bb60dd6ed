#!/bin/bash
# Device runs: GPU tests (optional), then end-to-end fine-tuning runs given as "name|args" lines on stdin.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
mkdir -p $OUT/logs
if [ "$TESTS" = 1 ]; then
  timeout 240 python3 -m pytest -q linear_cross_entropy_test.py rope_test.py swiglu_test.py cross_entropy_test.py rmsnorm_test.py 2>&1 | tail -8 > $OUT/logs/gpu_tests.log
  cat $OUT/logs/gpu_tests.log
fi
while IFS='|' read -r name script rest; do
  [ -z "$name" ] && continue
  echo "=== $name: python $script $rest"
  timeout ${RUN_LIMIT:-200} python3 $script --model llama-3.1-8b --steps 8 --warmup-steps 2 --tag $name $rest > $OUT/logs/$name.log 2>&1
  echo "rc=$?"; grep -E "tokens/s \(job\)|peak GPU|final loss|step time median|Out of GPU|Error|error" $OUT/logs/$name.log | head -8
done
cp results/e2e_*.json $OUT/logs/ 2>/dev/null
cd $OUT && tar czf e2e_$(date +%s).tgz logs && rm -rf logs
