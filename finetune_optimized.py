"""Fine-tune LLaMA 3.1 8B with the fused Triton kernels applied: RMSNorm, cross-entropy, SwiGLU.

    $ python finetune_optimized.py --model llama-3.1-8b --batch-size 4 --seq-len 2048
    $ python finetune_optimized.py --kernels rmsnorm,ce       # the original playbook's two kernels
    $ torchrun --nproc-per-node 2 finetune_optimized.py --model llama-3.1-8b   # FSDP2

The same loop as finetune_baseline.py (common.train) from the same seed and data, after
`apply_kernels(model)` swaps every RMSNorm module for TritonRMSNorm, the loss for the fused
cross-entropy (its gradient written into the logits' own memory) and the MLPs' silu(gate) * up for
the fused SwiGLU: the fastest combination measured (README). The summary is saved as JSON under
results/ next to the baseline's.
"""

from common import base_parser, finish_args, parse_kernels, train

if __name__ == "__main__":
    args = finish_args(base_parser(__doc__.splitlines()[0], kernels_default="rmsnorm,ce,swiglu").parse_args())
    train(args, kernels=parse_kernels(args.kernels), script="finetune_optimized")
