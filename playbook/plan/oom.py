"""The out-of-memory advice: what a run that ran out of memory says, and the settings that need less than its own
(the memory plan's offers are the estimated ones, before a run starts: playbook/plan/offers.py).
"""

from __future__ import annotations

import torch

from playbook.memory import options
from playbook.runtime.common import describe_gpu
from playbook.sections import RunConfig


def oom_message(cfg: RunConfig, err: Exception) -> str:
    """What to do when memory ran out: the batch, the peak on a GPU, the settings that need less."""
    if cfg.run.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(cfg.run.device) / 1e9
        total = torch.cuda.get_device_properties(cfg.run.device).total_memory / 1e9
        where = (f"out of GPU memory at batch {cfg.data.batch_size} x {cfg.data.seq_len} tokens (peak allocated {peak:.1f} GB "
                 f"of {total:.1f} GB on {describe_gpu(cfg.run.device)})")
    else:
        where = f"out of memory at batch {cfg.data.batch_size} x {cfg.data.seq_len} tokens ({describe_gpu(cfg.run.device)})"
    return (
        f"\nerror: {where}.\n"
        f"Try: {'; '.join(memory_hints(cfg))}.\n"
        f"PyTorch said: {str(err).splitlines()[0][:300]}"
    )


def memory_hints(cfg: RunConfig) -> list[str]:
    """The settings that need less memory than this run's, the options it already has left out."""
    hints = ["a smaller --batch-size (with --grad-accum to keep the tokens per step) or --seq-len"]
    if cfg.training.optimizer_rounding == "kahan":
        hints.insert(0, "--optimizer-rounding stochastic (no memory for the Kahan buffer, 2 bytes per weight; "
                        "docs/quality.md compares them)")
    hints += options.hints(options.values(cfg), options.Context(on_gpu=cfg.on_gpu, seq_len=cfg.data.seq_len))
    if not cfg.model.lora_r:
        hints.append("for a full fine-tune, the options of docs/memory.md's 'A full fine-tune in less memory' "
                     "(--optimizer-in-backward, --recompute-norms, --offload-layers)")
        hints.append("--lora-r 16 instead of a full fine-tune")
    elif not cfg.model.load_in_4bit:
        hints.append("--load-in-4bit (QLoRA: the frozen projections in NF4)")
    if cfg.run.defaults is not None and cfg.run.defaults.memory_hint:  # the script's own (config.ScriptDefaults)
        hints.append(cfg.run.defaults.memory_hint)
    hints.append("fewer layers with --num-layers to measure a slice of the model")
    hints.append("several GPUs with torchrun (FSDP2 shards parameters, gradients and optimizer state)")
    return hints
