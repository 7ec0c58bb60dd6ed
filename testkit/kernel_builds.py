"""Every Triton kernel of the playbook built for sm_90, sm_100 and sm_103 on a machine without a GPU, and
held against each target's limits: a kernel that would not build on a GB300, or would not fit it, fails
here before a user meets it.

    $ PYTHONPATH=. TRITON_INTERPRET=0 python tests/kernel_builds_test.py    # every launch, every target
    $ PYTHONPATH=. TRITON_INTERPRET=0 python tests/kernel_builds_test.py --shapes 8b --targets sm_103 --jobs 2
    $ PYTHONPATH=. TRITON_INTERPRET=0 python tests/kernel_builds_test.py --lesson-targets sm_103    # as in CI

How it works, in three steps:

1. The launches. Each launcher of a kernel file is called as a training step calls it (`step_calls`: at
   LLaMA 3.1 8B's shapes, 4 x 2048 tokens, and at the lesson tests' small and odd shapes) on *meta*
   tensors: nothing is allocated and no kernel runs, but each launcher makes its own launch decisions
   (blocks, warps, stages, constexpr flags) from the shapes, exactly as on a GPU. `JITFunction.run` is
   replaced by a recorder for the duration (and `Autotuner.run` by one launch per config it would time),
   and Triton's own binder turns each recorded call into the signature, constexprs and alignment
   attributes a GPU launch would compile (a meta tensor's address is 0 plus its view's offset: as aligned
   as the same view of a fresh CUDA allocation, which is aligned to 256 bytes). The process must run with TRITON_INTERPRET=0: the interpreter's launch settings
   differ from the GPU's (larger blocks, software rounding), and a kernel run in the interpreter can leave
   `triton.language` patched for the compiler.
2. Discovery. Every `@triton.jit` function of the kernel files (`*_kernel.py`, `core/`, `playbook/`) that
   no other jitted function calls is a kernel; each must have been launched by step 1, or the run fails
   naming it. A new kernel file is found by itself; its launcher is one more line of `step_calls`.
3. The builds. Each distinct (kernel, signature, constexprs, options) is compiled with
   `triton.compile(ASTSource(...), target=GPUTarget("cuda", capability, 32))`, Triton's ahead-of-time
   path, which needs no GPU: the wheel carries a ptxas (CUDA 12.9 or newer knows sm_103). The cubin's
   registers and spills are read with the wheel's `cuobjdump -res-usage`, the shared memory from Triton's
   metadata (all of Triton's is dynamic, the figure Triton itself checks when it loads a kernel), and each
   is held against the target's limits (`LIMITS`).

What this proves: the kernels compile and fit each target's per-block limits. It says nothing of their
speed on Blackwell or of their results there; those need the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Per-block limits of the targets: the CUDA C++ Programming Guide's table of compute capabilities (CUDA 12.9 /
# 13.0) gives 9.0, 10.0 and 10.3 a maximum of 227 KB of shared memory per block (228 KB per SM, of which CUDA
# reserves 1 KB per block; the Hopper and Blackwell tuning guides say the same), 64 K 32-bit registers per
# block and 255 per thread. On a GPU, Triton checks the driver's own figure (max_shared_mem) when it loads a
# kernel; tests/kernel_builds_test.py compares the two on an H100 or H200. Consumer Blackwell (12.x) has 99 KB
# per block: not a target here (tests/blackwell_test.py holds the largest quantizer against it).
SHARED_PER_BLOCK = 227 * 1024  # bytes, static + dynamic
REGISTERS_PER_BLOCK = 65536
REGISTERS_PER_THREAD = 255
REGISTER_UNIT = 8  # registers are allocated per thread in multiples of 8 (per warp, in units of 256)
TARGETS = {"sm_90": 90, "sm_100": 100, "sm_103": 103}
LIMITS = {name: (SHARED_PER_BLOCK, REGISTERS_PER_BLOCK, REGISTERS_PER_THREAD) for name in TARGETS}


# ------------------------------------------------------------------------------------------------ the shapes
@dataclasses.dataclass(frozen=True)
class Shapes:
    """One model's sizes, and the tokens of one step."""

    name: str
    tokens: int         # batch x sequence
    batch: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


