"""The table of kernels benchmark_kernels.py measures: one `KernelSpec` per entry of `SPECS`.

Each entry holds a kernel's cases (LLaMA 3.1 8B's shapes by default), how to build random inputs for one,
its implementations ("ours" first, "eager" the baseline, then torch.compile and Liger-Kernel where they
exist), its correctness check against float64, and its kernel module, whose `ideal_bytes(...)` (and
`flops(...)` for the compute-bound entries) give the floor each row is held against.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

import adamw_kernel
import cross_entropy_kernel
import distillation_kernel
import linear_cross_entropy_kernel
import projections_kernel
import rmsnorm_kernel
import rope_kernel
import swiglu_kernel
from cross_entropy_kernel import cross_entropy
from linear_cross_entropy_kernel import linear_cross_entropy
from benchmarks.timing import ON_GPU, compiled, generator, liger
from core.kernel_utils import DEVICE
from testkit import close_to_reference
from rmsnorm_kernel import rmsnorm, rmsnorm_ref
from rope_kernel import rope, rope_ref
from swiglu_kernel import swiglu, swiglu_ref


# LLaMA 3.1 8B: the shapes of the default sweeps
HIDDEN, INTERMEDIATE, VOCAB = 4096, 14336, 128256
HEADS, KV_HEADS, HEAD_DIM, SEQ = 32, 8, 128, 2048


# ------------------------------------------------------------------------------------------------
# The table of kernels: what `main` needs to know about each
# ------------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """Random inputs of one case, and the calls that use them."""

    grads: list                 # the leaf inputs whose .grad a backward sets (reset around every measurement)
    forward: Callable           # forward(fn): one forward call, no autograd graph kept
    forward_backward: Callable  # forward_backward(fn): forward, then backward through autograd
    check: Callable             # check(name, fn): against float64 (testkit's rule) on a slice of the inputs


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of the benchmark.

    A case is a dict of the keyword arguments that size the kernel module's `ideal_bytes` (and
    `flops`), e.g. {"n_rows": 16384, "hidden": 4096}: the rows carry it, so every byte count can be
    recomputed from the module.
    """

    name: str
    module: ModuleType            # <name>_kernel: ideal_bytes(**case, dtype, backward), flops(**case, backward)
    cases: Callable               # cases(tokens): the default sweep, or `tokens` (--sizes) at the LLaMA width
    smoke: tuple                  # tiny cases for --smoke (CPU, Triton's interpreter)
    impls: Callable               # impls() -> {name: fn}, "ours" first, "eager" the baseline
    inputs: Callable              # inputs(case, dtype) -> Inputs
    tokens: str                   # the key of the case's token count ("n_rows" or "n_tokens")
    width: Callable               # width(case): the size plotted against tokens (hidden, vocabulary, ...)
    compute_bound: bool = False   # floor = flops at the matmul rate, not ideal bytes at the copy bandwidth

    def ideal_bytes(self, case: dict, dtype: torch.dtype, backward: bool) -> int:
        return self.module.ideal_bytes(**case, dtype=dtype, backward=backward)

    def flops(self, case: dict, backward: bool) -> int | None:
        return self.module.flops(**case, backward=backward) if self.compute_bound else None


def _three_ways(fn, ref, leaves, upstream, call, truth=torch.float64):
    """A check's three runs, in this order: `fn` and `ref` in the inputs' dtype, then `ref` in `truth` (float64;
    fp32 where a float64 copy would not fit). Each run gets its own copies of the leaves and of the upstream
    gradients, so an implementation that writes into what it is given (Liger-Kernel's RoPE backward writes its
    result into its upstream gradient) cannot change the runs after it. `call(f, cast, *leaves)` returns the
    outputs, one tensor or several (`cast` for the other tensors the call takes); `upstream` holds their
    gradients (empty: one scalar loss). Returns, per run, (outputs..., the leaves' gradients...), detached."""
    runs = []
    for f, cast in ((fn, lambda t: t), (ref, lambda t: t), (ref, lambda t: t.to(truth))):
        xs = [cast(t).clone().requires_grad_() for t in leaves]
        outs = call(f, cast, *xs)
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        torch.autograd.backward(list(outs), [cast(g).clone() for g in upstream] if upstream else None)
        runs.append(tuple(t.detach() for t in (*outs, *(x.grad for x in xs))))
    return runs


