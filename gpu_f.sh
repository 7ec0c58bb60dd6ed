#!/bin/bash
# The final side-by-side: every configuration of the README's table in one device session.
RUN_LIMIT=240 bash gpu_e2e.sh <<'L'
e2e_base_b4|finetune_baseline.py|--batch-size 4 --seq-len 2048
e2e_playbook_b4|finetune_optimized.py|--batch-size 4 --seq-len 2048 --kernels rmsnorm,ce
e2e_all_b4|finetune_optimized.py|--batch-size 4 --seq-len 2048
e2e_allbwd_b4|finetune_optimized.py|--batch-size 4 --seq-len 2048 --optimizer-in-backward
e2e_liger_b4|finetune_optimized.py|--batch-size 4 --seq-len 2048 --kernels liger
e2e_compile_b4|finetune_baseline.py|--batch-size 4 --seq-len 2048 --compile
e2e_base_b8|finetune_baseline.py|--batch-size 8 --seq-len 2048
e2e_all_b8|finetune_optimized.py|--batch-size 8 --seq-len 2048
e2e_liger_b8|finetune_optimized.py|--batch-size 8 --seq-len 2048 --kernels liger
e2e_base_b1|finetune_baseline.py|--batch-size 1 --seq-len 512
e2e_all_b1|finetune_optimized.py|--batch-size 1 --seq-len 512
e2e_liger_b1|finetune_optimized.py|--batch-size 1 --seq-len 512 --kernels liger
L
