"""LoRA through peft: add low-rank adapters to a (kernel-patched) causal LM, save them, merge them.

    >>> from lora import apply_lora, save_adapter, merge_and_save
    >>> model = apply_lora(model, r=16)                 # all seven linear layers, alpha = 2 r
    trainable parameters: 41,943,040 of 8,072,204,288 (0.52%)
    >>> save_adapter(model, "out/adapter")              # adapter_model.safetensors + adapter_config.json
    >>> merge_and_save(model, "out/merged", tokenizer)  # a plain Hugging Face model, adapters folded in

LoRA replaces the update of a frozen weight W [out, in] by B @ A, with A [r, in] and B [out, r]:
the layer computes W x + (alpha / r) B A x. Only A and B are trained (B starts at zero, so the
model starts exactly where the base model is), which makes optimizer state and gradients tiny:
for LLaMA 3.1 8B at r = 16 on all seven projections, 42 M trainable parameters instead of 8 B.

Order with the kernels: `apply_kernels` runs first, then `apply_lora`, then `fuse_lora_layers`.
The kernels replace MLP forwards, RMSNorm modules and the causal LM's forward, never the seven
projection modules, so peft finds and wraps exactly the nn.Linear modules it would find in an
unpatched model. `fuse_lora_layers` then swaps the computation (not the modules) of every
adapter-wrapped projection for `LoRALinearFunction`, and of every fused SwiGLU MLP with an adapted
down_proj for `SwiGLUDownLoRAFunction` (see below for what each saves); the optimized scripts call
it whenever kernels are on, the baseline keeps peft's own forward.

    >>> model = apply_lora(model, r=16)
    >>> fuse_lora_layers(model)                         # 224 projections of LLaMA 3.1 8B
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
from torch import nn

# LLaMA's (and Mistral's, Qwen2's) linear layers inside each decoder layer
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
TARGET_SETS = {"all": ALL_TARGETS, "attention": ATTENTION_TARGETS}


def _peft():
    # peft imports triton; on a machine without a GPU the kernels need Triton's interpreter, which is
    # switched on only if kernel_utils is imported before triton is (Triton reads the switch once)
    from playbook import kernel_utils  # noqa: F401

    try:
        import peft
    except ImportError:
        raise RuntimeError("LoRA needs the peft package: pip install peft") from None
    return peft


def _log(text: str) -> None:
    from playbook.common import log  # prints on the main process only

    log(text)


def parse_targets(targets) -> tuple:
    """'all' -> the seven projections, 'attention' -> q, k, v, o, or a comma list / list of their names."""
    if isinstance(targets, str):
        key = targets.strip().lower()
        if key in TARGET_SETS:
            return TARGET_SETS[key]
        names = [w.strip() for w in targets.split(",") if w.strip()]
    elif isinstance(targets, (list, tuple)):
        names = [str(w).strip() for w in targets]
    else:
        raise ValueError(f"LoRA targets must be 'all', 'attention', a comma list or a list, got {type(targets).__name__}")
    if not names:
        raise ValueError("LoRA targets are empty: name at least one of " + ", ".join(ALL_TARGETS))
    unknown = [n for n in names if n not in ALL_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {', '.join(unknown)}; valid: {', '.join(ALL_TARGETS)}, "
                         f"or 'all' / 'attention'")
    if len(set(names)) != len(names):
        raise ValueError(f"a LoRA target is named twice in {targets!r}")
    return tuple(names)


def is_peft_model(model) -> bool:
    """Whether `model` is a peft model (peft is not imported to find out: no peft loaded, no peft model)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(parameters that require grad, all parameters), counted in elements."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def apply_lora(model: nn.Module, r: int, alpha: float | None = None, dropout: float = 0.0,
               targets: str | list = "all") -> nn.Module:
    """Wrap `model` in a peft LoRA model: adapters of rank r on `targets`, everything else frozen.

    alpha: the scale numerator (the update is scaled by alpha / r); default 2 r.
    dropout: dropout on the adapters' input, in [0, 1).
    Returns the peft model (a PeftModelForCausalLM); `model` itself is modified in place (its
    projections are wrapped), so use the returned model from here on.
    """
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r must be an integer >= 1, got {r!r}")
    if alpha is None:
        alpha = 2 * r
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or alpha == float("inf"):
        raise ValueError(f"LoRA alpha must be a finite number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    names = parse_targets(targets)
    peft = _peft()
    if is_peft_model(model):
        raise ValueError("the model already has LoRA adapters (it is a peft model): apply_lora once")
    found = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"this {type(model).__name__} has no nn.Linear module named {', '.join(missing)}; "
                         f"its linear layers are {', '.join(sorted(found)) or 'none'}")
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=list(names),
                             bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)  # freezes every base parameter
    trainable, total = trainable_parameters(model)
    _log(f"LoRA r={r} alpha={alpha:g} dropout={dropout:g} on {', '.join(names)}: trainable parameters "
         f"{trainable:,} of {total:,} ({100 * trainable / total:.2f}%)")
    return model


