"""Fine-tune LLaMA 3.1 8B with the fused Triton kernels: RMSNorm, linear cross-entropy, SwiGLU, RoPE.

    $ python finetune_optimized.py --model llama-3.1-8b --batch-size 4 --seq-len 2048
    $ python finetune_optimized.py --model llama-3.1-8b --optimizer-in-backward   # -1 copy of the grads
    $ python finetune_optimized.py --kernels rmsnorm,ce       # the original playbook's two kernels
    $ python finetune_optimized.py --kernels liger            # Liger-Kernel instead (a peer)
    $ torchrun --nproc-per-node 2 finetune_optimized.py --model llama-3.1-8b   # FSDP2

The same loop as finetune_baseline.py (common.train) from the same seed and data, after
`apply_kernels(model)` swaps every RMSNorm module for TritonRMSNorm, fuses lm_head with the loss
(the [tokens, vocab] logits are never built), and replaces the MLPs' silu(gate) * up and the
attention's rotary embedding with fused kernels. The summary is saved as JSON under results/ next
to the baseline's.
"""

from common import base_parser, finish_args, parse_kernels, train

if __name__ == "__main__":
    args = finish_args(base_parser(__doc__.splitlines()[0], kernels_default="rmsnorm,flce,swiglu,rope").parse_args())
    train(args, kernels=parse_kernels(args.kernels), script="finetune_optimized")
