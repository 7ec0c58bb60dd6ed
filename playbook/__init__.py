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