def _require_peft_model(model, what: str) -> None:
    if not is_peft_model(model):
        raise ValueError(f"{what} needs a LoRA model (the result of apply_lora), got {type(model).__name__}")


def _refuse_sharded(model, what: str) -> None:
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise RuntimeError(f"{what}: the parameters are sharded (FSDP2); save the adapter with save_checkpoint "
                           "and merge it on one process (load the base model, load_adapter, merge_and_save)")


def save_adapter(model: nn.Module, directory) -> Path:
    """Write the adapter (adapter_model.safetensors + adapter_config.json) into `directory`, atomically."""
    _require_peft_model(model, "save_adapter")
    _refuse_sharded(model, "save_adapter")
    from playbook.checkpoint import atomic_directory

    with atomic_directory(directory) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
    return Path(directory)


def load_adapter(model: nn.Module, directory, trainable: bool = False) -> nn.Module:
    """A base model plus the adapter saved in `directory` (by save_adapter or save_checkpoint)."""
    peft = _peft()
    directory = Path(directory)
    if not (directory / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{directory}: no adapter_config.json (not an adapter directory)")
    if is_peft_model(model):
        raise ValueError("load_adapter takes the base model; this one already has adapters")
    return peft.PeftModel.from_pretrained(model, str(directory), is_trainable=trainable)


def merge_and_save(model: nn.Module, directory, tokenizer=None) -> Path:
    """Fold the adapters into the base weights (W + alpha / r * B A) and save a plain Hugging Face
    model (safetensors) that `AutoModelForCausalLM.from_pretrained(directory)` loads without peft.

    The merge happens in place: afterwards `model` has no adapters (call this last). The merged
    weights keep the base weights' dtype. Returns the directory.
    """
    _require_peft_model(model, "merge_and_save")
    _refuse_sharded(model, "merge_and_save")
    from playbook.checkpoint import atomic_directory

    with torch.no_grad():
        merged = model.merge_and_unload()
    with atomic_directory(directory) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(directory)


# ------------------------------------------------------------------------------------------------
# The fused LoRA layer: what peft computes, without the fp32 detour and the extra copies
# ------------------------------------------------------------------------------------------------
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
    def forward(ctx, x, x_lora, weight, bias, lora_a, lora_b, scaling, dequantize=None):
        # x: [..., in]; x_lora: x after the adapter's dropout (x itself without dropout).
        # dequantize: for a 4-bit base layer, a function returning its weight in x's dtype; it is
        # called again in backward, so the dequantized weight never outlives one matmul.
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        xl2 = x2 if x_lora is x else x_lora.reshape(-1, x.shape[-1])
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        w = weight if dequantize is None else dequantize()
        y = x2 @ w.t() if bias is None else torch.addmm(bias.to(dtype), x2, w.t())
        del w
        xa = xl2 @ a.t()
        y.addmm_(xa, b.t(), alpha=scaling)
        ctx.scaling, ctx.dequantize = scaling, dequantize
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
        return dx, dxl, dw, dbias, da, db, None, None


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
    if _is_4bit(base) and getattr(base.weight, "quant_state", None) is not None:
        return active[0] if x.dtype == base.compute_dtype else None
    return None


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
    weight, dequantize = base.weight, None
    if _is_4bit(base):
        weight, dequantize = None, _dequantizer(base, x.dtype)
    return LoRALinearFunction.apply(x, x_lora, weight, base.bias, layer.lora_A[name].weight,
                                    layer.lora_B[name].weight, float(layer.scaling[name]), dequantize)


def _dequantizer(base, dtype):
    """A function returning the 4-bit layer's weight as a [out, in] tensor of `dtype`."""
    from bitsandbytes.functional import dequantize_4bit

    packed, state = base.weight.data, base.weight.quant_state
    return lambda: dequantize_4bit(packed, state).to(dtype)


def fuse_lora_layers(model: nn.Module) -> int:
    """Route every peft LoRA linear layer of `model` through `fused_lora_forward`; return how many.

    The modules, parameters and state dict stay peft's own (saving, loading and merging adapters
    are unchanged); only the forward computation is replaced. Call it after `apply_lora`.
    """
    _require_peft_model(model, "fuse_lora_layers")
    peft = _peft()
    linear = peft.tuners.lora.layer.Linear
    kinds = (linear,)
    if "bitsandbytes" in sys.modules:
        kinds += (peft.tuners.lora.bnb.Linear4bit,)
    layers = [m for m in model.modules() if type(m) in kinds]
    for m in layers:
        m.forward = types.MethodType(fused_lora_forward, m)
    # MLPs already on the fused SwiGLU forward, with an adapter on down_proj: h recomputed, not saved
    import swiglu_kernel

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
    def forward(ctx, gate, up, weight, lora_a, lora_b, scaling, dequantize=None):
        swiglu = torch.ops.playbook.swiglu_fwd
        g2, u2 = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        a, b = lora_a.to(gate.dtype), lora_b.to(gate.dtype)
        h = swiglu(g2, u2)
        y = h @ (weight if dequantize is None else dequantize()).t()
        ha = h @ a.t()
        y.addmm_(ha, b.t(), alpha=scaling)
        ctx.scaling, ctx.dtypes, ctx.shape, ctx.dequantize = scaling, (lora_a.dtype, lora_b.dtype), gate.shape, dequantize
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
            dh = dy2 @ (weight if ctx.dequantize is None else ctx.dequantize())  # 4 bits: unpacked only here
            dh.addmm_(dyb, a, alpha=s)
            dg, du = torch.ops.playbook.swiglu_bwd(dh, g2, u2)
            dg, du = dg.view(ctx.shape), du.view(ctx.shape)
        return dg, du, dw, da, db, None, None


def swiglu_lora_mlp_forward(mlp, x):
    """The fused SwiGLU MLP whose down_proj carries a LoRA adapter: h is not kept for backward.
    Anything `fused_lora_forward` would not fuse (dropout, a bias, ...) goes the general way."""
    import swiglu_kernel

    down = mlp.down_proj
    g, u = mlp.gate_proj(x), mlp.up_proj(x)
    name = _fusable(down, g, (), {})
    if name is None or down.base_layer.bias is not None or not isinstance(down.lora_dropout[name], nn.Identity):
        return down(swiglu_kernel.swiglu(g, u))
    base = down.base_layer
    weight, dequantize = (None, _dequantizer(base, g.dtype)) if _is_4bit(base) else (base.weight, None)
    return SwiGLUDownLoRAFunction.apply(g, u, weight, down.lora_A[name].weight, down.lora_B[name].weight,
                                        float(down.scaling[name]), dequantize)


# ------------------------------------------------------------------------------------------------
# QLoRA: the frozen base projections in 4 bits (NF4, bitsandbytes)
# ------------------------------------------------------------------------------------------------
def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError:
        raise RuntimeError("--load-in-4bit needs the bitsandbytes package: pip install bitsandbytes") from None
    return bitsandbytes


def quantize_4bit(model: nn.Module, targets: str | list = "all") -> int:
    """Replace the decoder's target projections (nn.Linear) by bitsandbytes NF4 `Linear4bit` layers
    with the model's dtype as compute dtype; return how many. Call before `apply_lora`.

    The weights are quantized where they are: on a GPU at once; on a CPU bitsandbytes' own CPU path
    is used (tests). 8.03 B bf16 parameters take 16 GB; their seven projections in NF4 take ~3.5 GB
    (0.5 byte per weight plus one scale per 64 weights). Embeddings, norms and lm_head stay as they are.
    """
    bnb = _bitsandbytes()
    names = parse_targets(targets)
    todo = [(parent, attr, child) for parent in model.modules() for attr, child in parent.named_children()
            if attr in names and type(child) is nn.Linear]
    if not todo:
        raise ValueError(f"{type(model).__name__} has no nn.Linear projection named {', '.join(names)} to quantize")
    for parent, attr, child in todo:
        dtype = child.weight.dtype
        q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                              compute_dtype=dtype, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu") if child.weight.device.type == "cpu"
                                     else child.weight.data, requires_grad=False, quant_type="nf4")
        if child.bias is not None:
            q.bias = nn.Parameter(child.bias.data, requires_grad=False)
        q = q.to(child.weight.device)  # Params4bit quantizes when it is moved to its device
        setattr(parent, attr, q)
    return len(todo)


def lora_from_config(model: nn.Module, cfg, fuse: bool) -> nn.Module:
    """What the scripts do with --lora-r / --load-in-4bit: quantize (QLoRA), add the adapters, and
    with fuse=True (this project's kernels are on) route them through the fused path."""
    if cfg.load_in_4bit:
        _log(f"QLoRA: {quantize_4bit(model, cfg.lora_targets)} projections quantized to NF4 (bitsandbytes)")
    model = apply_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=cfg.lora_targets)
    if fuse:
        _log(f"LoRA layers on the fused path (adapter matmuls in the model's dtype, no fp32 input copies): "
             f"{fuse_lora_layers(model)}")
    return model
