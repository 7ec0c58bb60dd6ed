"""Fine-tune LLaMA 3.1 8B with plain Hugging Face + PyTorch: the baseline to beat.

    $ python finetune_baseline.py --model llama-3.1-8b --batch-size 4 --seq-len 2048
    $ python finetune_baseline.py --model meta-llama/Llama-3.1-8B --dataset examples/chat.jsonl --epochs 1
    $ torchrun --nproc-per-node 2 finetune_baseline.py --model llama-3.1-8b   # FSDP2
    $ python finetune_baseline.py            # no GPU: the llama-tiny preset on the CPU

Prints progress, the loss every few steps, and a summary (step time, tokens/s, model FLOPs
utilisation, peak GPU memory), saved as JSON under results/ with the loss curve. It takes every
flag of finetune_optimized.py except --kernels: both run the very same loop (training.train), so
the two summaries compare the kernels and nothing else.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("nothing was run")

from playbook.config import BASELINE, make_parser, parse_config  # noqa: E402
from playbook.run.training import train  # noqa: E402  (train() hands Ctrl-C back to its own handling)

if __name__ == "__main__":
    from playbook.runtime.setup_check import check_or_exit

    check_or_exit()
    train(parse_config(make_parser(__doc__.splitlines()[0]), BASELINE))  # eager steps, Hugging Face's attention
