"""The playbook's library: imported by the scripts and the kernel lessons, never run on its own.

    config         RunConfig and the one argument parser every script shares
    registry       every optimization a user can switch on, by name, and how it is applied
    models         presets (the LLaMA 3.1 8B architecture, llama-tiny), loading, prepare_model
    model_families the Hugging Face families the kernels know (llama, mistral, qwen2/3, gemma/2, phi3)
    training       the one training loop (train), optimizer, schedule, summary
    cuda_graph     the whole training step captured as one CUDA graph and replayed (--cuda-graphs)
    memory         selective and offloaded activation checkpointing, the MLP in token chunks
    data           datasets: plain text, JSONL, chat and instruction formats, packing
    checkpoint     saving and resuming runs
    lora           LoRA through peft, and the fused LoRA path
    kernel_utils   what every kernel file shares (device choice, input checks, interpreter switch)
    setup_check    the set-up checks (GPU, driver, torch build) run by `make`
    testkit        tolerances and the short test report the *_test.py files print

Nothing here imports torch at package import, so `selfcheck.py --index-url` runs before torch is installed.
"""

import os

# The CUDA driver queues launched work in a command buffer of fixed size per stream; a host that
# submits faster than the GPU runs blocks once it is full. A replayed CUDA graph is such a burst: the
# LoRA step's graph (7 adapters per layer, forward and backward) overflowed the default buffer, and on
# an H200 the replay call returned only after the GPU had run 193 ms of its 498 ms step (behind a
# 300 ms kernel: after 495 ms, so the wait tracks the GPU, not host work). Four times the buffer holds
# the whole step: the call returns in 1.7 ms. The variable is read when CUDA initializes, so it is set
# here, before any script touches the GPU; a value already in the environment is kept.
os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", "4x")