# ---- RMSNorm -------------------------------------------------------------------------------------
def _rmsnorm_cases(tokens):
    cases = [dict(n_rows=n, hidden=HIDDEN) for n in tokens or (1024, 2048, 4096, 8192, 16384, 32768)]
    if not tokens:  # the hidden sizes of other models, at 16k tokens
        cases += [dict(n_rows=16384, hidden=h) for h in (1024, 2048, 8192, 16384)]
    return cases


def _rmsnorm_impls():
    impls = {"ours": rmsnorm, "eager": rmsnorm_ref, "torch.compile": compiled(rmsnorm_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # Liger's own autograd function, LLaMA casting; in_place=False keeps dy intact between runs
        impls["liger"] = lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    return impls


def _rmsnorm_inputs(case, dtype):
    N, H = case["n_rows"], case["hidden"]
    g = generator(N, H)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype).requires_grad_()
    dy = torch.randn(N, H, generator=g).to(DEVICE, dtype)
    return Inputs(
        grads=[x, w],
        forward=lambda fn: fn(x.detach(), w.detach(), 1e-5),
        forward_backward=lambda fn: fn(x, w, 1e-5).backward(dy),
        check=lambda name, fn: _check_rmsnorm(name, fn, x[:256].detach(), w.detach(), dy[:256]),
    )


def _check_rmsnorm(name, fn, x, w, dy):
    runs = _three_ways(fn, rmsnorm_ref, [x, w], [dy], lambda f, cast, xi, wi: f(xi, wi, 1e-5))
    for i, what in enumerate(("y", "dx", "dW")):
        n = x.shape[0] if what == "dW" else x.shape[1]
        scale = None
        if what == "dx":
            rstd = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-5).max().item()
            scale = rstd * dy.double().abs().max().item() * w.double().abs().max().item()
        close_to_reference(f"rmsnorm {name} {what}", *(run[i] for run in runs), x.dtype, n=n, scale=scale)


# ---- Cross-entropy -------------------------------------------------------------------------------
def _hf_loss(logits, targets):
    return F.cross_entropy(logits.float(), targets)  # Hugging Face upcasts to fp32 first


def _ce_cases(tokens):
    cases = [dict(n_rows=n, vocab=VOCAB) for n in tokens or (512, 1024, 2048, 4096, 8192, 16384)]
    if not tokens:  # the vocabularies of other models (LLaMA 2, Qwen 2, Gemma), at 4k tokens
        cases += [dict(n_rows=4096, vocab=v) for v in (32000, 151936, 256000)]
    return cases


def _ce_impls():
    impls = {
        "ours": lambda lg, t: cross_entropy(lg, t, inplace_grad=True),
        "eager": _hf_loss,
        "eager-bf16": lambda lg, t: F.cross_entropy(lg, t),
        "torch.compile": compiled(_hf_loss),
    }
    lt = liger()
    if lt is not None and ON_GPU:
        mod = lt.LigerCrossEntropyLoss()
        impls["liger"] = lambda lg, t: mod(lg, t)
    return impls


def _ce_inputs(case, dtype):
    N, V = case["n_rows"], case["vocab"]
    g = generator(N, V)
    logits = (torch.randn(N, V, generator=g) * 2).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    targets[::17] = -100  # a few ignored tokens, as padding produces

    def loss_only(fn):
        with torch.no_grad():
            fn(logits, targets)

    # A model's logits are an intermediate (the lm_head's output), and our kernel refuses to write
    # its gradient into a leaf; a view of the leaf is such an intermediate, at no cost, for every
    # implementation alike. In-place implementations then overwrite `logits` with the gradient, so
    # later repetitions read the previous gradient as logits: finite, non-zero values; the work per
    # element is the same (an exp each), so the time is too.
    return Inputs(
        grads=[logits],
        forward=loss_only,
        forward_backward=lambda fn: fn(logits.view_as(logits), targets).backward(),
        check=lambda name, fn: _check_ce(name, fn, logits[:256].detach(), targets[:256]),
    )


