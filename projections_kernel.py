"""Joined projections: q, k and v as one matmul, gate and up as one matmul, with the same Parameters.

    y_q, y_k, y_v = x Wq^T, x Wk^T, x Wv^T      ->   [y_q | y_k | y_v] = x [Wq; Wk; Wv]^T
    y_g, y_u      = x Wg^T, x Wu^T              ->   [y_g | y_u]       = x [Wg; Wu]^T

What you build here: no new Triton kernel, but fewer and larger launches of the kernels that exist.
The weights of a group are moved, once, into one buffer, side by side (the Parameters stay the same
objects under the same names, so optimizers, state dicts and checkpoints see nothing new); every
forward then reads them as one [sum of outputs, in] matrix without a copy, and one matmul computes
the whole group.
What you learn: where a decoder layer spends launches and memory passes that no element-wise kernel
can remove, and how autograd's bookkeeping (one gradient per use of a tensor) costs real adds.

Why join, counted per decoder layer of LLaMA 3.1 8B at 8192 tokens (hidden 4096, MLP 14336)
------------------------------------------------------------------------------------------
x feeds three projections in attention and two in the MLP. Autograd sums the gradients flowing back
into x: dx = dy_q Wq + dy_k Wk + dy_v Wv is three matmuls and *two adds* of an [8192, 4096] bf16
tensor (read 2 x 64 MB, write 64 MB each: ~46 us each on an H200), and gate/up add one more. Joined,
dx is one matmul over the joined output gradient: no adds. What joining costs in backward is
assembling that gradient: autograd's split backward writes [dy_q | dy_k | dy_v] into one tensor
(read and write 8192 x 6144 x 2 bytes, ~200 MB, ~45 us); the MLP needs no such copy, because the
fused SwiGLU's backward (swiglu_kernel.py, `swiglu_down_joined`) writes d gate and d up straight
into the two halves of one [8192, 28672] gradient. Per layer and step that is 3 adds less and one
copy more: ~90 us, ~3 ms for 32 layers.

The other gain is launches. k and v are narrow (1024 outputs): their matmuls are short enough that
the host, which launches them, can fall behind the GPU; FP8 (fp8_linear_kernel.py) makes every
matmul half as long and adds quantizing kernels around each one, so the FP8 step is host-bound.
Joined, a layer calls 4 linear layers instead of 7, forward and backward; under --fp8 each of the
three saved calls is ~8 launches (quantizations, column maxima, matmuls), so ~770 fewer launches
per step at 32 layers.

And memory: under --fp8 a joined group has one consumer of its input, so it keeps only the FP8 copy
of x for backward (1 byte per element instead of bf16's 2): 32 MB less per group and layer.

How it works without rewriting Hugging Face's attention
-------------------------------------------------------
The MLP's forward is ours already (swiglu_kernel.swiglu_mlp_forward): it asks `joined_output` for
[gate | up] in one matmul. Attention's forward is the family's own, which calls q_proj(x), k_proj(x)
and v_proj(x) in turn. So q_proj's call computes all three and holds k's and v's outputs for the next
two calls with *the same tensor* x (the same object, its version counter unchanged, the weights'
too); any other call computes its own projection as before. The group joins only what it can do
exactly: plain nn.Linear or Float8Linear layers of one type, one dtype and device, weights still side
by side (`model.to(...)` after patching moves each weight alone, and FSDP2 gathers each weight into a
buffer of its own: the group then runs as separate matmuls again, and says so once), and not while
torch.compile traces. An adapter wrapped around a
projection (LoRA) calls the joined layer inside it, which stays exact.

    >>> import projections_kernel
    >>> projections_kernel.patch_model(model)          # 2 groups per decoder layer
    64

Layout of this file: placing weights side by side -> the joined weight's autograd.Function -> the
joined linear layer -> the attention group -> `patch_model` -> reference.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from core.model_families import family_classes, model_type

GROUPS = {"Attention": ("q_proj", "k_proj", "v_proj"), "MLP": ("gate_proj", "up_proj")}


# ------------------------------------------------------------------------------------------------
# Weights side by side
# ------------------------------------------------------------------------------------------------
def _stackable(weights) -> bool:
    """2-D, one dtype, one device, one row length: rows that one [sum of rows, in] matrix can hold."""
    first = weights[0]
    return all(w.dim() == 2 and w.dtype == first.dtype and w.device == first.device and w.shape[1] == first.shape[1]
               for w in weights)


def side_by_side(weights) -> bool:
    """True when the weights are contiguous row blocks of one storage, in order, with one dtype and
    row length: then they are one [sum of rows, in] matrix, readable without a copy."""
    if any(type(w.data) is not torch.Tensor for w in weights):  # a DTensor (FSDP2 shard), a subclass
        return False
    if not _stackable(weights) or not all(w.is_contiguous() for w in weights):
        return False
    ptr = weights[0].untyped_storage().data_ptr()
    offset = weights[0].storage_offset()
    for w in weights:
        if w.untyped_storage().data_ptr() != ptr or w.storage_offset() != offset:
            return False
        offset += w.numel()
    return True


def place_side_by_side(modules) -> None:
    """Move the modules' weights into one buffer, in order. The Parameters stay the same objects
    (only their `.data` moves), so an optimizer made before still updates them."""
    weights = [m.weight for m in modules]
    if side_by_side(weights):
        return
    if not _stackable(weights):
        raise NotImplementedError("the projections of a group differ in dtype, device or input size")
    first = weights[0]
    buffer = torch.empty((sum(w.shape[0] for w in weights), first.shape[1]), dtype=first.dtype, device=first.device)
    row = 0
    with torch.no_grad():
        for w in weights:
            part = buffer[row: row + w.shape[0]]
            part.copy_(w)
            w.data = part
            row += w.shape[0]


class _JoinedWeight(torch.autograd.Function):
    """Weights side by side -> the [sum of rows, in] matrix they form (a view, no copy); its gradient
    goes back to each weight as the matching rows (views of the joined gradient, no copy)."""

    @staticmethod
    def forward(ctx, *weights):
        ctx.rows = [w.shape[0] for w in weights]
        first = weights[0]
        return torch.as_strided(first, (sum(ctx.rows), first.shape[1]), (first.shape[1], 1), first.storage_offset())

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.split(ctx.rows, dim=0))


# ------------------------------------------------------------------------------------------------
# The joined linear layer
# ------------------------------------------------------------------------------------------------
def _joinable(kind: type) -> bool:
    """A plain nn.Linear, or a linear layer type that says how a group of its layers runs as one
    (`kind.joined_linear(x, weight, bias, members)`: fp8_linear_kernel.Float8Linear). This file does
    not import the layer types it joins."""
    return kind is nn.Linear or callable(getattr(kind, "joined_linear", None))


def why_not_joined(modules) -> str | None:
    """Why these linear layers cannot run as one matmul now, or None when they can."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing (the compiled graph runs the projections as written)"
    kinds = {type(m) for m in modules}
    if len(kinds) != 1 or not _joinable(kinds.pop()):
        return "the projections are not all plain nn.Linear (or all Float8Linear) layers"
    if len({m.bias is None for m in modules}) != 1:
        return "some projections have a bias and some do not"
    if not side_by_side([m.weight for m in modules]):
        return ("the weights are not side by side in memory (moved or cast after patching, or gathered one by one "
                "by FSDP2)")
    return None


