"""The run: its start, the same for every script that trains (start: settle, build, run_errors), the one training
loop (training), the step runner (step) and its CUDA graph, resuming, the summary and results, the best eval, the
kernels on a CPU (interpreter)."""
