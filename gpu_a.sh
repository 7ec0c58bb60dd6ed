#!/bin/bash
# Device run A: kernel tests on the GPU, then benchmarks of the new kernels.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 200 python3 -m pytest -q -x linear_cross_entropy_test.py rope_test.py swiglu_test.py cross_entropy_test.py rmsnorm_test.py 2>&1 | tail -15 | tee $OUT/gpu_tests.log
timeout 330 python3 benchmark_kernels.py --kernel linear_cross_entropy 2>&1 | tee $OUT/bench_flce.log | tail -30
cp results/benchmark_*.json $OUT/ 2>/dev/null
