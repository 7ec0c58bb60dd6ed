"""The one start-up of every script: what a process sets before torch, CUDA and the kernels load.

    from playbook.startup import start

    if __name__ == "__main__":
        start("nothing was run")   # first, before the imports of torch and of the kernel files

Code of your own that uses the kernels (`registry.apply_kernels`, a lesson's functions) calls `start()`
first too: the environment defaults and Triton's interpreter without a GPU, its Ctrl-C left as it is.

Importing a playbook module or a kernel file changes no environment variable, signal handler or
third-party function; `start()` does, in this order:

1. The environment. First the variables the scripts read are checked (playbook/runtime/environment.py): a bad
   value (PLAYBOOK_FREE_MEMORY_GB=abc) stops the script with one line naming it and what it takes, exit
   code 2, as a bad flag does; an empty or blank WORLD_SIZE, RANK or LOCAL_RANK, which means the default,
   is unset, as the libraries that read it take only a number. Then the defaults, each read by a library when
   it starts, so set before it does; a value already in the environment is kept:
   - CUDA_SCALE_LAUNCH_QUEUES=4x. The CUDA driver queues launched work in a command buffer of fixed
     size per stream, and a host that submits faster than the GPU runs blocks once it is full. A
     replayed CUDA graph is such a burst: the LoRA step's graph overflows the default buffer, and the
     replay call then waits for the GPU instead of returning; four times the buffer holds the whole
     step (docs/troubleshooting.md). Read when CUDA initializes.
   - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. The caching allocator keeps freed blocks for
     tensors of their size, and a training step's mix of sizes (an 8B model's embedding gradient,
     activations, small norms) leaves gaps that no later tensor fits; expandable segments map and unmap
     pages, so freed memory serves any size (docs/memory.md: the largest runs that fit with them only).
     Read when CUDA first allocates.
   - HF_HUB_DISABLE_PROGRESS_BARS=1 when stderr is not a terminal: in a piped log (the walkthrough's
     steps, CI, a scheduler's output file) each redraw of a progress bar is a line of noise. Read when
     huggingface_hub and transformers are imported.
2. With `while_starting`, Ctrl-C and SIGTERM while the script starts: one line saying it, exit code
   130 or 143 (`playbook.runtime.signals.exit_on_ctrl_c_while_starting`), until `signals.run_main` (or
   `started()`) takes over. Without it (None) the handlers stay as they are (pytest's own, under
   conftest.py; an interactive session's).
3. With `while_starting` too (a script), standard output and standard error guarded
   (`playbook.runtime.output.guard`): a reader that went away (`| head`) silences the output and the script goes
   on, writing its files as usual; a full disk under stdout is one line on stderr, then the same.
4. With `kernels`, Triton's interpreter on a machine without a CUDA GPU
   (`core.kernel_utils.use_interpreter_without_gpu`): this imports torch and triton, under
   the handlers of 2. A script that runs no kernel in its own process, or that must run before torch
   is installed (`selfcheck.py --index-url`), passes kernels=False.

This module imports no torch (the set-up check runs before torch is installed).
"""

import os
import sys

from playbook.runtime import environment, output, signals

ENV_DEFAULTS = {
    "CUDA_SCALE_LAUNCH_QUEUES": "4x",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}
PIPED_ENV_DEFAULTS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # when stderr is not a terminal


def set_env_defaults() -> None:
    """Step 1 of `start()`: the environment defaults (module docstring); a value already set is kept."""
    defaults = dict(ENV_DEFAULTS)
    if not (sys.stderr is not None and sys.stderr.isatty()):
        defaults.update(PIPED_ENV_DEFAULTS)
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


def start(while_starting: str | None = None, *, kernels: bool = True) -> None:
    """Start a script (module docstring): the environment's variables checked and its defaults set, then
    Ctrl-C and SIGTERM as one line saying `while_starting` until the script's own handling takes over, and its
    output guarded against a closed pipe and a full disk (None: both left as they are), then, with `kernels`,
    Triton's interpreter where there is no CUDA GPU. Call it first, before torch and the kernel files are
    imported; calling it again changes nothing more."""
    environment.check()  # a bad value of a variable the scripts read: one line, exit code 2
    environment.unset_blank_torchrun()  # an empty WORLD_SIZE is unset, for every library that reads it
    set_env_defaults()
    if while_starting is not None:
        signals.exit_on_ctrl_c_while_starting(while_starting)
        output.guard()
    if kernels:
        from core import kernel_utils

        kernel_utils.use_interpreter_without_gpu()
