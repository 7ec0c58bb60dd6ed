"""Small helpers shared by the kernel files: where kernels run, how inputs are checked, and how a
backward operator refuses a second derivative.

Without a CUDA GPU, `use_interpreter_without_gpu()` switches Triton to its interpreter
(`TRITON_INTERPRET=1`), which runs every kernel on CPU tensors with NumPy: slow, but close enough to test
every kernel on a laptop or in CI. One difference to know: the interpreter converts fp32 to bf16 by
truncation, where a GPU rounds to nearest even, so bf16 results on a CPU can be 1 ulp off from the same
kernel on a GPU (the tests' tolerance allows for it).

Importing this module changes nothing: the switch is a call, made by `playbook.startup.start()` (every
script, and conftest.py for the tests) before any kernel file is imported. Triton reads the variable when
`@triton.jit` decorates a function, so a kernel file imported before the switch holds kernels made for the
GPU, and `check_device` refuses CPU tensors there with the fix. Triton's own `@triton.jit` helpers (the
combine functions behind `tl.sum`, `tl.max`, ...) are made when `triton` is first imported: by another
library (transformers, peft) or the user before the switch, they were made for the GPU, and a kernel in
the interpreter that calls one would stop with "Cannot call @triton.jit'd outside of the scope of a
kernel". Such a helper is then run the way the interpreter runs its own (`_interpret_early_helpers`).
"""

import inspect
import os
import sys

import torch

_TRUE = ("1", "true", "on", "yes", "y")  # what Triton reads as a true TRITON_INTERPRET


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter now: TRITON_INTERPRET, read as Triton reads it."""
    knobs = getattr(sys.modules.get("triton"), "knobs", None)  # Triton 3.4 and later, once imported
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


INTERPRET = interpreting()  # the kernels run in the interpreter; use_interpreter_without_gpu() sets it again
START_UP_FIX = ("call playbook.startup.start() (or set TRITON_INTERPRET=1) before importing the kernel files, "
                "to run them on the CPU in Triton's interpreter")


def use_interpreter_without_gpu() -> bool:
    """Without a CUDA GPU, switch Triton to its interpreter: TRITON_INTERPRET=1 (a value already set, such
    as TRITON_INTERPRET=0, is kept), and the interpreter's fix-ups below. Call it before any kernel file is
    imported (`playbook.startup.start()` does); a kernel file imported before is refused here with the fix.
    Returns whether the kernels run in the interpreter; calling it again changes nothing."""
    global INTERPRET

    triton_imported_before = "triton" in sys.modules  # by another library or the user (module docstring)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton  # noqa: F401  (after the switch: Triton's own helpers are made for the interpreter)

    INTERPRET = interpreting()
    if INTERPRET:
        if triton_imported_before:
            _refuse_kernels_made_for_the_gpu()
            _interpret_early_helpers()
        _interpret_loaded_scalars_as_indices()
    return INTERPRET


def _refuse_kernels_made_for_the_gpu() -> None:
    """A kernel file (`<name>_kernel`) imported before the switch holds kernels made for the GPU, which the
    interpreter cannot launch: say which, and the fix."""
    from triton.runtime.jit import JITFunction

    early = sorted(name for name, module in list(sys.modules.items())
                   if name.endswith("_kernel") and "." not in name
                   and any(isinstance(v, JITFunction) for v in vars(module).values()))
    if early:
        raise RuntimeError(f"{', '.join(early)} imported before Triton's interpreter was switched on: its kernels "
                           f"were made for the GPU, and this machine has none; {START_UP_FIX}")


def _interpret_early_helpers() -> None:
    """Run a `@triton.jit` function made before the interpreter was switched on (Triton's helpers, when
    `triton` was imported first) as the interpreter runs a device function: `triton.jit` in interpreter
    mode would have made it an InterpretedFunction, whose call runs the Python body on the
    interpreter's tensors. Outside the interpreter such a call raises, as before. Done once."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    gpu_call = JITFunction.__call__
    if getattr(gpu_call, "interprets_early_helpers", False):
        return

    def call(self, *args, **kwargs):
        if not interpreting():
            return gpu_call(self, *args, **kwargs)
        interpreted = self.__dict__.get("_interpreted")
        if interpreted is None:
            interpreted = self.__dict__["_interpreted"] = InterpretedFunction(self.fn)
        return interpreted(*args, **kwargs)

    call.interprets_early_helpers = True
    JITFunction.__call__ = call


def _interpret_loaded_scalars_as_indices() -> None:
    """Triton 3.6's interpreter holds a scalar loaded from memory as a 1-element array, and its `__index__`
    (a loop bound such as `range(0, n // BLOCK)` in adamw_kernel.py) then fails under numpy 2 ("only
    0-dimensional arrays can be converted to Python scalars"); later releases squeeze the array first. Where
    the interpreter patches tensors without that squeeze, add it after each patching (once)."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or "squeeze" in inspect.getsource(patch):
        return

    def patched(tensor, scope, *args, **kwargs):
        patch(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on `device` (persistent kernels launch a few programs per SM).

    On CPU (the interpreter) we pretend to have 4, which keeps the grid-stride loops exercised.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_device(t: torch.Tensor, *others: torch.Tensor) -> None:
    for o in others:
        if o.device != t.device:
            raise ValueError(f"all tensors must be on one device, got {t.device} and {o.device}")
    if t.device.type == "meta":  # shapes only: the operators' fake functions answer (direct_launch)
        return
    if t.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            f"tensors are on {t.device}, but Triton compiles for the GPU here; move them to CUDA, or "
            + START_UP_FIX
        )


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View `t` as a 2-D [rows, last_dim] matrix whose last dimension has unit stride.

    The kernels take any row stride (so a slice like x[:, ::2] of rows costs nothing), but need
    the elements of a row next to each other for wide, coalesced loads. A view is returned when
    one exists; otherwise (a transposed or column-sliced tensor) this makes one contiguous copy.
    """
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.shape[-1] > 1 and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), as triton.next_power_of_2."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def refuse_double_backward(op, kernel: str) -> None:
    """Give a backward custom op an autograd rule that refuses, clearly, to be differentiated.

    The fused backward kernels compute first derivatives only. A second derivative
    (`torch.autograd.grad(..., create_graph=True)` followed by another backward) reaches the
    backward op, and this rule turns that into one readable error instead of a wrong or zero
    result. Ordinary training never calls it: a backward pass runs with gradients off.
    """

    def second_order(ctx, *grads):
        raise RuntimeError(f"{kernel}: second-order gradients (differentiating the backward pass) are not supported "
                           f"by the fused kernel; use the plain PyTorch reference for double backward")

    torch.library.register_autograd(op, second_order)


def direct_launch(*tensors: torch.Tensor) -> bool:
    """True when the launchers may run on these tensors directly: plain tensors (or Parameters) with
    data (meta tensors go through the operators, whose fake functions give the output shapes), no
    compiler tracing, no dispatch mode on the stack (FakeTensorMode, functionalization, ...)."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta for t in tensors))
