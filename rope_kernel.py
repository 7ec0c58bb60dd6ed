"""Rotary position embedding (RoPE) in Triton: queries and keys rotated in one pass, and back.

    q_embed = q * cos + rotate_half(q) * sin,   rotate_half([x1, x2]) = [-x2, x1]
    i.e. per pair of halves:  y1 = x1 * cos1 - x2 * sin1,   y2 = x2 * cos2 + x1 * sin2

What you build here: a drop-in for Hugging Face's `apply_rotary_pos_emb(q, k, cos, sin)` that
rotates all query heads and all key heads of one token in one program, forward and backward.
What you learn: a kernel over a 4-D tensor addressed through its strides (HF hands over
`[batch, heads, seq, head_dim]` *views* of `[batch, seq, heads, head_dim]` memory; no copies),
one program serving several outputs (Q and K share a token's cos/sin, loaded once), and a backward
that is the same rotation transposed (the angle negated), so one kernel serves both directions.

Count the bytes before timing anything
--------------------------------------
LLaMA 3.1 8B: 32 query heads, 8 key/value heads, head_dim 128. Per token and layer, Q and K hold
(32 + 8) x 128 = 5120 values. Hugging Face's formula runs, per tensor, `q * cos`, `rotate_half(q)`
(two slices, a negation and a concatenation), `* sin` and `+`: about 7 passes over Q and K forward,
and autograd keeps `rotate_half(q)` and `rotate_half(k)` alive until backward: 5120 x 2 B = 10 KB
per token and layer, 2.7 GB for 32 layers at 8192 tokens. The fused kernel reads Q, K and one
cos/sin row and writes the two outputs: 4 bytes per value in bf16, and it saves nothing but cos
and sin (which every layer shares). Counting the cos/sin rows too (HF computes them per sequence
and casts them to the activations' dtype, so each token reads 2 x 128 values of its own) gives
`ideal_bytes(n_tokens, n_heads, n_kv_heads, head_dim, dtype, backward)`. Floor at 8192 tokens,
one layer, on an H200 (~4.25 TB/s):
    forward            ideal_bytes(8192, 32, 8, 128, bf16)                = 171,966,464 B -> 40 us
    forward + backward ideal_bytes(8192, 32, 8, 128, bf16, backward=True) = 343,932,928 B -> 81 us

LLaMA 3.1's rope scaling (low frequencies stretched by 8, a smooth ramp between) changes only the
angles, i.e. the `cos` and `sin` tables that the model's rotary-embedding module computes once per
step; the kernel takes those tables as they are, so every scaling scheme and any position ids
(packed sequences, offsets) work unchanged.

Layout of this file: kernel -> launcher -> custom ops (PyTorch operators, with their autograd) ->
functional API -> the HF drop-in and `patch_model` / `unpatch_model` -> reference.
"""

import torch

from core import kernel_utils
from core.kernel_utils import check_device, check_float, next_power_of_2, refuse_double_backward
from core.model_families import family_module, model_type

import triton
import triton.language as tl

