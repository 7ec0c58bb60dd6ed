"""What the process shares with every part of the playbook: usage errors, the terminal, the GPU (its name,
bf16 peak and host memory, a synchronize), the versions a result records, whether an error is an out-of-memory one
(the advice is playbook/plan/oom.py's), and stderr lines filtered. log(), the processes (torchrun) and whether a
model is a peft model are core/process.py's; results/ files and the atomic writer are playbook/store/files.py's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import torch
import transformers
import triton
from playbook.sections import RunConfig


# Dense bf16 tensor-core peak (no sparsity) by device name, for model FLOPs utilisation.
BF16_PEAK_TFLOPS = {
    "H100 80GB HBM3": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0,
    "H200": 989.0, "GH200": 989.0, "B200": 2250.0, "GB200": 2500.0, "B300": 2500.0, "GB300": 2500.0,
    "A100": 312.0,
}


# ------------------------------------------------------------------------------------------------
# Processes (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK)
# ------------------------------------------------------------------------------------------------
def usage_error(message: str) -> SystemExit:
    """A bad argument found after parsing: one line on stderr, exit code 2 (as argparse does)."""
    print(f"error: {message}", file=sys.stderr)
    return SystemExit(2)


def interactive() -> bool:
    """True on a terminal: progress bars there, plain log lines in piped logs."""
    return sys.stderr.isatty()


# ------------------------------------------------------------------------------------------------
# The GPU
# ------------------------------------------------------------------------------------------------
def gpu_bf16_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(BF16_PEAK_TFLOPS, key=len, reverse=True):  # most specific name first
        if key in name:
            return BF16_PEAK_TFLOPS[key]
    return None


def describe_gpu(device: torch.device) -> str:
    if device.type != "cuda":
        return "CPU"  # the kernels run in Triton's interpreter there: the runs that use them say so
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} ({p.total_memory / 2**30:.0f} GiB)"


def host_memory_limit() -> int | None:
    """Bytes of memory this process may use: the machine's RAM, or a lower cgroup limit (a container's,
    a job's); None where neither can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            limits.append(int(text))
    return min(limits) if limits else None


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a sync point: the host waits for the GPU to finish


def versions() -> dict:
    v = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
         "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
    return v


# What allocators say when memory runs out, besides torch.cuda.OutOfMemoryError: cuBLAS cannot create
# its handle or workspace when the GPU is full; PyTorch's CPU allocator "can't allocate memory" (Linux)
# or has "not enough memory" (Windows).
OOM_MESSAGES = ("CUBLAS_STATUS_ALLOC_FAILED", "out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(err: BaseException) -> bool:
    """True for PyTorch's OutOfMemoryError and for the plain RuntimeErrors of an allocation that failed
    (OOM_MESSAGES), on the GPU or the CPU."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(s in str(err) for s in OOM_MESSAGES))


@contextlib.contextmanager
def without_stderr_lines(prefix: str):
    """Drop the lines starting with `prefix` that C++ code writes to the process's stderr (file descriptor
    2) inside the block; every other line passes through unchanged. For a library's notices that no setting
    silences alone: Kineto, the profiler's backend, prints "USDT: ... profiler_start" and "profiler_stop"
    at a level that only a setting which also hides its errors (KINETO_LOG_LEVEL=6) would silence."""
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def forward():
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                if not line.startswith(prefix.encode()):
                    os.write(saved, line)

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closes: forward() reads to its end and returns
        thread.join()
        os.close(saved)