def _check_ce(name, fn, logits, targets):
    x = logits.clone().requires_grad_()
    fn(x * 1, targets).backward()  # x * 1: in-place implementations get a buffer of their own
    xs = logits.clone().requires_grad_()
    same = F.cross_entropy(xs, targets)
    same.backward()
    xr = logits.double().requires_grad_()
    ref = F.cross_entropy(xr, targets)
    ref.backward()
    ours = fn(logits.clone(), targets)
    # A peer that returns its loss in the logits' dtype (eager-bf16) is held to that dtype's precision;
    # the others return fp32 losses and are held to fp32's.
    close_to_reference(f"cross_entropy {name} loss", ours.float(), same.float(), ref, ours.dtype, n=logits.shape[1])
    close_to_reference(f"cross_entropy {name} grad", x.grad, xs.grad, xr.grad, logits.dtype, n=logits.shape[1])


# ---- Fused linear cross-entropy (compute bound) --------------------------------------------------
def _hf_head_loss(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t)  # full logits, upcast, PyTorch's loss


def _flce_cases(tokens):
    return [dict(n_tokens=n, hidden=HIDDEN, vocab=VOCAB) for n in tokens or (4096, 8192, 16384)]


def torch_linear_cross_entropy():
    """PyTorch's own fused op on its chunked path, or (None, why) where this torch lacks it."""
    fn, options = getattr(F, "linear_cross_entropy", None), getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if fn is None or options is None:
        return None, f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (chunked)"
    opts = options()  # chunking method and accumulation policy picked by PyTorch for the device and dtype
    # Same semantics as ours: mean over the tokens whose target is not -100 (its default, spelled out)
    return (lambda x, w, t: fn(x, w, t, ignore_index=-100, reduction="mean", options=opts)), None


def _flce_impls():
    impls = {
        "ours": lambda x, w, t: linear_cross_entropy(x, w, t),
        "ours-bf16acc": lambda x, w, t: linear_cross_entropy(x, w, t, accumulate_fp32=False),
        "eager": _hf_head_loss,
        "torch.compile": compiled(_hf_head_loss),
    }
    fn, why = torch_linear_cross_entropy()
    if fn is not None:
        impls["torch-chunked"] = fn
    else:
        print(f"  torch-chunked skipped: {why}")
    if liger() is not None and ON_GPU:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mod = LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda x, w, t: mod(w, x, t)  # Liger takes (weight, input, target)
    return impls


def _flce_inputs(case, dtype):
    N, H, V = case["n_tokens"], case["hidden"], case["vocab"]
    g = generator(N, V)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(DEVICE, dtype).requires_grad_()  # logits ~ N(0, 2)
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    t[::17] = -100
    n_check = min(N, 2304)  # > 2048 tokens: our default chunking takes two chunks

    def loss_only(fn):
        with torch.no_grad():
            fn(x, w, t)

    return Inputs(
        grads=[x, w],
        forward=loss_only,
        forward_backward=lambda fn: fn(x, w, t).backward(),
        check=lambda name, fn: _check_flce(name, fn, x[:n_check].detach(), w.detach(), t[:n_check]),
    )