def joined_linear(x: torch.Tensor, modules) -> torch.Tensor:
    """[m(x) for m in modules] as one [..., sum of out_features] tensor, computed by one matmul (the
    caller has checked `why_not_joined`). FP8 layers run as one FP8 layer that keeps only the FP8 copy
    of x for backward: the group is x's one consumer; it shares the layers' FP8 hand-off."""
    weight = _JoinedWeight.apply(*[m.weight for m in modules])
    bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
    if type(modules[0]) is nn.Linear:
        return F.linear(x, weight, bias)
    return type(modules[0]).joined_linear(x, weight, bias, modules)


def joined_matmul(x: torch.Tensor, weights, bias: torch.Tensor | None = None) -> tuple:
    """(x W_1^T, x W_2^T, ...) by one matmul, for weights side by side in memory (`place_side_by_side`);
    the functional form of a joined group (benchmark_kernels.py times it against separate matmuls)."""
    if not side_by_side(list(weights)):
        raise ValueError("the weights must be side by side in one buffer (place_side_by_side), with one dtype, "
                         "device and row length")
    if x.shape[-1] != weights[0].shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weights take {weights[0].shape[1]}")
    y = F.linear(x, _JoinedWeight.apply(*weights), bias)
    return y.split([w.shape[0] for w in weights], dim=-1)