SHAPES = {
    # LLaMA 3.1 8B at the step the scripts run: 4 x 2048 tokens
    "8b": Shapes("8b", 4 * 2048, 4, 4096, 14336, 32, 8, 128, 128256),
    # The walkthrough's real model (SmolLM2-135M) at the lesson tests' short sequences
    "smollm2": Shapes("smollm2", 2 * 256, 2, 576, 1536, 9, 3, 64, 49152),
    # The lesson tests' odd shapes: rows and widths that are no power of two exercise the masks
    "odd": Shapes("odd", 37, 1, 784, 1120, 6, 2, 48, 1823),
}


def step_calls(s: Shapes) -> list:
    """(what, call) for every kernel launch of a training step at shapes `s`, each call made as the
    model's modules make it, on meta tensors (module docstring). Adding a kernel: one line here calling
    its launcher as the step calls it, with tensors from `t(...)`; the discovery check names any kernel no
    line launches. A kernel for Blackwell alone is (what, call, ("sm_100", "sm_103")): built for those only."""
    import torch

    import adamw_kernel
    import cross_entropy_kernel as ce
    import distillation_kernel as dist
    import fp8_linear_kernel as fp8
    import fp8_lora_kernel
    import fp8_producers_kernel as producers
    import fp8_recipes_kernel as recipes
    import linear_cross_entropy_kernel as lce
    import mx_quant_kernel as mxq
    import rmsnorm_kernel
    import rope_kernel
    import swiglu_kernel

    bf16, meta = torch.bfloat16, torch.device("meta")

    def t(*shape, dtype=bf16):
        return torch.empty(shape, dtype=dtype, device=meta)

    n, h, i, v = s.tokens, s.hidden, s.intermediate, s.vocab
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    targets = t(n, dtype=torch.int64)
    f32 = torch.float32
    fp8_widths = sorted({h, i, 2 * i, q_width + 2 * kv_width})  # the projections' inputs and outputs
    calls = [
        ("rmsnorm forward", lambda: rmsnorm_kernel.rmsnorm_forward(t(n, h), t(h), 1e-5)),
        ("rmsnorm backward", lambda: rmsnorm_kernel.rmsnorm_backward(t(n, h), t(n, h), t(h), t(n, dtype=f32), True)),
        ("swiglu forward", lambda: swiglu_kernel.swiglu_forward(t(n, i), t(n, i))),
        ("swiglu backward, packed", lambda: swiglu_kernel.swiglu_backward(t(n, i), t(n, i), t(n, i), packed=True)),
        ("rope forward", lambda: rope_kernel.rope_launch(
            t(s.batch, s.heads, n // s.batch, s.head_dim), t(s.batch, s.kv_heads, n // s.batch, s.head_dim),
            t(1, n // s.batch, s.head_dim), t(1, n // s.batch, s.head_dim), False)),
        ("rope backward", lambda: rope_kernel.rope_launch(
            t(s.batch, s.heads, n // s.batch, s.head_dim), t(s.batch, s.kv_heads, n // s.batch, s.head_dim),
            t(1, n // s.batch, s.head_dim), t(1, n // s.batch, s.head_dim), True)),
        ("cross-entropy, gradient in place", lambda: ce.cross_entropy_forward(
            t(n, v), targets, -100, "mean", True, True)),
        ("cross-entropy gradient scaled", lambda: ce.scale_gradient_(t(n, v), t(dtype=f32))),
        ("linear cross-entropy, forward and backward", lambda: lce.linear_cross_entropy_pass(
            t(n, h), t(v, h), targets, -100, "mean", True, True)),
        ("KL divergence forward", lambda: dist.kl_div_forward(t(n, v), t(n, v), False, False)),
        ("KL divergence backward", lambda: dist.kl_div_backward(
            t(dtype=f32), t(n, v), t(n, v), False, False, True, False)),
        ("JSD forward", lambda: dist.jsd_forward(t(n, v), t(n, v), targets, 0.5, -100, True)),
        ("linear JSD", lambda: dist.linear_jsd_pass(t(n, h), t(v, h), t(n, h), t(v, h), targets, 0.5, 2.0, -100,
                                                    True, True)),
        ("FP8 RMSNorm producer", lambda: producers.rmsnorm_quantize_rows(t(n, h), t(h), 1e-5)),
        ("MXFP8 RMSNorm producer", lambda: producers.rmsnorm_quantize_mxfp8(t(n, h), t(h), 1e-5)),
        ("MXFP8 SwiGLU producer, both copies", lambda: producers.swiglu_quantize_mxfp8(t(n, i), t(n, i))),
        ("MXFP8 SwiGLU producer, along I (no dW)", lambda: producers.swiglu_quantize_mxfp8(t(n, i), t(n, i),
                                                                                            cols=False)),
        ("FP8 SwiGLU producer", lambda: producers.swiglu_quantize_rows(t(n, i), t(n, i))),
        ("FP8 SwiGLU backward maxima", lambda: producers.swiglu_joined_backward_maxima(t(n, i), t(n, i), t(n, i))),
        ("FP8 frozen weight transposed", lambda: fp8_lora_kernel.transpose_bytes(t(i, h, dtype=fp8.FP8_DTYPE))),
    ]
    for k in fp8_widths:
        calls += [
            (f"FP8 rows of {k}", lambda k=k: fp8.quantize_rows(t(n, k), col_max=True)),
            (f"FP8 maxima of {k} (a tensor-wise scale)", lambda k=k: fp8.quantize_rows(t(n, k), False, True)),
            (f"FP8 rows of {k}, scaled by column", lambda k=k: fp8.quantize_rows(t(n, k), col_scale=t(k, dtype=f32))),
            (f"FP8 columns of {k}, transposed", lambda k=k: fp8.quantize_cols(t(n, k), t(k, dtype=f32))),
            (f"FP8 both copies of {k}", lambda k=k: fp8.quantize_both(t(n, k), t(n, dtype=f32), t(k, dtype=f32))),
        ]
        for mode in recipes.TILE_MODES:
            if mode == "tile" and (n % recipes.TILE or k % recipes.TILE):
                continue  # 128 x 128 weight tiles need whole tiles (the layer refuses the recipe otherwise)
            calls.append((f"FP8 {mode}-scaled copies of {k}", lambda k=k, mode=mode: recipes.quantize_tiles(
                t(n, k), mode, rows=True, cols=True, amax=t(1, dtype=f32))))

    # Blackwell's block-scaled recipes (fp8_recipes_kernel.quant_operand: mxfp8, nvfp4 and their -emulated forms,
    # which quantize with the same kernels on Hopper: hence built for every target) and LoRA's frozen base kept in
    # them (fp8_lora_kernel.store_block_scaled_weight, BlockScaledFrozenLinear). Activations x and gradients dy
    # [tokens, width]: a copy along K, and the transposed copy along the tokens for dW; the weight [out, in].
    # Which copies: the forward quantizes x with its transposed copy when it keeps it for dW (mxfp8), else alone;
    # the backward quantizes dy both ways (only transposed in a layer that needs no dx, only along K in the frozen
    # base, which needs no dW) and x transposed when it was not kept.
    copies = [(True, False), (True, True), (False, True)]
    weights = sorted({(q_width + 2 * kv_width, h), (h, q_width), (2 * i, h), (h, i)})  # the projections' [out, in]
    signs = recipes.NVFP4_HADAMARD_SIGNS
    # dy's Philox seed is a plain int argument, which Triton specializes like any int: the first gradient's seed, 1,
    # is compiled as a constant and a multiple of 16 as aligned, each its own build (quant_operand's seeds run
    # 1, 2, 3, ...), so a step's gradients make all three
    sr_seeds = (1, 2, 16)
    for k in fp8_widths:
        for rows, cols in copies:
            calls.append((f"MXFP8 of {k}, rows={rows} cols={cols}", lambda k=k, r=rows, c=cols: mxq.quantize_mxfp8(
                t(n, k), r, c)))
            # x: to nearest; the Hadamard flag and signs are passed for activations even without the transposed copy
            # (they are constexprs of the launch all the same); both copies at once: the set-up probe's check
            # (fp8_recipes_kernel.TRANSPOSING)
            calls.append((f"NVFP4 activation of {k}, rows={rows} cols={cols}", lambda k=k, r=rows, c=cols:
                          mxq.quantize_nvfp4(t(n, k), r, c, hadamard=signs)))
            calls.append((f"NVFP4 activation of {k}, Four Over Six (nvfp4-46), rows={rows} cols={cols}",
                          lambda k=k, r=rows, c=cols: mxq.quantize_nvfp4(t(n, k), r, c, hadamard=signs,
                                                                         adaptive=True)))
            for seed in sr_seeds:
                calls.append((f"NVFP4 gradient of {k}, rows={rows} cols={cols}, seed {seed}",
                              lambda k=k, r=rows, c=cols, seed=seed: mxq.quantize_nvfp4(
                                  t(n, k), r, c, stochastic=True, seed=seed, hadamard=signs)))
        # The scales in the layout cuBLAS reads, written by the kernel (mx_quant_test; the recipes' matmul swizzles
        # the natural ones in PyTorch, fp8_recipes_kernel.mx_swizzled_scales)
        calls.append((f"MXFP8 of {k}, swizzled scales", lambda k=k: mxq.quantize_mxfp8(t(n, k), True, True,
                                                                                        swizzle=True)))
    for out_f, in_f in weights:
        # the trained layer quantizes W along K for y and transposed for dx, each step; the frozen base both at once
        for rows, cols in copies:
            calls.append((f"MXFP8 weight {out_f} x {in_f}, rows={rows} cols={cols}",
                          lambda o=out_f, i_=in_f, r=rows, c=cols: mxq.quantize_mxfp8(t(o, i_), r, c)))
            if out_f % mxq.NV_BLOCK == 0 and in_f % mxq.NV_BLOCK == 0:  # 16x16 tiles need whole tiles (else refused)
                calls.append((f"NVFP4 weight {out_f} x {in_f} in 16x16 tiles, rows={rows} cols={cols}",
                              lambda o=out_f, i_=in_f, r=rows, c=cols: mxq.quantize_nvfp4(t(o, i_), r, c, tiles=True)))
            calls.append((f"NVFP4 weight {out_f} x {in_f}, Four Over Six (nvfp4-46), rows={rows} cols={cols}",
                          lambda o=out_f, i_=in_f, r=rows, c=cols: mxq.quantize_nvfp4(t(o, i_), r, c, adaptive=True)))

    def adamw(rounding: str):
        params = [torch.empty((h, h), dtype=bf16, device=meta), torch.empty(h, dtype=bf16, device=meta)]
        states = [[torch.empty_like(p, dtype=f32) for p in params] for _ in range(2)]
        buffer_dtype = f32 if rounding == "fp32-master" else bf16  # a master copy, or Kahan's compensation
        buffers = ([torch.empty_like(p, dtype=buffer_dtype) for p in params] if rounding in adamw_kernel._BUFFERS
                   else None)
        table = adamw_kernel.TensorTable(params, *states, buffers=buffers)
        table.set_grads([torch.empty_like(p) for p in params])
        adamw_kernel.adamw_multi_tensor_(table, lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                         step=1.0, rounding=rounding)

    calls += [(f"AdamW, {r} rounding", lambda r=r: adamw(r)) for r in adamw_kernel.ROUNDINGS]
    return calls


# ------------------------------------------------------------------------------------------------ recording
@dataclasses.dataclass
class Launch:
    """One distinct launch: the kernel and what its compilation depends on."""

    kernel: object          # the JITFunction
    signature: dict         # parameter -> Triton type ("*bf16", "i32", "constexpr", ...)
    constexprs: dict        # (index,) -> value
    attrs: dict             # (index,) -> [["tt.divisibility", 16]], ...
    options: dict           # num_warps, num_stages, ... as the launcher passed them
    where: list             # "8b: rmsnorm forward", ... every call that made this launch
    only: tuple | None = None  # the targets its calls name (a Blackwell-only kernel); () for all; None: no call yet

    @property
    def name(self) -> str:
        fn = self.kernel.fn
        return f"{fn.__module__}.{fn.__name__}"

    @property
    def config(self) -> str:
        """'BLOCK_M=1 BLOCK_H=4096 ... num_warps=8': the constexprs and the launch options, for messages."""
        names = list(self.signature)
        consts = [f"{names[path[0]]}={_short(v)}" for path, v in sorted(self.constexprs.items())]
        return " ".join(consts + [f"{k}={v}" for k, v in sorted(self.options.items())])

    def key(self) -> tuple:
        attrs = tuple(sorted((p, str(a)) for p, a in self.attrs.items()))
        consts = tuple(sorted((p, _short(v)) for p, v in self.constexprs.items()))
        return (self.name, tuple(self.signature.items()), consts, attrs, tuple(sorted(self.options.items())))


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _merge_targets(a: tuple | None, b: tuple | None) -> tuple | None:
    """The targets of a launch two calls make: every target if either call names none, else both sets."""
    if a is None or b is None:
        return b if a is None else a
    return () if not a or not b else tuple(sorted(set(a) | set(b)))


def record(calls: list, label: str) -> dict:
    """Run each (what, call) or (what, call, targets) with every kernel launch recorded instead of run;
    returns {key: Launch}. `targets` (names of TARGETS) limits the builds of a call's launches to those: a
    kernel made for Blackwell alone (tcgen05, block-scaled dot) says so there, and is built for no other."""
    import triton  # noqa: F401
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import autotuner, jit

    if jit.knobs.runtime.interpret:
        raise RuntimeError("kernel_builds records GPU launches: run it with TRITON_INTERPRET=0 (the interpreter's "
                           "launch settings are not the GPU's)")
    backend = make_backend(GPUTarget("cuda", 90, 32))  # the binder's specialization is the same for every target
    seen, current = {}, [None, ()]
    real_run = jit.JITFunction.run

    def recorder(self, *args, grid, warmup, **kwargs):
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, raw_options = binder(*args, **kwargs)
        _, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, raw_options)
        options = {k: v for k, v in kwargs.items() if k not in signature}
        launch = Launch(self, signature, constexprs, attrs, options, [])
        launch = seen.setdefault(launch.key(), launch)
        launch.where.append(f"{label}: {current[0]}")
        launch.only = _merge_targets(launch.only, current[1])
        return None

    def every_config(self, *args, **kwargs):
        """An autotuned kernel: each config it would time (after its early pruning, which reads only the
        arguments) is a launch of its own; the pre-hooks, which reset real outputs, are not run."""
        configs = self.configs
        if self.early_config_prune:
            configs = self.early_config_prune(configs, dict(zip(self.arg_names, args)), **kwargs)
        for config in configs:
            self.fn.run(*args, **{**kwargs, **config.all_kwargs()})

    real_tune = autotuner.Autotuner.run
    jit.JITFunction.run, autotuner.Autotuner.run = recorder, every_config
    try:
        for what, call, *only in calls:
            current[:] = what, tuple(only[0]) if only else ()
            call()
    finally:
        jit.JITFunction.run, autotuner.Autotuner.run = real_run, real_tune
    return seen


# ------------------------------------------------------------------------------------------------ discovery
def kernel_files(root: Path = ROOT) -> list:
    """Module names of the playbook's files that define Triton kernels: `*_kernel.py` at the top, and any
    module of core/ or playbook/ with a `@triton.jit` (tests and examples are not the playbook's)."""
    names = sorted(p.stem for p in root.glob("*_kernel.py"))
    for folder in ("core", "playbook"):
        for p in sorted((root / folder).rglob("*.py")):
            if "@triton.jit" in p.read_text(encoding="utf-8"):
                names.append(".".join(p.relative_to(root).with_suffix("").parts))
    return names


def discover_kernels(modules: list) -> dict:
    """{'module.function': JITFunction} of every kernel of these modules: a jitted function that no other
    jitted function calls (those are device functions, compiled inside the kernels that call them)."""
    import ast
    import importlib
    import textwrap
    import types

    from triton.runtime.jit import JITFunction, KernelInterface

    def unwrapped(value):
        """The JITFunction under @triton.autotune and @triton.heuristics (each a KernelInterface with .fn)."""
        while isinstance(value, KernelInterface) and not isinstance(value, JITFunction):
            value = getattr(value, "fn", None)
        return value

    jitted = {}
    for name in modules:
        for value in map(unwrapped, vars(importlib.import_module(name)).values()):
            if isinstance(value, JITFunction) and value.fn.__module__ == name:
                jitted[f"{name}.{value.fn.__name__}"] = value
    called = set()
    for fn in jitted.values():
        tree = ast.parse(textwrap.dedent(fn.src if hasattr(fn, "src") else fn._src))
        scope = fn.fn.__globals__
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Name):
                target = scope.get(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = scope.get(node.value.id)
                target = getattr(owner, node.attr, None) if isinstance(owner, types.ModuleType) else None
            target = unwrapped(target)
            if isinstance(target, JITFunction) and target is not fn:
                called.add(f"{target.fn.__module__}.{target.fn.__name__}")
    return {name: fn for name, fn in jitted.items() if name not in called}


# ------------------------------------------------------------------------------------------------ builds
@dataclasses.dataclass
class Build:
    target: str
    shared: int = 0         # bytes per block of Triton's (dynamic) shared memory, held against the 227 KB
    static_shared: int = 0  # bytes of the cubin's static shared memory (CUDA's reserved 1 KB: see `build`)
    registers: int = 0      # per thread
    spill_bytes: int = 0    # local memory per thread (ptxas spills)
    threads: int = 0
    seconds: float = 0.0
    error: str = ""


_CUOBJDUMP = None


def _resources(cubin: bytes) -> tuple:
    """(registers per thread, static shared bytes, local bytes per thread) of a cubin's one kernel, from the
    Triton wheel's cuobjdump."""
    import tempfile

    from triton.backends.nvidia import compiler

    global _CUOBJDUMP
    if _CUOBJDUMP is None:
        _CUOBJDUMP = str(Path(compiler.__file__).parent / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    field = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
    return field["REG"], field.get("SHARED", 0), field.get("LOCAL", 0)


def build(launch: Launch, target: str) -> Build:
    """Compile one launch for one target (no GPU needed) and read what it takes per block."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    gpu = GPUTarget("cuda", TARGETS[target], 32)
    result = Build(target)
    start = time.perf_counter()
    try:
        options = make_backend(gpu).parse_options(dict(launch.options))
        compiled = triton.compile(ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs),
                                  target=gpu, options=options.__dict__)
        registers, static_shared, local = _resources(compiled.asm["cubin"])
        # Triton keeps all its shared memory dynamic, and checks that figure against the device's limit when it
        # loads a kernel; the cubin's static 1 KB (from sm_90 on, in a kernel that uses shared memory) is the
        # block's system reservation, which the 227 KB already leaves out (228 KB per SM)
        result.shared, result.static_shared = compiled.metadata.shared, static_shared
        result.registers, result.spill_bytes = registers, local
        result.threads = compiled.metadata.num_warps * 32 * compiled.metadata.num_ctas
    except Exception as err:  # noqa: BLE001  (any failure of the compiler is the finding)
        # Triton's compile errors quote the source first and say what is wrong last
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.strip().startswith("^")]
        result.error = f"{type(err).__name__}: {(lines[-1] if lines else '')[:300]}"
    result.seconds = time.perf_counter() - start
    return result


def problems(launch: Launch, b: Build) -> list:
    """One line per limit the build exceeds (or its compile error), naming the kernel, config and target."""
    head = f"{launch.name} [{launch.config}] for {b.target}"
    if b.error:
        return [f"{head}: does not compile: {b.error}"]
    shared_max, regs_block, regs_thread = LIMITS[b.target]
    out = []
    if b.shared > shared_max:
        out.append(f"{head}: {b.shared / 1024:.1f} KB of shared memory per block, over the target's "
                   f"{shared_max // 1024} KB")
    if b.registers > regs_thread:
        out.append(f"{head}: {b.registers} registers per thread, over {regs_thread}")
    if b.spill_bytes:
        out.append(f"{head}: spills {b.spill_bytes} bytes per thread to local memory ({b.registers} registers)")
    allocated = -(-b.registers // REGISTER_UNIT) * REGISTER_UNIT * b.threads
    if allocated > regs_block:
        out.append(f"{head}: {b.registers} registers x {b.threads} threads = {allocated} per block, over "
                   f"{regs_block}")
    return out


def _build_all(job):
    """Worker: (launch index, target) -> Build. The launches are the parent's, inherited at fork."""
    index, target = job
    return index, build(_LAUNCHES[index], target)


_LAUNCHES: list = []


def collect(shape_names) -> list:
    """The distinct launches of `step_calls` at each of these shapes, in a stable order."""
    seen = {}
    for name in shape_names:
        for key, launch in record(step_calls(SHAPES[name]), name).items():
            if key in seen:
                seen[key].where += launch.where
                seen[key].only = _merge_targets(seen[key].only, launch.only)
            else:
                seen[key] = launch
    return list(seen.values())


def targets_of(launch: Launch, targets, lesson_targets=None) -> list:
    """The targets a launch is built for: all of `targets` when the 8B step makes it, else `lesson_targets`
    (by default the same); of those, only the ones its calls name, where they name some."""
    if launch.only:
        targets = [t for t in targets if t in launch.only]
    if lesson_targets is None or any(where.startswith("8b:") for where in launch.where):
        return list(targets)
    return [t for t in targets if t in lesson_targets]


def run(shape_names, targets, jobs: int = 1, lesson_targets=None) -> tuple:
    """(launches, {(launch index, target): Build}, every kernel found, the kernels no call launched): every
    launch built for every target."""
    global _LAUNCHES
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU default of today's Triton, said outright
    sys.path.insert(0, str(ROOT))
    launches = collect(shape_names)
    kernels = discover_kernels(kernel_files())
    launched = {launch.name for launch in launches}
    missing = sorted(set(kernels) - launched)
    _LAUNCHES = launches
    jobs_list = [(i, target) for i, launch in enumerate(launches)
                 for target in targets_of(launch, targets, lesson_targets)]
    if jobs > 1:
        import multiprocessing

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            builds = dict(((i, b.target), b) for i, b in pool.map(_build_all, jobs_list, chunksize=4))
    else:
        builds = {(i, target): build(launches[i], target) for i, target in jobs_list}
    return launches, builds, kernels, missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated: {', '.join(TARGETS)}")
    parser.add_argument("--lesson-targets", default=None,
                        help="targets of the launches only the lesson shapes make (default: --targets)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    args = parser.parse_args(argv)
    shapes, targets = args.shapes.split(","), args.targets.split(",")
    lesson_targets = args.lesson_targets.split(",") if args.lesson_targets else None
    bad = [s for s in shapes if s not in SHAPES] + [t for t in targets + (lesson_targets or []) if t not in TARGETS]
    if bad or args.jobs < 1:
        print(f"error: unknown {', '.join(bad) or 'count'}: --shapes takes {', '.join(SHAPES)}, --targets "
              f"{', '.join(TARGETS)}, --jobs 1 or more", file=sys.stderr)
        return 2
    interpret = os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off", "no", "n")
    if interpret:
        print("error: kernel_builds records GPU launches and compiles them: run it with TRITON_INTERPRET=0 (the "
              "interpreter's launch settings are not the GPU's)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    launches, builds, kernels, missing = run(shapes, targets, args.jobs, lesson_targets)
    print(f"{'kernel':<48} {'target':<7} {'shared KB':>9} {'static':>6} {'regs':>5} {'spill B':>7} {'s':>5}  config")
    found = []
    for i, launch in enumerate(launches):
        for target in targets_of(launch, targets, lesson_targets):
            b = builds[(i, target)]
            print(f"{launch.name:<48} {target:<7} {b.shared / 1024:>9.1f} {b.static_shared:>6} {b.registers:>5} "
                  f"{b.spill_bytes:>7} {b.seconds:>5.1f}  {launch.config}")
            found += problems(launch, b)
    found += [f"{name}: a kernel no call of testkit/kernel_builds.py's step_calls launches; add its launcher "
              "there" for name in missing]
    seconds = time.perf_counter() - start
    print(f"{len(kernels)} kernels in {len(kernel_files())} files; {len(launches)} distinct launches, "
          f"{len(builds)} builds in {seconds:.0f} s; {len(found)} problem(s)")
    for line in found:
        print(f"PROBLEM {line}")
    return 1 if found else 0

