"""Fused LoRA layers: what peft computes for a LoRA projection, without the fp32 detour and the extra copies.

    $ python lora_test.py                 # the tests, as a short report
    >>> from playbook.model.lora import apply_lora
    >>> model = apply_lora(model, r=16)
    >>> import lora_kernel
    >>> lora_kernel.patch_model(model)    # 224 projections of LLaMA 3.1 8B at r=16 on all seven

This lesson has no Triton kernel: the saving is in what autograd keeps, not in a new kernel. peft's
LoRA layer computes y = x W^T + b + s B(A(dropout(x))) as separate modules in fp32 where the adapter
weights are fp32, so for a bf16 model each adapted projection keeps an fp32 copy of its input for
backward, and a fused SwiGLU MLP with an adapter on down_proj keeps h = silu(gate) * up alive. Bytes
saved for backward per token, per layer of LLaMA 3.1 8B (hidden 4096, intermediate 14336, bf16):

    peft:   x of each of the 7 projections in fp32 (4 bytes), plus h for down_proj's adapter
    fused:  x in bf16 (the tensor the previous op produced, not a copy) and r values of x A^T; the
            MLP keeps gate and up (saved anyway by SwiGLU) and rebuilds h in backward

A base layer whose frozen weight is kept in FP8 (`--lora-r --fp8`: fp8_lora_kernel.py's
`Float8FrozenLinear`) takes the same path: its x W^T and dy W run as that layer's FP8
matmuls (`frozen_forward`, `frozen_input_grad`) inside these functions, as a 4-bit base is
dequantized inside them.

The ladder: `LoRALinearFunction` and `SwiGLUDownLoRAFunction` (the autograd functions; each
calls torch matmuls, so no custom operator is needed for torch.compile to see through them) ->
`fused_lora_forward` / `swiglu_lora_mlp_forward` (drop-in forwards for peft's modules) ->
`patch_model(model)` (`expected_patches(model)` says how many), the float64 composition in the
tests beside them as the reference.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

import swiglu_kernel  # its operators (torch.ops.playbook.swiglu_fwd / swiglu_bwd) and the fused MLP forward
from core.process import is_peft_model


def _peft_lora_layers(model: nn.Module) -> tuple:
    """The peft LoRA linear layer classes this file fuses (the 4-bit one when bitsandbytes is loaded)."""
    import peft  # a LoRA model exists, so peft is installed

    kinds = (peft.tuners.lora.layer.Linear,)
    if "bitsandbytes" in sys.modules:
        kinds += (peft.tuners.lora.bnb.Linear4bit,)
    return kinds

# peft keeps the adapter weights A [r, in] and B [out, r] in fp32 (good for the optimizer) and, to
# match them, casts each adapter's *input* to fp32 before `B(A(dropout(x))) * scaling`. For LLaMA
# 3.1 8B at 4 x 2048 tokens that is a [8192, 4096] fp32 copy of x per projection (128 MB; 470 MB for
# down_proj's input), saved for A's gradient, in all 7 x 32 projections: ~38 GB of activations that
# a bf16 model never needed, plus fp32 matmuls, an fp32 [tokens, out] sum and a cast back per layer.
#
# `LoRALinearFunction` computes the same y = x W^T + b + s (x A^T) B^T in x's dtype (bf16 in
# training) with fp32 accumulation inside each matmul:
#     forward:   y  = x W^T (+ b);  xa = x A^T  [tokens, r];  y += s xa B^T   (one addmm, in place)
#     backward:  dyB = dy B  [tokens, r]
#                dB  = s dy^T xa          dA = s dyB^T x
#                dx  = dy W + s dyB A     (one addmm onto dy W)
#                dW  = dy^T x only if the base weight is trained (never with peft: it is frozen)
# and saves only x (the very tensor the previous op produced, not a copy) and xa (r values per
# token). A and B are cast to x's dtype for the matmuls (a few MB) and their gradients are cast back
# to the adapters' own dtype, so the optimizer still sees fp32 parameters and fp32 gradients.
class LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_a, lora_b, scaling, dequantize=None, fp8_base=None):
        # x: [..., in]; x_lora: x after the adapter's dropout (x itself without dropout).
        # dequantize: for a 4-bit base layer, a function returning its weight in x's dtype; it is
        # called again in backward, so the dequantized weight never outlives one matmul.
        # fp8_base: a Float8Linear whose frozen weight is kept in FP8 (weight is then None): x W^T and
        # dy W run as its FP8 matmuls (`frozen_forward`, `frozen_input_grad`), bf16 out.
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        xl2 = x2 if x_lora is x else x_lora.reshape(-1, x.shape[-1])
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        if fp8_base is not None:
            y = fp8_base.frozen_forward(x2)
            if bias is not None:
                y += bias.to(dtype)
        else:
            w = weight if dequantize is None else dequantize()
            y = x2 @ w.t() if bias is None else torch.addmm(bias.to(dtype), x2, w.t())
            del w
        xa = xl2 @ a.t()
        y.addmm_(xa, b.t(), alpha=scaling)
        ctx.scaling, ctx.dequantize, ctx.fp8_base = scaling, dequantize, fp8_base
        ctx.same_input = x_lora is x
        ctx.save_for_backward(x2, None if x_lora is x else xl2, weight if dequantize is None else None, xa, a, b)
        ctx.shapes = (x.shape, lora_a.dtype, lora_b.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, xl2, weight, xa, a, b = ctx.saved_tensors
        xl2 = x2 if ctx.same_input else xl2
        x_shape, a_dtype, b_dtype = ctx.shapes
        s = ctx.scaling
        need_x, need_xl, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:6]
        dy2 = dy.reshape(-1, dy.shape[-1]).to(x2.dtype)
        dyb = dy2 @ b  # [tokens, r]
        dx = dxl = dw = dbias = da = db = None
        if need_b:
            db = (dy2.t() @ xa).mul_(s).to(b_dtype)
        if need_a:
            da = (dyb.t() @ xl2).mul_(s).to(a_dtype)
        if need_x or (need_xl and ctx.same_input):
            if ctx.fp8_base is not None:
                dx = ctx.fp8_base.frozen_input_grad(dy2)
            else:
                dx = dy2 @ (weight if ctx.dequantize is None else ctx.dequantize())  # 4 bits: unpacked only here
            if ctx.same_input:
                dx.addmm_(dyb, a, alpha=s)
            dx = dx.view(x_shape)
        if need_xl and not ctx.same_input:
            dxl = (dyb @ a).mul_(s).view(x_shape)
        if need_w:
            dw = (dy2.t() @ x2).to(weight.dtype)
        if need_bias:
            dbias = dy2.sum(0)  # dy2 is in x's dtype, which _fusable requires to be the base weight's
        return dx, dxl, dw, dbias, da, db, None, None, None


def _fusable(layer, x, args, kwargs) -> str | None:
    """The active adapter's name if this call can take the fused path, else None (peft's own forward)."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    if torch.is_autocast_enabled(x.device.type) or not x.is_floating_point():
        return None
    base = layer.base_layer
    if type(base) is nn.Linear:
        return active[0] if x.dtype == base.weight.dtype else None
    if _is_fp8_base(base):  # its FP8 matmuls write bf16; while torch.compile traces, the layer's own forward
        return active[0] if x.dtype == torch.bfloat16 and not torch.compiler.is_compiling() else None
    if _is_4bit(base) and getattr(base.weight, "quant_state", None) is not None:
        return active[0] if x.dtype == base.compute_dtype else None
    return None


