"""The training library: imported by the scripts, never run on its own. It stands on the kernel lessons
(`*_kernel.py`), which stand on `core/`; no lesson and no module of core imports anything here.

One folder per concern, each importing only the folders listed above it (tests/layout_test.py holds the order):

    sections.py  the RunConfig and its sections (frozen dataclasses): the type every part below config/ takes
    runtime/   the process: environment variables, signals, stdout on a closed pipe, logging and the GPU,
               progress lines, the set-up checks
    store/     what is on disk: checkpoints, results files, files written atomically
    memory/    activation checkpointing (selective, offloaded) and the MLP in token chunks
    optim/     the optimizer (AdamW as --optimizer names it, how it rounds bf16 weights) and the learning-rate
               schedule
    model/     presets, pretrained weights, loading and preparing a model, the optimization registry, LoRA,
               packed attention, greedy decoding
    data/      datasets: text, JSONL, chat and instruction formats, packing; reading the files
    plan/      the peak memory a run will need, estimated before the model is built
    config/    the one argument parser every script shares (flags.py) and its checks, into a RunConfig
    run/       the run's start (one for every script), the training loop and what it drives: step, CUDA graph,
               resume, report, best eval, the kernels on a CPU (Triton's interpreter)
    startup.py start(): what every script calls first (environment defaults, Ctrl-C while starting, Triton's
               interpreter without a GPU); importing any module here changes none of it

Beside the library: `benchmarks/` (benchmark_kernels.py's timing and its table of kernels) and `testkit/`
(the tolerances and the short report the *_test.py files print).

Nothing here imports torch at package import, so `selfcheck.py --index-url` runs before torch is installed.
"""