def separate_matmuls(x: torch.Tensor, weights, bias: torch.Tensor | None = None) -> tuple:
    """The same as `joined_matmul`, one matmul per weight (what an unpatched model runs)."""
    biases = [None] * len(weights) if bias is None else bias.split([w.shape[0] for w in weights])
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))


_told = set()


def _tell_once(why: str) -> None:
    if why not in _told and not why.startswith("torch.compile"):
        from core.process import log

        _told.add(why)
        log(f"projections: running q/k/v and gate/up as separate matmuls: {why}")


def joined_output(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """[gate_proj(x) | up_proj(x)] by one matmul when `patch_model` joined this MLP and it still can;
    None otherwise (the caller then runs the two projections)."""
    names = getattr(mlp, "joined_names", None)
    if names is None:
        return None
    modules = [getattr(mlp, n) for n in names]
    why = why_not_joined(modules)
    if why is not None:
        if isinstance(modules[0], nn.Linear):  # an adapter wrapper is expected, not worth a message
            _tell_once(why)
        return None
    return joined_linear(x, modules)


# ------------------------------------------------------------------------------------------------
# The attention group: q_proj computes q, k and v; k_proj and v_proj hand theirs back
# ------------------------------------------------------------------------------------------------
class _Group:
    """The q/k/v layers of one attention module and the outputs waiting for k_proj's and v_proj's call."""

    def __init__(self, members: tuple):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.waiting = None  # (x, versions, {member: output})

    def versions(self, x: torch.Tensor) -> tuple:
        return (x._version, *(m.weight._version for m in self.members))


def _member_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    group = linear.joined_group
    if linear is group.members[0]:
        group.waiting = None
        why = why_not_joined(group.members)
        if why is None:
            q, *others = joined_linear(x, group.members).split(group.sizes, dim=-1)
            # k and v as copies of their own: a view would keep the whole joined output alive as long as
            # attention keeps v for backward (the pre-RoPE q and k too, in every layer), which costs far more
            # than the 2 x 16 MB copied per layer (LLaMA 3.1 8B at 8192 tokens).
            others = [t.contiguous() for t in others]
            group.waiting = (x, group.versions(x), dict(zip(group.members[1:], others)))
            return q
        _tell_once(why)
    elif group.waiting is not None and group.waiting[0] is x and group.waiting[1] == group.versions(x):
        out = group.waiting[2].pop(linear, None)
        if not group.waiting[2]:
            group.waiting = None  # both handed back: x is not held any longer
        if out is not None:
            return out
    return type(linear).forward(linear, x)


def _install(attention: nn.Module, members: tuple) -> None:
    if len({type(m) for m in members}) == 1 and _joinable(type(members[0])):
        group = _Group(members)
        for m in members:
            m.joined_group = group
            m.forward = types.MethodType(_member_forward, m)
    attention.joined_members = members


def _rejoin(attention: nn.Module) -> bool:
    """Join the attention's current q/k/v layers if they are not the ones joined; True when it did."""
    members = tuple(getattr(attention, n) for n in attention.joined_names)
    if members == attention.joined_members:
        return False
    _install(attention, members)
    return True


def joined_attention_forward(attention: nn.Module, *args, **kwargs):
    """The family's attention forward, with its q/k/v layers joined. Layers swapped after patching
    (FP8 conversion makes new Float8Linear modules around the same weights) are joined again here."""
    _rejoin(attention)
    return type(attention).forward(attention, *args, **kwargs)


# ------------------------------------------------------------------------------------------------
# Patching a model
# ------------------------------------------------------------------------------------------------
def _groups(model: nn.Module):
    """(owner module, names) of every q/k/v and gate/up group, found by class (LlamaAttention, ...)."""
    kind = model_type(model)
    for suffix, names in GROUPS.items():
        classes = family_classes(suffix, kind)
        for module in model.modules():
            if isinstance(module, classes) and all(hasattr(module, n) for n in names):
                yield module, names


def patch_model(model: nn.Module) -> int:
    """Join the q/k/v layers of every attention module and the gate/up layers of every MLP; return how
    many groups. Raises NotImplementedError, before changing anything, for a model whose projections
    are joined already (Phi-3's qkv_proj and gate_up_proj) or are not linear layers (a 4-bit layer).
    The gate/up join is used by the fused SwiGLU MLP (kernel `swiglu`); patching twice changes nothing.
    """
    groups = list(_groups(model))
    if not groups:
        raise NotImplementedError("this model has no separate q/k/v or gate/up projections to join (already "
                                  "joined, as Phi-3's qkv_proj and gate_up_proj are)")
    for owner, names in groups:
        kinds = {type(getattr(owner, n)) for n in names}
        if not all(_joinable(k) for k in kinds):
            raise NotImplementedError(f"{'/'.join(names)} are {', '.join(sorted(k.__name__ for k in kinds))}, "
                                      "not nn.Linear layers")
    for owner, names in groups:
        modules = [getattr(owner, n) for n in names]
        place_side_by_side(modules)
        owner.joined_names = names
        if "q_proj" in names and getattr(owner.forward, "__func__", None) is not joined_attention_forward:
            owner.joined_members = None
            owner.forward = types.MethodType(joined_attention_forward, owner)
    join_now(model)
    return len(groups)


def join_now(model: nn.Module) -> int:
    """Join each patched attention's current q/k/v layers now instead of at its next call; return how many
    were (re)joined. `patch_model` calls it; call it again after the layers were swapped (FP8 conversion,
    peft adapters) and before torch.compile traces the model: a join made inside the compiled forward would
    change what its guards saw, and the next step would recompile (inside a CUDA-graph capture, which
    fails: a compilation synchronizes the GPU)."""
    return sum(_rejoin(m) for m in model.modules() if getattr(m.forward, "__func__", None) is joined_attention_forward)


def expected_patches(config) -> int:
    """Two groups per decoder layer: q/k/v and gate/up (none in Phi-3, whose are joined already)."""
    return 2 * config.num_hidden_layers


def _sizes(outputs: str) -> list:
    return [int(n) for n in str(outputs).split("+")]


def flops(n_tokens: int, hidden: int, outputs: str, backward: bool = True) -> int:
    """2 N H O for the forward (O = the group's outputs, "4096+1024+1024"), 3x that with backward (dx, dW)."""
    return 2 * n_tokens * hidden * sum(_sizes(outputs)) * (3 if backward else 1)


def ideal_bytes(n_tokens: int, hidden: int, outputs: str, dtype: torch.dtype, backward: bool = False) -> int:
    """Forward: read x and the weights, write the outputs. Backward: read the output gradients, x and
    the weights again; write dx and dW. (A matmul-bound group: benchmark_kernels.py uses `flops`.)"""
    e = torch.empty(0, dtype=dtype).element_size()
    N, H, O = n_tokens, hidden, sum(_sizes(outputs))
    fwd = (N * H + O * H + N * O) * e
    return fwd + ((N * O + N * H + O * H) + (N * H + O * H)) * e if backward else fwd


def joined_ref(x: torch.Tensor, modules) -> torch.Tensor:
    """The reference: each layer alone, outputs concatenated."""
    return torch.cat([F.linear(x, m.weight, m.bias) for m in modules], dim=-1)