# One program holds one token's [heads, head_dim / 2] tile of Q (and K) in registers: up to 2^16
# values (LLaMA 3.1 405B: 128 heads x 64 = 8192). Past that it would spill, or fail to compile.
MAX_HEAD_TILE = 65536


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(X, Y, x_off, y_off, sx_h, sy_h, n_heads, tmask, c1, c2, a, b,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """y1 = x1 * c1 + x2 * a,  y2 = x2 * c2 + x1 * b, for every head of a block of tokens.

    Tiles are [tokens, heads, half of head_dim]; x_off / y_off hold each token's offset."""
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = tmask & (heads < n_heads) & (d < HALF)
    px = X + x_off + heads * sx_h + d
    py = Y + y_off + heads * sy_h + d
    x1 = tl.load(px, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(px + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1 + x2 * a
    y2 = x2 * c2 + x1 * b
    tl.store(py, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(py + HALF, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO,  # inputs and outputs, [B, heads, T, head_dim], unit stride along head_dim
    Cos, Sin,  # [B or 1, T, head_dim], unit stride along head_dim
    n_tokens, T,  # B * T, sequence length
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,  # strides of Q and K (elements)
    sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,  # strides of the outputs
    sc_b, sc_t,  # strides of cos/sin (sc_b = 0 when one table serves the whole batch)
    HQ, HK,  # query heads, key heads
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,  # apply the transposed rotation (the gradient)
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]  # int64 offsets
    tmask = tok < n_tokens
    bi = tok // T
    ti = tok % T
    d = tl.arange(0, BLOCK_D)[None, None, :]
    cmask = tmask & (d < HALF)
    c_off = bi * sc_b + ti * sc_t
    c1 = tl.load(Cos + c_off + d, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + c_off + HALF + d, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + c_off + d, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + c_off + HALF + d, mask=cmask, other=0.0).to(tl.float32)
    if BACKWARD:
        # Transpose of [[c1, -s1], [s2, c2]]: dx1 = g1 * c1 + g2 * s2, dx2 = g2 * c2 - g1 * s1
        a = s2
        b = -s1
    else:
        a = -s1
        b = s2
    _rotate_heads(Q, QO, bi * sq_b + ti * sq_t, bi * sqo_b + ti * sqo_t, sq_h, sqo_h, HQ, tmask, c1, c2, a, b,
                  HALF, BLOCK_HQ, BLOCK_D)
    _rotate_heads(K, KO, bi * sk_b + ti * sk_t, bi * sko_b + ti * sko_t, sk_h, sko_h, HK, tmask, c1, c2, a, b,
                  HALF, BLOCK_HK, BLOCK_D)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _empty_outputs(q: torch.Tensor, k: torch.Tensor):
    """Outputs in the inputs' memory layout: empty_like keeps the strides of a dense tensor (HF's
    [B, heads, T, D] views of [B, T, heads, D] memory stay so) and makes any other one contiguous.
    Either way the last dimension has unit stride, as the kernel needs."""
    return torch.empty_like(_unit_last(q)), torch.empty_like(_unit_last(k))


def rope_launch(q, k, cos, sin, backward: bool):
    """q [B, HQ, T, D], k [B, HK, T, D], cos/sin [B or 1, T, D] -> rotated (new) q, k."""
    q, k, cos, sin = _unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin)
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    qo, ko = _empty_outputs(q, k)
    if B * T == 0:
        return qo, ko
    if sin.stride() != cos.stride():  # one set of strides addresses both tables
        cos, sin = cos.contiguous(), sin.contiguous()
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    half = D // 2
    block_hq, block_hk, block_d = next_power_of_2(HQ), next_power_of_2(HK), next_power_of_2(half)
    n_tokens = B * T
    # One token per program on a GPU (LLaMA: 32 x 64 query pairs, 16 values per thread at 4 warps);
    # the interpreter pays per program, not per element, so there a program takes up to 64 tokens.
    block_t = min(64, next_power_of_2(n_tokens)) if kernel_utils.INTERPRET else 1
    num_warps = 4 if block_hq * block_d >= 2048 else 2
    _rope_kernel[(triton.cdiv(n_tokens, block_t),)](
        q, k, qo, ko, cos, sin, n_tokens, T,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        sc_b, cos.stride(1), HQ, HK,
        HALF=half, BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
        BACKWARD=backward, num_warps=num_warps,
    )
    return qo, ko


def _check_inputs(q, k, cos, sin):
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    check_device(q, k, cos, sin)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"expected q and k as [batch, heads, seq, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, _, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, seq and head_dim")
    if D % 2:
        raise ValueError(f"head_dim must be even to rotate pairs of halves, got {D}")
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    tile = next_power_of_2(max(q.shape[1], k.shape[1])) * next_power_of_2(D // 2)
    if tile > MAX_HEAD_TILE:
        raise ValueError(f"{max(q.shape[1], k.shape[1])} heads x head_dim {D} is past what one program holds "
                         f"(heads and head_dim / 2, each rounded up to a power of 2, multiply to {tile} > "
                         f"{MAX_HEAD_TILE})")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B):
        raise ValueError(f"cos and sin must be [batch or 1, seq={T}, head_dim={D}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise NotImplementedError("the fused RoPE does not differentiate through cos/sin (they are fixed "
                                  "tables in LLaMA); use Hugging Face's apply_rotary_pos_emb for learned angles")


# ------------------------------------------------------------------------------------------------
# Custom ops: what torch.compile, opcheck and FSDP see
# ------------------------------------------------------------------------------------------------
# The launcher becomes two PyTorch operators, `torch.ops.playbook.rope_fwd` and `..._bwd` (the
# same kernel, the rotation and its transpose): one opaque node each to torch.compile, so Dynamo
# never traces into the Triton launch code. `register_fake` gives the compiler the outputs' shapes
# and strides without running anything; `register_autograd` ties the forward to the backward.
@torch.library.custom_op("playbook::rope_fwd", mutates_args=())
def rope_fwd_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_launch(q, k, cos, sin, backward=False)


@torch.library.custom_op("playbook::rope_bwd", mutates_args=())
def rope_bwd_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_launch(dq, dk, cos, sin, backward=True)


@rope_fwd_op.register_fake
def _(q, k, cos, sin):
    return _empty_outputs(q, k)


@rope_bwd_op.register_fake
def _(dq, dk, cos, sin):
    return _empty_outputs(dq, dk)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[2:])  # cos and sin: shared by all layers, no memory of their own


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_bwd_op(dq, dk, cos, sin)
    return dq, dk, None, None


rope_fwd_op.register_autograd(_backward, setup_context=_setup_context)
refuse_double_backward(rope_bwd_op, "rope")


# ------------------------------------------------------------------------------------------------
# Functional API, the Hugging Face drop-in, patching a model
# ------------------------------------------------------------------------------------------------
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [B, HQ, T, D] and k [B, HK, T, D] by the angles in cos/sin [B or 1, T, D].

    Differentiable once, in q and k (cos and sin are fixed tables)."""
    _check_inputs(q, k, cos, sin)
    return rope_fwd_op(q, k, cos, sin)


def _rotate(q, k, cos, sin):
    """q [B, HQ, T, D], k [B, HK, T, D] rotated by cos/sin [B or 1, T, R]: all of each head when
    R = D; with R < D (partial rotary) the first R dimensions rotate and the rest pass through."""
    rotary = cos.shape[-1]
    if cos.dim() == 3 and q.dim() == 4 and rotary < q.shape[-1]:
        q_rot, k_rot = rope(q[..., :rotary], k[..., :rotary], cos, sin)  # strided views, read in place
        return torch.cat([q_rot, q[..., rotary:]], dim=-1), torch.cat([k_rot, k[..., rotary:]], dim=-1)
    return rope(q, k, cos, sin)


def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim: int = 1, **kwargs):
    """Drop-in for transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`.

    Older releases had a `position_ids` argument before `unsqueeze_dim` (unused: cos/sin are
    already per position); a trailing int positional argument is read as `unsqueeze_dim`.
    Partial rotary, as in Phi-3's version of the function (`partial_rotary_factor < 1`, e.g.
    Phi-4-mini): when cos/sin are narrower than head_dim, only the first cos.shape[-1] dimensions
    of each head rotate and the others pass through unchanged (one concatenation, as in HF).
    """
    if args and isinstance(args[-1], int):
        unsqueeze_dim = args[-1]
    if unsqueeze_dim == 2:  # [B, T, heads, D] layout: rotate the [B, heads, T, D] views
        qo, ko = _rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return qo.transpose(1, 2), ko.transpose(1, 2)
    if unsqueeze_dim != 1:
        raise ValueError(f"unsqueeze_dim must be 1 ([B, heads, T, D]) or 2 ([B, T, heads, D]), got {unsqueeze_dim}")
    return _rotate(q, k, cos, sin)


_ORIGINALS = {}  # model_type -> the family's own apply_rotary_pos_emb, while it is patched


def patch_model(model) -> int:
    """Replace the model family's module-level `apply_rotary_pos_emb` with the fused drop-in.

    This is process-global: every model of that family (say, all LLaMA models) uses the fused RoPE
    afterwards; `unpatch_model` puts the original back. Patching twice keeps the first original
    and does not wrap twice. Returns 1, the number of functions replaced.
    """
    kind = model_type(model)
    family = family_module(kind)
    current = getattr(family, "apply_rotary_pos_emb", None)
    if current is None:
        raise NotImplementedError(f"transformers' {kind} module has no apply_rotary_pos_emb to replace")
    if current is not apply_rotary_pos_emb:
        _ORIGINALS[kind] = current
        family.apply_rotary_pos_emb = apply_rotary_pos_emb
    return 1


def unpatch_model(model_or_type) -> int:
    """Put the family's original `apply_rotary_pos_emb` back; return 1, or 0 if it was not patched.

    Takes a model or its model_type string ("llama")."""
    kind = model_or_type if isinstance(model_or_type, str) else model_type(model_or_type)
    original = _ORIGINALS.pop(kind, None)
    if original is None:
        return 0
    family_module(kind).apply_rotary_pos_emb = original
    return 1


def expected_patches(config) -> int:
    """One module-level function per family."""
    return 1


def ideal_bytes(n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                backward: bool = False) -> int:
    """The fewest bytes the fused RoPE can move for `n_tokens` tokens of `dtype` activations.

    Forward reads each token's query and key heads and its cos and sin rows, and writes the rotated
    heads; `backward=True` adds the backward pass, which moves the same for the gradients.
    """
    per_token = (2 * (n_heads + n_kv_heads) * head_dim + 2 * head_dim) * dtype.itemsize
    return per_token * n_tokens * (2 if backward else 1)


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------
def rotate_half_ref(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(q, k, cos, sin):
    """Hugging Face's formula (cos/sin broadcast over the heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half_ref(q) * sin, k * cos + rotate_half_ref(k) * sin
