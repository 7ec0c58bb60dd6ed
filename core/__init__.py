"""The ground floor: what the kernel lessons stand on, and nothing that stands on them.

    kernel_utils    what every kernel file shares: device and input checks, launch helpers, the interpreter
    gpu_arch        the GPU generation of a compute capability: every choice made by architecture asks it
    model_families  the Hugging Face families the kernels know (llama, mistral, qwen2/3, gemma/2, phi3)
    process         the process's rank under torchrun, and its log lines
    tensors         float64 fingerprints of tensors
    losses          what every fused loss shares: options, checks, reductions, outputs, Hugging Face's shift
    fp8_support     the FP8 recipes, what each can run on which GPU, the size rule (the FP8 lessons' ground)

A module here imports torch, triton and the standard library, never a lesson (`*_kernel.py`) or the training
library above the lessons (`playbook/`): tests/layout_test.py holds it to that.
"""