def _is_fp8_base(module) -> bool:
    """A layer whose frozen weight is kept in FP8 (fp8_lora_kernel.Float8FrozenLinear)."""
    stores = getattr(module, "stores_fp8", None)
    return callable(stores) and stores()


def _is_4bit(module) -> bool:
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and type(module) is bnb.nn.Linear4bit


def fused_lora_forward(layer, x, *args, **kwargs):
    """peft's `lora.Linear.forward`, through `LoRALinearFunction` when it can (one plain adapter, no
    autocast, input in the base weight's dtype); anything else goes through peft unchanged."""
    name = _fusable(layer, x, args, kwargs)
    if name is None:
        return type(layer).forward(layer, x, *args, **kwargs)
    base = layer.base_layer
    dropout = layer.lora_dropout[name]
    x_lora = x if isinstance(dropout, nn.Identity) else dropout(x)
    weight, dequantize, fp8_base = base.weight, None, None
    if _is_4bit(base):
        weight, dequantize = None, _dequantizer(base, x.dtype)
    elif _is_fp8_base(base):
        weight, fp8_base = None, base
    return LoRALinearFunction.apply(x, x_lora, weight, base.bias, layer.lora_A[name].weight,
                                    layer.lora_B[name].weight, float(layer.scaling[name]), dequantize, fp8_base)