def _check_flce(name, fn, x, w, t):
    # fp32 serves as the truth here: a float64 copy of a 128256 x 4096 head would take 4 GB
    outs = _three_ways(fn, _hf_head_loss, [x, w], [], lambda f, cast, xi, wi: f(xi, wi, t), truth=torch.float32)
    V = w.shape[0]
    # As in _check_ce: a loss returned in the inputs' dtype (torch-chunked's) is held to that dtype's
    # precision; fp32 losses (ours, eager, Liger) to fp32's.
    close_to_reference(f"flce {name} loss", outs[0][0].float(), outs[1][0].float(), outs[2][0].float(),
                       outs[0][0].dtype, n=V)
    close_to_reference(f"flce {name} dx", outs[0][1], outs[1][1], outs[2][1], x.dtype, n=V)
    close_to_reference(f"flce {name} dW", outs[0][2], outs[1][2], outs[2][2], x.dtype, n=x.shape[0])


# ---- SwiGLU --------------------------------------------------------------------------------------
def _swiglu_cases(tokens):
    return [dict(n_rows=n, width=INTERMEDIATE) for n in tokens or (1024, 4096, 8192, 16384)]


def _swiglu_impls():
    impls = {"ours": swiglu, "eager": swiglu_ref, "torch.compile": compiled(swiglu_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        impls["liger"] = LigerSiLUMulFunction.apply
    return impls


def _swiglu_inputs(case, dtype):
    N, I = case["n_rows"], case["width"]
    g = generator(N, I)
    gate = (torch.randn(N, I, generator=g) * 3).to(DEVICE, dtype).requires_grad_()
    up = torch.randn(N, I, generator=g).to(DEVICE, dtype).requires_grad_()
    dh = torch.randn(N, I, generator=g).to(DEVICE, dtype)
    return Inputs(
        grads=[gate, up],
        forward=lambda fn: fn(gate.detach(), up.detach()),
        forward_backward=lambda fn: fn(gate, up).backward(dh),
        check=lambda name, fn: _check_swiglu(name, fn, gate[:64].detach(), up[:64].detach(), dh[:64]),
    )


def _check_swiglu(name, fn, gate, up, dh):
    outs = _three_ways(fn, swiglu_ref, [gate, up], [dh], lambda f, cast, gi, ui: f(gi, ui))
    for i, what in enumerate(("h", "dgate", "dup")):
        close_to_reference(f"swiglu {name} {what}", outs[0][i], outs[1][i], outs[2][i], gate.dtype)


# ---- Joined projections --------------------------------------------------------------------------
def _proj_cases(tokens):
    groups = (f"{HEADS * HEAD_DIM}+{KV_HEADS * HEAD_DIM}+{KV_HEADS * HEAD_DIM}", f"{INTERMEDIATE}+{INTERMEDIATE}")
    return [dict(n_tokens=n, hidden=HIDDEN, outputs=o) for o in groups for n in tokens or (8192,)]


def _proj_impls():
    return {"ours": projections_kernel.joined_matmul, "eager": projections_kernel.separate_matmuls,
            "torch.compile": compiled(projections_kernel.separate_matmuls)}


def _proj_inputs(case, dtype):
    N, H, sizes = case["n_tokens"], case["hidden"], projections_kernel._sizes(case["outputs"])
    g = generator(N, H, *sizes)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
    joint = (torch.randn(sum(sizes), H, generator=g) * H**-0.5).to(DEVICE, dtype)
    weights = [w.requires_grad_() for w in joint.split(sizes)]  # side by side: rows of one buffer
    dys = [torch.randn(N, n, generator=g).to(DEVICE, dtype) for n in sizes]
    return Inputs(
        grads=[x, *weights],
        forward=lambda fn: fn(x.detach(), [w.detach() for w in weights]),
        forward_backward=lambda fn: torch.autograd.backward(fn(x, weights), dys),
        check=lambda name, fn: _check_proj(name, fn, x[:256].detach(), [w.detach() for w in weights],
                                           [d[:256] for d in dys]),
    )


def _check_proj(name, fn, x, weights, dys):
    sizes = [w.shape[0] for w in weights]  # the weights side by side, as one leaf: its gradient is dW
    runs = _three_ways(fn, projections_kernel.separate_matmuls, [x, torch.cat(weights)], dys,
                       lambda f, cast, xi, joint: f(xi, list(joint.split(sizes))))
    outs = [(torch.cat(run[:-2], dim=-1), *run[-2:]) for run in runs]  # (y, dx, dW)
    lengths = (x.shape[1], sum(sizes), x.shape[0])  # the sum behind each y, dx, dW value
    for what, n, ours, torch_impl, ref in zip(("y", "dx", "dW"), lengths, *outs):
        close_to_reference(f"projections {name} {what}", ours, torch_impl, ref, x.dtype, n=n)


# ---- RoPE ----------------------------------------------------------------------------------------
def _rope_cases(tokens):
    # Whole sequences of SEQ tokens (fewer tokens: one shorter sequence), as attention sees them
    sizes = [n if n <= SEQ else n - n % SEQ for n in tokens or (2048, 8192, 16384)]
    return [dict(n_tokens=n, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM) for n in sizes]


def _rope_impls():
    impls = {"ours": rope, "eager": rope_ref, "torch.compile": compiled(rope_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        impls["liger"] = liger_rotary_pos_emb
    return impls


def _rope_inputs(case, dtype):
    """n_tokens as sequences of up to SEQ tokens; q/k [B, heads, T, D] as attention makes them."""
    N, hq, hk, D = case["n_tokens"], case["n_heads"], case["n_kv_heads"], case["head_dim"]
    T = min(N, SEQ)
    B = N // T
    g = generator(N, hq)
    q = torch.randn(B, T, hq, D, generator=g).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, hk, D, generator=g).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    ang = torch.arange(T, dtype=torch.float32)[:, None] * (500000.0 ** (-torch.arange(0, D, 2) / D))
    ang = torch.cat([ang, ang], dim=-1)[None].to(DEVICE)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    dq, dk = torch.randn(q.shape, generator=g).to(DEVICE, dtype), torch.randn(k.shape, generator=g).to(DEVICE, dtype)

    def fwd_bwd(fn):
        qo, ko = fn(q, k, cos, sin)
        torch.autograd.backward([qo, ko], [dq, dk])

    return Inputs(
        grads=[q, k],
        forward=lambda fn: fn(q.detach(), k.detach(), cos, sin),
        forward_backward=fwd_bwd,
        check=lambda name, fn: _check_rope(name, fn, q[:1, :, :64].detach(), k[:1, :, :64].detach(),
                                           cos[:, :64], sin[:, :64]),
    )


def _check_rope(name, fn, q, k, cos, sin):
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    outs = _three_ways(fn, rope_ref, [q, k], [dq, dk], lambda f, cast, qi, ki: f(qi, ki, cast(cos), cast(sin)))
    for i, what in enumerate(("q_embed", "k_embed", "dq", "dk")):
        close_to_reference(f"rope {name} {what}", outs[0][i], outs[1][i], outs[2][i], q.dtype, n=2)


# ---- AdamW (an optimizer step has no backward: "fwd" and "fwd+bwd" both time one step) ----------
def adamw_shapes(n_params):
    """LLaMA 3.1 8B's decoder-layer tensors (q, k, v, o, gate, up, down, two norms), repeated until
    n_params are reached (the last tensor cut short if need be); hidden 64 for --smoke's tiny sizes."""
    h = HIDDEN if n_params >= 10**8 else 64
    i, kv = h * INTERMEDIATE // HIDDEN, h * KV_HEADS // HEADS
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    shapes, left = [], n_params
    while left > 0:
        for s in layer:
            n = min(left, torch.Size(s).numel())
            shapes.append(s if n == torch.Size(s).numel() else (n,))
            left -= n
            if not left:
                break
    return shapes


def _adamw_cases(tokens):
    """5 decoder layers of LLaMA 3.1 8B: 45 tensors, 1,090,560,000 parameters (--sizes does not apply)."""
    return [dict(n_params=5 * sum(torch.Size(s).numel() for s in adamw_shapes(10**9)[:9]))]


def _adamw_impls():
    return {
        "ours": lambda params: adamw_kernel.TritonAdamW(params, lr=1e-3, weight_decay=0.1),
        "torch-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True),
        "torch-foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True),
    }


def _adamw_inputs(case, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(case["n_params"] % 2**31)
    params = [torch.randn(s, generator=g, device=DEVICE, dtype=dtype) for s in adamw_shapes(case["n_params"])]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=DEVICE, dtype=dtype)
    optimizers = {}  # one per implementation, built on its first step; all step the same tensors

    def step(fn):
        optimizers.setdefault(fn, fn(params)).step()

    return Inputs(grads=[], forward=step, forward_backward=step,
                  check=lambda name, fn: _check_adamw(name, fn, dtype))


def _check_adamw(name, fn, dtype):
    """Three steps on small tensors of odd shapes against PyTorch's single-tensor AdamW in float64,
    with PyTorch's fused AdamW in `dtype` as the yardstick (testkit's rule; adamw_test.py says why)."""
    g = torch.Generator(device="cpu").manual_seed(3)
    shapes = [(37, 53), (129,), (5, 3, 7)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    fused = _adamw_impls()["torch-fused"]
    runs = []
    for make, cast in ((fn, dtype), (fused, dtype), (adamw_kernel.adamw_ref, torch.float64)):
        params = [p.to(DEVICE, cast) for p in start]
        opt = make(params) if make is not adamw_kernel.adamw_ref else make(params, lr=1e-3, weight_decay=0.1)
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(DEVICE, cast)
            opt.step()
        runs.append(params)
    for i, s in enumerate(shapes):
        close_to_reference(f"adamw {name} param {list(s)}", runs[0][i], runs[1][i], runs[2][i], dtype)


# ---- Distillation losses (distillation_kernel.py: jsd, linear_jsd; run only when named) --------
# A student LLaMA 3.2 1B (hidden 2048) distilled from LLaMA 3.1 8B (HIDDEN), sharing VOCAB. The JSD
# at beta 0.5; the fused linear JSD at temperature 2, as distillation runs it.
STUDENT_HIDDEN = 2048


def _op_costs(op: str) -> ModuleType:
    """distillation_kernel holds two ops: a view of it whose ideal_bytes / flops are that op's
    (distillation_kernel.<op>_ideal_bytes, <op>_flops), the names KernelSpec calls."""
    view = ModuleType(f"distillation_kernel.{op}")
    view.ideal_bytes = getattr(distillation_kernel, f"{op}_ideal_bytes")
    view.flops = getattr(distillation_kernel, f"{op}_flops", None)
    return view


def _liger_distillation(name):
    """Liger-Kernel's module `name` (from liger_kernel.transformers), or None with a line saying why."""
    if liger() is None or not ON_GPU:
        print(f"  liger skipped: {'Liger-Kernel is not installed' if liger() is None else 'its kernels need a GPU'}")
        return None
    return getattr(liger(), name)


def _jsd_eager(x, y, labels):
    return distillation_kernel.jsd_ref(x, y, 0.5, shift_labels=labels)  # fp32 math, as TRL writes it


def _jsd_cases(tokens):
    return [dict(n_rows=n, vocab=VOCAB) for n in tokens or (1024, 4096, 8192, 16384)]


def _jsd_impls():
    impls = {"ours": lambda x, y, t: distillation_kernel.jsd(x, y, 0.5, shift_labels=t), "eager": _jsd_eager,
             "torch.compile": compiled(_jsd_eager)}
    module = _liger_distillation("LigerJSD")
    if module is not None:
        mod = module(beta=0.5)
        impls["liger"] = lambda x, y, t: mod(x, y, t)  # Liger takes (student log q, teacher log p, shift_labels)
    return impls


def _jsd_inputs(case, dtype):
    """Bf16 log-probabilities of a teacher and of a student whose logits are the teacher's plus noise;
    every 17th token ignored. Generated on the device (three N x V tensors at N = 16384)."""
    N, V = case["n_rows"], case["vocab"]
    g = torch.Generator(device=DEVICE).manual_seed(N + V)
    z = torch.randn(N, V, generator=g, device=DEVICE) * 2
    y = F.log_softmax(z, -1).to(dtype)
    z += torch.randn(N, V, generator=g, device=DEVICE) * 0.7
    x = F.log_softmax(z, -1).to(dtype).requires_grad_()
    del z
    t = torch.randint(0, V, (N,), generator=g, device=DEVICE)
    t[::17] = -100

    def loss_only(fn):
        with torch.no_grad():
            fn(x, y, t)

    return Inputs(grads=[x], forward=loss_only, forward_backward=lambda fn: fn(x, y, t).backward(),
                  check=lambda name, fn: _check_jsd(name, fn, x[:256].detach(), y[:256], t[:256]))


def _check_jsd(name, fn, x, y, t):
    outs = []
    for f, cast in ((fn, lambda v: v), (_jsd_eager, lambda v: v), (_jsd_eager, lambda v: v.double())):
        xi = cast(x).clone().requires_grad_()
        loss = f(xi, cast(y), t)
        loss.backward()
        outs.append((loss.detach(), xi.grad))
    close_to_reference(f"jsd {name} loss", outs[0][0].float(), outs[1][0], outs[2][0], outs[0][0].dtype,
                       n=x.shape[1], scale=1.0)  # scale: the terms (p log p ~ 1 a token) exceed the divergence
    close_to_reference(f"jsd {name} grad", outs[0][1], outs[1][1], outs[2][1], x.dtype)


def _ljsd_eager(xs, ws, xt, wt, t):
    return distillation_kernel.linear_jsd_ref(xs, ws, xt, wt, t, beta=0.5, temperature=2.0)


def _ljsd_cases(tokens):
    return [dict(n_tokens=n, hidden=STUDENT_HIDDEN, teacher_hidden=HIDDEN, vocab=VOCAB)
            for n in tokens or (4096, 8192, 16384)]


def _ljsd_impls():
    impls = {"ours": lambda xs, ws, xt, wt, t: distillation_kernel.linear_jsd(xs, ws, xt, wt, t, 0.5, 2.0),
             "eager": _ljsd_eager, "torch.compile": compiled(_ljsd_eager)}
    module = _liger_distillation("LigerFusedLinearJSD")
    if module is not None:
        mod = module(jsd_beta=0.5, temperature=2.0)
        impls["liger"] = lambda xs, ws, xt, wt, t: mod(xs, ws, xt, wt, t)  # same argument order as ours
    return impls


def _ljsd_inputs(case, dtype):
    N, Hs, Ht, V = case["n_tokens"], case["hidden"], case["teacher_hidden"], case["vocab"]
    g = torch.Generator(device=DEVICE).manual_seed(N + V)
    xs = torch.randn(N, Hs, generator=g, device=DEVICE).to(dtype).requires_grad_()
    ws = (torch.randn(V, Hs, generator=g, device=DEVICE) * Hs**-0.5 * 2).to(dtype).requires_grad_()
    xt = torch.randn(N, Ht, generator=g, device=DEVICE).to(dtype)
    wt = (torch.randn(V, Ht, generator=g, device=DEVICE) * Ht**-0.5 * 2).to(dtype)  # logits ~ N(0, 2)
    t = torch.randint(0, V, (N,), generator=g, device=DEVICE)
    t[::17] = -100
    n_check = min(N, 1152)  # > 1024 tokens: our default chunking takes two chunks

    def loss_only(fn):
        with torch.no_grad():
            fn(xs, ws, xt, wt, t)

    return Inputs(grads=[xs, ws], forward=loss_only, forward_backward=lambda fn: fn(xs, ws, xt, wt, t).backward(),
                  check=lambda name, fn: _check_ljsd(name, fn, xs[:n_check].detach(), ws.detach(), xt[:n_check],
                                                     wt, t[:n_check]))


def _check_ljsd(name, fn, xs, ws, xt, wt, t):
    outs = []
    # fp32 serves as the truth, as for the fused linear cross-entropy: float64 heads would take 6 GB
    for f, cast in ((fn, lambda v: v), (_ljsd_eager, lambda v: v), (_ljsd_eager, lambda v: v.float())):
        xi, wi = cast(xs).clone().requires_grad_(), cast(ws).clone().requires_grad_()
        loss = f(xi, wi, cast(xt), cast(wt), t)
        loss.backward()
        outs.append((loss.detach(), xi.grad, wi.grad))
    V = ws.shape[0]
    close_to_reference(f"linear_jsd {name} loss", outs[0][0].float(), outs[1][0].float(), outs[2][0].float(),
                       outs[0][0].dtype, n=V, scale=1.0)
    close_to_reference(f"linear_jsd {name} dx", outs[0][1], outs[1][1], outs[2][1], xs.dtype, n=V)
    close_to_reference(f"linear_jsd {name} dW", outs[0][2], outs[1][2], outs[2][2], xs.dtype, n=xs.shape[0])


# ---- The table -----------------------------------------------------------------------------------
SPECS = {spec.name: spec for spec in (
    KernelSpec("rmsnorm", rmsnorm_kernel, _rmsnorm_cases,
               smoke=(dict(n_rows=64, hidden=256), dict(n_rows=48, hidden=100)),
               impls=_rmsnorm_impls, inputs=_rmsnorm_inputs, tokens="n_rows", width=lambda c: c["hidden"]),
    KernelSpec("cross_entropy", cross_entropy_kernel, _ce_cases,
               smoke=(dict(n_rows=16, vocab=1000), dict(n_rows=8, vocab=32001)),
               impls=_ce_impls, inputs=_ce_inputs, tokens="n_rows", width=lambda c: c["vocab"]),
    KernelSpec("linear_cross_entropy", linear_cross_entropy_kernel, _flce_cases,
               smoke=(dict(n_tokens=40, hidden=32, vocab=300),),
               impls=_flce_impls, inputs=_flce_inputs, tokens="n_tokens", width=lambda c: c["vocab"],
               compute_bound=True),
    KernelSpec("swiglu", swiglu_kernel, _swiglu_cases,
               smoke=(dict(n_rows=32, width=300),),
               impls=_swiglu_impls, inputs=_swiglu_inputs, tokens="n_rows", width=lambda c: c["width"]),
    KernelSpec("rope", rope_kernel, _rope_cases,
               smoke=(dict(n_tokens=64, n_heads=4, n_kv_heads=2, head_dim=16),),
               impls=_rope_impls, inputs=_rope_inputs, tokens="n_tokens",
               width=lambda c: c["n_heads"] * c["head_dim"]),
    KernelSpec("projections", projections_kernel, _proj_cases,
               smoke=(dict(n_tokens=48, hidden=64, outputs="64+16+16"),),
               impls=_proj_impls, inputs=_proj_inputs, tokens="n_tokens",
               width=lambda c: sum(projections_kernel._sizes(c["outputs"])), compute_bound=True),
    KernelSpec("adamw", adamw_kernel, _adamw_cases,
               smoke=(dict(n_params=100_000),),
               impls=_adamw_impls, inputs=_adamw_inputs, tokens="n_params",
               width=lambda c: len(adamw_shapes(c["n_params"]))),
    KernelSpec("jsd", _op_costs("jsd"), _jsd_cases,
               smoke=(dict(n_rows=8, vocab=1000),),
               impls=_jsd_impls, inputs=_jsd_inputs, tokens="n_rows", width=lambda c: c["vocab"]),
    KernelSpec("linear_jsd", _op_costs("linear_jsd"), _ljsd_cases,
               smoke=(dict(n_tokens=24, hidden=32, teacher_hidden=48, vocab=300),),
               impls=_ljsd_impls, inputs=_ljsd_inputs, tokens="n_tokens", width=lambda c: c["vocab"],
               compute_bound=True),
)}
