"""The training library: imported by the scripts, never run on its own. It stands on the kernel lessons
(`*_kernel.py`), which stand on `core/` (the ground: kernel_utils, gpu_arch, model_families, process, tensors,
losses, fp8_support); no lesson and no module of core imports anything here.

    startup        start(): what every script calls first (environment defaults, Ctrl-C while starting,
                   Triton's interpreter without a GPU); importing any module here changes none of it
    signals        Ctrl-C and SIGTERM as one line and exit code 130 / 143 (run_main, started, interrupted)
    environment    the environment variables the scripts read (PLAYBOOK_FREE_MEMORY_GB, ...), each checked as a flag
    output         stdout on a closed pipe (quiet, the script goes on) or a full disk (one line); a results file
                   on a full disk (one line naming it)
    config         RunConfig and the one argument parser every script shares
    registry       every optimization a user can switch on, by name, and how it is applied
    models         loading a model and preparing it for training (kernels, LoRA, memory options)
    presets        the model presets (the LLaMA 3.1 8B architecture, llama-tiny) and the training dtype
    pretrained     real pretrained weights offline: SmolLM2-135M-Instruct, Llama-family GGUF files
    training       the one training loop (train) and the run around it: model, data, eval, checkpoints
    step           the step runner: eager, captured as a CUDA graph, or back to eager
    optim          the optimizer and the learning-rate schedule
    resume         the output folder's checks and resuming a run
    report         the run's summary table, metrics log, JSON result and loss plot
    time_left      the time a run has left, for its progress lines; a long pass's line while it runs
    cuda_graph     the whole training step captured as one CUDA graph and replayed (--cuda-graphs)
    memory         selective and offloaded activation checkpointing, the MLP in token chunks
    memory_plan    the peak memory a run will need, estimated before the model is built
    packed_attention  attention kept inside each example of a packed row
    data           datasets: plain text, JSONL, chat and instruction formats, packing
    data_files     reading .jsonl / .json / .parquet files and Hugging Face hub datasets
    checkpoint     saving and resuming runs
    lora           LoRA through peft, and the fused LoRA path
    generate       greedy decoding with the model's chat template (chat.py, --sample-prompts)
    common         processes, logging, the GPU, results files
    setup_check    the set-up checks (GPU, driver, torch build) run by `make`
    interpreter    the kernels on a CPU with a real model: the notice, the step-time estimate, the heartbeat
    testkit        tolerances and the short test report the *_test.py files print
    benchmark      benchmark_kernels.py's timing and reports; benchmark_specs: its table of kernels

Nothing here imports torch at package import, so `selfcheck.py --index-url` runs before torch is installed.
"""