def _dequantizer(base, dtype):
    """A function returning the 4-bit layer's weight as a [out, in] tensor of `dtype`."""
    from bitsandbytes.functional import dequantize_4bit

    packed, state = base.weight.data, base.weight.quant_state
    return lambda: dequantize_4bit(packed, state).to(dtype)


def patch_model(model: nn.Module) -> int:
    """Route every peft LoRA linear layer of `model` through `fused_lora_forward`; return how many.

    The modules, parameters and state dict stay peft's own (saving, loading and merging adapters
    are unchanged); only the forward computation is replaced. Call it after `apply_lora`.
    """
    if not is_peft_model(model):
        raise ValueError(f"fuse_lora_layers needs a LoRA model (the result of apply_lora), got {type(model).__name__}")
    kinds = _peft_lora_layers(model)
    layers = [m for m in model.modules() if type(m) in kinds]
    for m in layers:
        m.forward = types.MethodType(fused_lora_forward, m)
    # MLPs already on the fused SwiGLU forward, with an adapter on down_proj: h recomputed, not saved
    for m in model.modules():
        if getattr(m.forward, "__func__", None) is swiglu_kernel.swiglu_mlp_forward and type(
                getattr(m, "down_proj", None)) in kinds:
            m.forward = types.MethodType(swiglu_lora_mlp_forward, m)
    return len(layers)


