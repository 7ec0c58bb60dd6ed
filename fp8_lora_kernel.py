"""LoRA on an FP8 base: a frozen weight kept in FP8, one copy serving the forward and the input gradient.

What you build here: a layer (`Float8FrozenLinear`) whose frozen weight is stored as one row-scaled e4m3
copy, the two FP8 matmuls that read it (y = x W^T and dx = dy W), a Triton kernel that transposes its
bytes for the second one, and `store_frozen_weights`, which turns the frozen FP8 projections of a
LoRA model (fp8_linear_kernel.py's Float8Linear, after peft has wrapped them) into such layers. What you
learn: where a scale may run in a matmul, and how folding it into the other operand lets one copy of a
weight serve two matmuls that reduce along different dimensions.

Under LoRA the base weight never changes: `store_frozen_weights` (after peft has wrapped the layers)
quantizes each frozen weight once, per row, and keeps only that copy, 1 byte per parameter plus one
fp32 scale per row, instead of 2 bytes in bf16 re-quantized every step (6 bytes of traffic). The
forward uses it as fp8_linear_kernel.py's layer does; dx = dy W folds W's row scales into dy's row
quantization, so the same copy serves it (below, the bytes). There is no dW.

Under LoRA the base weight W [N, K] never changes, so it is quantized once, per row (`frozen_weight`:
bit for bit the copy every forward of fp8_linear_kernel.py makes of it), and its bf16 copy is freed: 1 byte per
parameter and 4 per output row instead of 2 per parameter. That one copy serves both matmuls that
read W:
    forward   y  = x W^T:  y[m, n]  = s[n] sum_k x[m, k] q[n, k]     s runs along N, constant along
                                                                     the reduction (K): _scaled_mm's
                                                                     column scales of b (fp8_linear_kernel.py)
    backward  dx = dy W:   dx[m, k] = sum_n (dy[m, n] s[n]) q[n, k]  s runs along the reduction (N),
                                                                     so it is folded into dy: the row
                                                                     quantization of dy takes dy * s
                                                                     (`quantize_rows(..., col_scale=s)`,
                                                                     in registers, no extra pass), and
                                                                     q is multiplied with unit scales
The second line is exact algebra: dx carries two e4m3 roundings, of dy s (per row, at most 2^-4 of
each value) and of W (per row, the same bound), as the per-column recipe's dx does. The choices not
taken: one scale per tensor (also 1 byte per parameter, but every row of W is then scaled to the
largest value of the whole matrix, and rows of small values lose mantissa bits to e4m3's subnormals),
and a second, column-scaled copy for dx (2 bytes per parameter: bf16's footprint, nothing saved).

The price is a transpose. torch._scaled_mm multiplies a row-major `a` by a column-major `b` (cuBLAS's
"TN" layout, the only one Hopper's FP8 matmuls take), so dx = (dy s) q needs q [N, K] with N
contiguous: backward copies it transposed (`transpose_bytes`: read 1 byte, write 1 byte per parameter)
and frees the copy after the matmul. For LLaMA 3.1 8B's 6.98 B projection parameters that is 14.0 GB per
step (~3.3 ms at an H200's ~4.27 TB/s, if the copy runs at copy bandwidth: not measured), against the 6
bytes per parameter (41.9 GB) that re-quantizing a bf16 frozen weight costs every step (read 2,
write 1 per row in the forward, and again per column in backward; 3 more for each forward that
gradient checkpointing recomputes).

Layout of this file: kernel -> launcher -> the autograd.Function -> functional API -> the layer and
storing a model's frozen weights.
"""

from __future__ import annotations

import torch
from torch import nn

from core import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from core.fp8_support import DEFAULT_RECIPE, compiled_graph_trusted, get_recipe
from core.kernel_utils import as_rows, check_device, check_float, next_power_of_2
from core.process import log
from fp8_linear_kernel import (FP8_DTYPE, Float8Linear, check_fp8_device, fast_accum_allowed, quant_rows,  # noqa: F401
                               refuse_create_graph,
                               quantize_rows, scaled_mm)

