"""Fine-tune LLaMA 3.1 8B with the fused Triton kernels: RMSNorm, linear cross-entropy, SwiGLU, RoPE.

    $ python finetune_optimized.py --model llama-3.1-8b --batch-size 4 --seq-len 2048
    $ python finetune_optimized.py --model meta-llama/Llama-3.1-8B --dataset examples/chat.jsonl \
          --epochs 1 --grad-accum 4 --lr 2e-5 --lr-schedule cosine --warmup-ratio 0.05 --output-dir out
    $ python finetune_optimized.py --model llama-3.1-8b --lora-r 16          # LoRA through peft
    $ python finetune_optimized.py --kernels rmsnorm,cross_entropy            # two kernels only
    $ python finetune_optimized.py --kernels liger                            # Liger-Kernel instead (a peer)
    $ torchrun --nproc-per-node 2 finetune_optimized.py --model llama-3.1-8b  # FSDP2

The same loop as finetune_baseline.py (training.train) from the same seed and data, after
`apply_kernels(model)` swaps every RMSNorm module for TritonRMSNorm, fuses lm_head with the loss
(the [tokens, vocab] logits are never built), and replaces the MLPs' silu(gate) * up and the
attention's rotary embedding with fused kernels. docs/optimizations.md lists every optimization (playbook/model/registry.py).
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("nothing was run")

from playbook.model.registry import DEFAULT_KERNELS  # noqa: E402
from playbook.config import OPTIMIZED, make_parser, parse_config  # noqa: E402
from playbook.run.training import train  # noqa: E402  (train() hands Ctrl-C back to its own handling)

if __name__ == "__main__":
    from playbook.runtime.setup_check import check_or_exit

    check_or_exit()
    train(parse_config(make_parser(__doc__.splitlines()[0], kernels_default=DEFAULT_KERNELS), OPTIMIZED))