# The MLP's down_proj with LoRA, h = silu(gate) * up recomputed in backward. With LoRA on down_proj,
# the fused SwiGLU MLP calls the adapter-wrapped module on h, and that module saves h for A's
# gradient: [tokens, intermediate] per layer, 7.5 GB for LLaMA 3.1 8B at 4 x 2048 tokens. g and u
# are saved anyway (for the SwiGLU backward), so this function keeps them instead of h and rebuilds h
# with one SwiGLU forward in backward, as `swiglu_kernel.swiglu_down` does for the plain MLP:
#     forward:   h = swiglu(g, u);  y = h W^T;  ha = h A^T;  y += s ha B^T
#     backward:  dyB = dy B;  dB = s dy^T ha;  dh = dy W + s dyB A;  dA = s dyB^T swiglu(g, u)
#                dg, du = swiglu_backward(dh, g, u)
class SwiGLUDownLoRAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, lora_a, lora_b, scaling, dequantize=None, fp8_base=None):
        swiglu = torch.ops.playbook.swiglu_fwd
        g2, u2 = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        a, b = lora_a.to(gate.dtype), lora_b.to(gate.dtype)
        h = swiglu(g2, u2)
        if fp8_base is not None:  # a frozen base kept in FP8 (LoRALinearFunction): its FP8 matmuls
            y = fp8_base.frozen_forward(h)
        else:
            y = h @ (weight if dequantize is None else dequantize()).t()
        ha = h @ a.t()
        y.addmm_(ha, b.t(), alpha=scaling)
        ctx.scaling, ctx.dtypes, ctx.shape, ctx.dequantize = scaling, (lora_a.dtype, lora_b.dtype), gate.shape, dequantize
        ctx.fp8_base = fp8_base
        ctx.save_for_backward(g2, u2, weight if dequantize is None else None, ha, a, b)  # not h
        return y.view(*gate.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        g2, u2, weight, ha, a, b = ctx.saved_tensors
        s, (a_dtype, b_dtype) = ctx.scaling, ctx.dtypes
        need_g, need_u, need_w, need_a, need_b = ctx.needs_input_grad[:5]
        dy2 = dy.reshape(-1, dy.shape[-1]).to(g2.dtype)
        dyb = dy2 @ b
        dg = du = dw = da = db = None
        if need_b:
            db = (dy2.t() @ ha).mul_(s).to(b_dtype)
        if need_a or need_w:
            h = torch.ops.playbook.swiglu_fwd(g2, u2)  # recomputed, used, dropped
            if need_a:
                da = (dyb.t() @ h).mul_(s).to(a_dtype)
            if need_w:
                dw = (dy2.t() @ h).to(weight.dtype)
            del h
        if need_g or need_u:
            if ctx.fp8_base is not None:
                dh = ctx.fp8_base.frozen_input_grad(dy2)
            else:
                dh = dy2 @ (weight if ctx.dequantize is None else ctx.dequantize())  # 4 bits: unpacked only here
            dh.addmm_(dyb, a, alpha=s)
            dg, du = torch.ops.playbook.swiglu_bwd(dh, g2, u2)
            dg, du = dg.view(ctx.shape), du.view(ctx.shape)
        return dg, du, dw, da, db, None, None, None


def swiglu_lora_mlp_forward(mlp, x):
    """The fused SwiGLU MLP whose down_proj carries a LoRA adapter: h is not kept for backward.
    Anything `fused_lora_forward` would not fuse (dropout, a bias, ...) goes the general way."""
    down = mlp.down_proj
    g, u = mlp.gate_proj(x), mlp.up_proj(x)
    name = _fusable(down, g, (), {})
    if name is None or down.base_layer.bias is not None or not isinstance(down.lora_dropout[name], nn.Identity):
        return down(swiglu_kernel.swiglu(g, u))
    base = down.base_layer
    weight, dequantize = (None, _dequantizer(base, g.dtype)) if _is_4bit(base) else (base.weight, None)
    fp8_base = base if _is_fp8_base(base) else None
    if fp8_base is not None:
        weight = None
    return SwiGLUDownLoRAFunction.apply(g, u, weight, down.lora_A[name].weight, down.lora_B[name].weight,
                                        float(down.scaling[name]), dequantize, fp8_base)


fuse_lora_layers = patch_model  # the name the LoRA glue has used for it


def expected_patches(model: nn.Module) -> int:
    """How many projections `patch_model` routes: every peft LoRA linear layer of the model."""
    if not is_peft_model(model):
        return 0
    kinds = _peft_lora_layers(model)
    return sum(type(m) in kinds for m in model.modules())


# ------------------------------------------------------------------------------------------------
# References: the formulas as plain autograd composes them
# ------------------------------------------------------------------------------------------------
def lora_linear_ref(x, x_lora, weight, bias, lora_a, lora_b, scaling):
    """y = x W^T + s (x_lora A^T) B^T (+ b), what `LoRALinearFunction` computes (x_lora: x after dropout)."""
    y = x @ weight.t() + (x_lora @ lora_a.t()) @ lora_b.t() * scaling
    return y if bias is None else y + bias


def swiglu_down_lora_ref(gate, up, weight, lora_a, lora_b, scaling):
    """h = silu(gate) * up; y = h W^T + s (h A^T) B^T, what `SwiGLUDownLoRAFunction` computes."""
    h = nn.functional.silu(gate) * up
    return h @ weight.t() + (h @ lora_a.t()) @ lora_b.t() * scaling
