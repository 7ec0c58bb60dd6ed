"""Fine-tune LLaMA 3.1 8B with plain Hugging Face + PyTorch: the baseline to beat.

    $ python finetune_baseline.py --model llama-3.1-8b --batch-size 4 --seq-len 2048
    $ python finetune_baseline.py --model meta-llama/Llama-3.1-8B --data my_corpus.txt
    $ torchrun --nproc-per-node 2 finetune_baseline.py --model llama-3.1-8b   # FSDP2
    $ python finetune_baseline.py            # no GPU: the llama-tiny preset on the CPU

Prints a progress bar, the loss every few steps, and a summary (step time, tokens/s, model FLOPs
utilisation, peak GPU memory), saved as JSON under results/. `finetune_optimized.py` runs the very
same loop (common.train) with the Triton kernels applied; compare the two summaries.
"""

from common import base_parser, finish_args, train

if __name__ == "__main__":
    args = finish_args(base_parser(__doc__.splitlines()[0]).parse_args())
    train(args, kernels={"rmsnorm": False, "cross_entropy": False}, script="finetune_baseline")
