#!/usr/bin/env bash
# Device series: `make run` whole, as the README says (after `bash devrun/half1.sh` on the same machine).
. devrun/env.sh
W=/root/walk; rm -rf $W; mkdir -p $W
{ git_rev=$(cat devrun/REV 2>/dev/null); echo "tree: $git_rev"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > $W/env.txt 2>&1
cat $W/env.txt
t0=$SECONDS
set -o pipefail
timeout -k 10 575 make run > $W/walkthrough.log 2>&1
rc=$?
echo "make run rc=$rc in $((SECONDS - t0)) s" | tee -a $W/walkthrough.log
grep -E "^\[Step|took|ended .* after|the number|within|^Step 4e|rounding|eval loss .* ->" $W/walkthrough.log | cut -c1-220 | tail -60
cp results/walkthrough_*.json $W/ 2>/dev/null
tar czf $OUT/walk.tgz -C $W .