import triton
import triton.language as tl


# A frozen weight kept in FP8 is multiplied column-major in backward (dx = dy W: the module
# docstring): its bytes, transposed. One [BLOCK_N, BLOCK_K] tile per program, read with
# the input's rows contiguous and written with the output's rows contiguous: 1 byte read and 1 written
# per element. (PyTorch's general strided copy, `q.t().contiguous()`, walks one side a column at a
# time, one byte per 32-byte memory sector unless the cache keeps the rest; the two are not compared on
# a GPU yet.)
@triton.jit
def _transpose_bytes(
    Q,  # pointer to the input, [N, K] bytes (an FP8 tensor viewed as uint8), contiguous
    QT,  # pointer to the output, [K, N] bytes, contiguous
    N,  # rows of Q
    K,  # columns of Q
    BLOCK_N: tl.constexpr,  # tile rows (the contiguous dimension of the output)
    BLOCK_K: tl.constexpr,  # tile columns
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    tile = tl.load(Q + rows[:, None] * K + cols[None, :], mask=(rows < N)[:, None] & (cols < K)[None, :])
    # Triton moves the tile through shared memory, so that both the loads and the stores stay coalesced
    tl.store(QT + cols[:, None] * N + rows[None, :], tl.trans(tile), mask=(cols < K)[:, None] & (rows < N)[None, :])


TRANSPOSE_BLOCK, TRANSPOSE_WARPS = 128, 4  # the transposing quantizer's tile and warps; not swept on its own


def transpose_bytes(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] of a one-byte dtype (float8_e4m3fn) -> its transpose [K, N], contiguous: the same bytes as
    `q.t().contiguous()`, one read and one write of each."""
    if q.dim() != 2 or q.element_size() != 1:
        raise ValueError(f"transpose_bytes takes a 2-D tensor of a one-byte dtype, got {q.dtype} {tuple(q.shape)}")
    q = q.contiguous()
    N, K = q.shape
    qt = torch.empty((K, N), dtype=q.dtype, device=q.device)
    if q.numel():
        block_n = block_k = TRANSPOSE_BLOCK
        if kernel_utils.INTERPRET:  # few, large programs: the interpreter pays per program
            block_n, block_k = min(256, next_power_of_2(N)), min(256, next_power_of_2(K))
        grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
        _transpose_bytes[grid](q.view(torch.uint8), qt.view(torch.uint8), N, K, BLOCK_N=block_n, BLOCK_K=block_k,
                               num_warps=TRANSPOSE_WARPS)
    return qt



def frozen_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen weight W [N, K] as it is stored: (q [N, K] float8_e4m3fn, scale [N] fp32) with
    W ~= q * scale[:, None], the row quantization (`quantize_rows`) every forward of fp8_linear_kernel.py makes of W."""
    with torch.no_grad():
        q, scale, _ = quantize_rows(as_rows(weight.detach()))
    return q, scale


def frozen_forward(x2: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, handoff=None,
                   ops: bool = False) -> torch.Tensor:
    """y = x W^T, bf16 [M, N], from x [M, K] and a stored FP8 weight (wq [N, K], its row scales ws [N]).
    `handoff`: x's row copy is shared with the next layer that reads the same x (q/k/v, gate/up), as
    `Float8LinearFunction` shares it; None: quantized here alone."""
    hit = handoff.shared_rows.get(x2) if handoff is not None else None
    if hit is not None:
        xq, sx = hit[0], hit[1]
    else:
        xq, sx, _ = quant_rows(x2, True, False, ops)
        if handoff is not None:
            handoff.shared_rows.put(x2, (xq, sx, None))  # no column maxima: a trained layer makes its own
    return scaled_mm(xq, sx, wq, ws, fast_accum_allowed(x2.device), ops)


def frozen_input_grad(dy2: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bf16_dgrad: bool = False,
                      ops: bool = False) -> torch.Tensor:
    """dx = dy W, bf16 [M, K], from dy [M, N] and a stored FP8 weight (module docstring): dy times
    the weight's row scales, quantized per row, times q, transposed for the matmul (a copy freed after
    it; unit scales along K). `bf16_dgrad` (the recipe rowwise-bf16-dgrad): a bf16 matmul with the
    weight dequantized instead, one weight's bf16 copy at a time."""
    if bf16_dgrad:
        return dy2 @ (wq.float() * ws[:, None]).to(dy2.dtype)
    dyq, sdy, _ = quant_rows(dy2, True, False, ops, col_scale=ws)
    # [K, N] row-major, i.e. q column-major; while torch.compile traces, PyTorch's copy (the same bytes)
    wqt = wq.view(torch.uint8).t().contiguous().view(FP8_DTYPE) if ops else transpose_bytes(wq)
    ones = torch.ones(wq.shape[1], dtype=torch.float32, device=wq.device)  # the scales are all in dy's
    return scaled_mm(dyq, sdy, wqt, ones, False, ops)


class Float8FrozenLinearFunction(torch.autograd.Function):
    """y = x W^T for a frozen weight kept in FP8 (`store_fp8_weight`): the forward and the
    input gradient as FP8 matmuls from the one stored copy (`frozen_forward`, `frozen_input_grad`).

    Saved for backward: the stored weight and its scales (no copy), nothing of x (dx does not need x,
    and there is no dW). `handoff`: the model's `Fp8Handoff` (fp8_producers_kernel.py) for a layer that
    shares its input (x's row copy), or None; `ops`: through the custom operators (torch.compile)."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, handoff, ops: bool,
                bf16_dgrad: bool):
        if handoff is not None:
            handoff.start_forward()
        y = frozen_forward(x2, wq, ws, handoff, ops)
        ctx.handoff, ctx.ops, ctx.bf16_dgrad = handoff, ops, bf16_dgrad
        ctx.save_for_backward(wq, ws)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        refuse_create_graph()
        if ctx.handoff is not None:
            ctx.handoff.start_backward()  # the forward's shared row copies are not needed any more
        dx = None
        if ctx.needs_input_grad[0]:
            wq, ws = ctx.saved_tensors
            dx = frozen_input_grad(as_rows(dy), wq, ws, ctx.bf16_dgrad, ctx.ops).to(dy.dtype)
        return dx, None, None, None, None, None



@torch.compiler.disable
def _fp8_frozen_linear_eager(x, weight, weight_scale, bias, handoff, recipe):
    return fp8_frozen_linear(x, weight, weight_scale, bias, handoff, recipe)


def fp8_frozen_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, handoff=None,
                      recipe: str = DEFAULT_RECIPE) -> torch.Tensor:
    """F.linear(x, W, bias) for a frozen W kept in FP8: weight [N, K] float8_e4m3fn and its row scales
    weight_scale [N] fp32 (`frozen_weight`), any leading shape of x. The forward and dx run as FP8
    matmuls from that one copy (`Float8FrozenLinearFunction`); W gets no gradient. The output has x's
    dtype (the autocast dtype under torch.autocast). `recipe`: a row-wise recipe (rowwise-bf16-dgrad:
    dx in bf16 from the dequantized weight). torch.compile as in `fp8_linear`."""
    r = get_recipe(recipe)
    compiling = torch.compiler.is_compiling()
    if compiling and not compiled_graph_trusted(x.device):
        return _fp8_frozen_linear_eager(x, weight, weight_scale, bias, handoff, recipe)
    check_float("x", x)
    check_device(x, weight, weight_scale)
    if r.scaling != "row":
        raise ValueError(f"a weight kept in FP8 has row scales; recipe {recipe} scales {r.scaling}-wise")
    N, K = weight.shape
    if weight.dtype != FP8_DTYPE or weight_scale.shape != (N,) or weight_scale.dtype != torch.float32:
        raise ValueError(f"a weight kept in FP8 is [out, in] {FP8_DTYPE} with [out] fp32 row scales, got "
                         f"{weight.dtype} {tuple(weight.shape)} and {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if x.dim() == 0 or x.shape[-1] != K:
        raise ValueError(f"x's last dimension must equal in_features = {K}, got x of shape {tuple(x.shape)}")
    if not compiling:
        check_fp8_device(x.device, recipe)
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x2 = as_rows(x.to(out_dtype))
    if x2.shape[0] == 0:  # no tokens: an empty output (and an empty dx), no zero-sized matmul
        y = x2 @ x2.new_zeros((K, N))
    else:
        y = Float8FrozenLinearFunction.apply(x2, weight, weight_scale, None if compiling else handoff, compiling,
                                             r.bf16_dgrad)
    y = y.view(*x.shape[:-1], N)
    return y if bias is None else y + bias.to(out_dtype)


class Float8FrozenLinear(Float8Linear):
    """A Float8Linear whose frozen weight is kept in FP8 (`store_fp8_weight` makes one, in place): `weight`
    a float8_e4m3fn [out, in] Parameter (requires_grad False) and the buffer `weight_scale` [out] fp32 its
    row scales. Its forward and input gradient run from that one copy (`fp8_frozen_linear`); lora_kernel.py
    calls `frozen_forward` and `frozen_input_grad` from its own autograd.Function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_frozen_linear(x, self.weight, self.weight_scale, self.bias, self._frozen_handoff(), self.recipe)

    def _frozen_handoff(self):
        """The hand-off for a layer whose input other layers read too (q/k/v, gate/up: `keep_fp8_input`
        False), which then share its row copy; None for the others."""
        return None if self.keep_fp8_input else self.fp8_handoff

    def frozen_forward(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, in] -> x W^T [M, out] bf16 (no bias), for an autograd.Function that owns the layer's
        backward (lora_kernel.LoRALinearFunction); eager mode."""
        if self.fp8_handoff is not None:
            self.fp8_handoff.start_forward()
        return frozen_forward(x2, self.weight, self.weight_scale, self._frozen_handoff())

    def frozen_input_grad(self, dy2: torch.Tensor) -> torch.Tensor:
        """dy2 [M, out] -> dy W [M, in] bf16, the backward of `frozen_forward`."""
        if self.fp8_handoff is not None:
            self.fp8_handoff.start_backward()
        return frozen_input_grad(dy2, self.weight, self.weight_scale, get_recipe(self.recipe).bf16_dgrad)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", weight kept in fp8"


class BlockScaledFrozenFunction(torch.autograd.Function):
    """y = x W^T for a frozen weight kept in MXFP8 or NVFP4 (`BlockScaledFrozenLinear`): the forward and the
    input gradient from the stored copies; nothing saved but the layer (no dW, dx does not need x)."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, layer: "BlockScaledFrozenLinear"):
        ctx.layer = layer
        return layer.frozen_forward(x2).to(x2.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        refuse_create_graph()
        dx = ctx.layer.frozen_input_grad(as_rows(dy)).to(dy.dtype) if ctx.needs_input_grad[0] else None
        return dx, None


class BlockScaledFrozenLinear(Float8Linear):
    """LoRA's frozen base in Blackwell's block-scaled formats (recipes mxfp8, nvfp4 and their emulated
    forms): the weight quantized once (`store_block_scaled_weight`) in both copies the two matmuls read,
    the copy along K for y = x W^T (`weight`: MXFP8 e4m3 [out, in], NVFP4 packed e2m1 [out, in / 2]) and
    the transposed copy along N for dx = dy W (`weight_t`), each with its block scales (NVFP4: also its
    tensor scale). A block scale cannot be folded into the other operand as a row scale can
    (Float8FrozenLinear), hence two copies: MXFP8 keeps ~2.06 bytes per parameter (bf16's footprint, but
    no re-quantization of the weight every step: 6 bytes of traffic per parameter less), NVFP4 ~1.13
    (its 16x16 tiles give both copies the same scales). The activations and gradients are quantized as
    the recipe's layer quantizes them (fp8_recipes_kernel.quant_operand)."""

    def stores_fp8(self) -> bool:
        return True

    def _scales(self, transposed: bool):
        s = self.weight_t_scale if transposed else self.weight_scale
        if get_recipe(self.recipe).scaling == "nvfp4":
            return s, self.weight_t_tensor_scale if transposed else self.weight_tensor_scale
        return s

    def frozen_forward(self, x2: torch.Tensor) -> torch.Tensor:
        import fp8_recipes_kernel as recipes

        r = get_recipe(self.recipe)
        xq, sx, _, _ = recipes.quant_operand(x2, r.scaling, False, True, False, False,
                                            four_over_six=r.four_over_six)
        return recipes.mm_scaled(xq, sx, self.weight, self._scales(False), r.scaling, True, False, False, r.emulated)

    def frozen_input_grad(self, dy2: torch.Tensor) -> torch.Tensor:
        import fp8_recipes_kernel as recipes

        r = get_recipe(self.recipe)
        dyq, sdy, _, _ = recipes.quant_operand(dy2, r.scaling, False, True, False, False, grad=True)
        return recipes.mm_scaled(dyq, sdy, self.weight_t, self._scales(True), r.scaling, True, False, False,
                                 r.emulated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_float("x", x)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x's last dimension must equal in_features = {self.in_features}, got {tuple(x.shape)}")
        if not torch.compiler.is_compiling():
            import fp8_recipes_kernel

            fp8_recipes_kernel.check_fp8_device(x.device, self.recipe)  # (fp8_linear_kernel's is row-wise only)
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x2 = as_rows(x.to(out_dtype))
        y = (x2 @ x2.new_zeros((self.in_features, self.out_features)) if x2.shape[0] == 0
             else BlockScaledFrozenFunction.apply(x2, self))
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", weight kept in {get_recipe(self.recipe).scaling}"


def store_block_scaled_weight(layer: Float8Linear) -> None:
    """Quantize a frozen MXFP8 / NVFP4 layer's weight once, both copies, and keep only those: the layer
    becomes a `BlockScaledFrozenLinear` in place (as `store_fp8_weight` does for row scales)."""
    import fp8_recipes_kernel as recipes
    from core.tensors import fingerprint

    if layer.stores_fp8():
        return
    if layer.weight.requires_grad:
        raise ValueError("only a frozen weight (requires_grad=False, as LoRA's base) can be kept quantized: "
                         "this one is trained")
    recipe = get_recipe(layer.recipe)
    scaling = recipe.scaling
    layer.base_fingerprints = {"weight": fingerprint(layer.weight)}
    q, s, qt, st = recipes.quant_operand(layer.weight.detach(), scaling, True, True, True, False,
                                         four_over_six=recipe.four_over_six)
    if scaling == "nvfp4":
        (s, g), (st, gt) = s, st
        layer.register_buffer("weight_tensor_scale", g)
        layer.register_buffer("weight_t_tensor_scale", gt)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.register_buffer("weight_scale", s)
    layer.register_buffer("weight_t", qt)
    layer.register_buffer("weight_t_scale", st)
    layer.__class__ = BlockScaledFrozenLinear


def store_fp8_weight(layer: Float8Linear) -> None:
    """Quantize a Float8Linear's frozen weight once (`frozen_weight`) and keep only that: the layer becomes a
    `Float8FrozenLinear` in place (the same module: peft's wrapper and the joined groups keep it); the bf16
    Parameter is dropped, and freed once nothing else holds it. The state dict then holds the FP8 weight
    and its scales under `weight` and `weight_scale`. `base_fingerprints` keeps the float64 sum and L2 norm
    of the bf16 weight (a sync, once), which checkpoints record for the frozen base instead of the FP8
    values' (playbook/store/checkpoint.py): an adapter trained on this base resumes on its bf16 original and the
    other way round. ValueError for a weight that needs a gradient (it could never change again) or a
    recipe without row scales; twice: nothing."""
    if layer.stores_fp8():
        return
    if layer.weight.requires_grad:
        raise ValueError("only a frozen weight (requires_grad=False, as LoRA's base) can be kept in FP8: "
                         "this one is trained")
    if get_recipe(layer.recipe).scaling != "row":
        raise ValueError(f"a weight kept in FP8 has one scale per row; recipe {layer.recipe} scales "
                         f"{get_recipe(layer.recipe).scaling}-wise (use a row-wise recipe)")
    from core.tensors import fingerprint

    layer.base_fingerprints = {"weight": fingerprint(layer.weight)}
    q, scale = frozen_weight(layer.weight)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.register_buffer("weight_scale", scale)
    layer.__class__ = Float8FrozenLinear


def store_frozen_weights(model: nn.Module) -> int:
    """Keep the frozen weight of every Float8Linear of `model` in FP8 (`store_fp8_weight`),
    once: call it after peft has wrapped the layers and frozen their weights (`playbook.model.models.prepare_model`
    does, for --lora-r with --fp8). peft sizes and casts a new adapter to its base layer's weight dtype,
    so an FP8 weight before peft would give FP8 adapters. Layers whose weight is trained, or whose recipe
    has no row scales, keep their bf16 weight (re-quantized every step), named in one log line. Returns
    how many layers keep their weight in FP8; calling it twice changes nothing."""
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    kept = []
    for m in layers:
        if m.weight.requires_grad:
            kept.append("trained weights")
        elif get_recipe(m.recipe).scaling in ("mx", "nvfp4"):
            store_block_scaled_weight(m)
        elif get_recipe(m.recipe).scaling != "row":
            kept.append(f"recipe {m.recipe} (its scales are neither row-wise nor block-scaled MX/NVFP4)")
        else:
            store_fp8_weight(m)
    if kept:
        log(f"FP8: {len(kept)} frozen-base layer(s) keep their bf16 weight, quantized every step: "
            f"{'; '.join(sorted(set(kept)))}")
    return sum(m.stores_fp8() for m in layers)



def store_frozen_base(model: nn.Module, processes: int = 1) -> int:
    """--lora-r with --fp8: the frozen projection weights that run in FP8 are kept in FP8 (`store_frozen_weights`,
    after peft wrapped and froze them; their bf16 copies freed), and what that saves is logged; returns how
    many. Across `processes` > 1 (torchrun) they stay bf16 (FSDP2 would gather FP8 shards, which is not tried)."""
    import projections_kernel

    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    if not layers:
        return 0
    if processes > 1:
        log("FP8 base: under torchrun the frozen FP8 projections keep their bf16 weights (quantized every step)")
        return 0
    was = {m: m.weight.numel() * m.weight.element_size() for m in layers if not m.stores_fp8()}
    stored = store_frozen_weights(model)
    # The joined q/k/v groups still name the nn.Linear layers the kernels found, which hold the bf16
    # Parameters: joined again with the current layers now, so that those are freed before the first step.
    projections_kernel.join_now(model)
    if not stored:  # (store_frozen_weights said why)
        return 0
    before = sum(n for m, n in was.items() if m.stores_fp8())
    after = sum(t.numel() * t.element_size() for m in layers if m.stores_fp8() for t in (m.weight, *m.buffers()))

    def size(n: int) -> str:  # both figures in the unit of the larger
        return f"{n / 1e9:.2f} GB" if before >= 1e9 else f"{n / 1e6:.3f} MB"

    scaling = get_recipe(layers[0].recipe).scaling
    fmt = {"mx": "MXFP8 (the copies along K and N, 1x32 blocks", "nvfp4": "NVFP4 (the copies along K and N, "
           "16x16 blocks"}.get(scaling, "FP8 (e4m3 and one fp32 scale per row")
    log(f"FP8 base: {stored} frozen projection weights kept in {fmt}, quantized once): {size(after)} instead of "
        f"{size(before)}; forward and input-gradient matmuls in that format, adapters in their own dtype")
    return stored
