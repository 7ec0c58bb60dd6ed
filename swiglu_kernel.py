"""Fused SwiGLU in Triton: `silu(gate) * up`, forward and backward, one pass each; and GeGLU.

    h = silu(g) * u,  silu(g) = g * sigmoid(g)
    dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),   du = dh * silu(g)

What you build here: the activation of LLaMA's MLP, `down_proj(silu(gate_proj(x)) * up_proj(x))`,
as one forward kernel and one backward kernel, saving only the two inputs for backward.
What you learn: an element-wise kernel over rows with strides, and *recomputation*: the backward
re-derives sigmoid(g) from g (cheap arithmetic) instead of storing it (expensive memory).

The same kernels serve Gemma's MLP, whose activation is GELU's tanh approximation (GeGLU,
`activation="gelu_tanh"`, Hugging Face's "gelu_pytorch_tanh"):

    gelu_tanh(g) = g/2 * (1 + tanh(z)),  z = sqrt(2/pi) * (g + 0.044715 g^3)
                 = g * sigmoid(2z)                      (since (1 + tanh(z)) / 2 = sigmoid(2z))
    d/dg gelu_tanh(g) = s + g * s * (1 - s) * 2 sqrt(2/pi) * (1 + 3 * 0.044715 g^2),  s = sigmoid(2z)
                      (with 1 - s = sigmoid(-2z), which keeps its precision where s is near 1)

The activation is a `tl.constexpr`: each one compiles to its own binary, so SwiGLU's binary holds no
GeGLU code. The byte counts below are the same for both.

Count the bytes before timing anything
--------------------------------------
For N tokens and the MLP width I = 14336, in bf16, PyTorch runs:

    a = F.silu(g)           # read 2, write 2 bytes per element (a is kept for the multiply's backward)
    h = a * u               # read 4, write 2
    backward: du = dh * a   # read 4, write 2
              da = dh * u   # read 4, write 2
              dg = silu'(g) * da   # read 4, write 2
                                   # forward 10, backward 18 bytes per element, and the extra
                                   # activation `a` (N x I x 2 B: 235 MB per layer at 8192 tokens,
                                   # 7.5 GB for 32 layers) lives from forward to backward

The fused kernels move 6 bytes per element forward (read g, u; write h) and 10 backward (read dh,
g, u; write dg, du), and keep nothing but g and u, which the matmuls need anyway:
`ideal_bytes(n_rows, width, dtype, backward)`. Floor at 8192 tokens on an H200 (copy bandwidth
~4.25 TB/s):
    forward            ideal_bytes(8192, 14336, bf16)                =   704,643,072 B -> 166 us
    forward + backward ideal_bytes(8192, 14336, bf16, backward=True) = 1,879,048,192 B -> 442 us
The MLP path (`swiglu_down`, below) moves 6 bytes per element more in backward: it recomputes h
there instead of keeping it alive from the forward pass.

Under --fp8 the MLP's backward runs a variant of `_swiglu_bwd` that also takes the row and column
maxima of the gradient it writes, so that the FP8 gate/up projection quantizes it in one read instead
of two. That variant is FP8 code: fp8_producers_kernel.py builds its MLP forward from this file's
public pieces (`gate_and_up`, `mlp_down`, `swiglu_joined`).

Layout of this file: kernels -> launchers -> custom ops (PyTorch operators, with their autograd)
-> functional API -> the MLP drop-in and `patch_model` -> reference.
"""

import types

import torch
from torch import nn

from core import kernel_utils
from core.kernel_utils import as_rows, check_device, check_float, next_power_of_2, refuse_double_backward
from core.model_families import family_classes, mlp_activation, model_type

import triton
import triton.language as tl

BLOCK = 2048  # columns per program: 8 values per thread at 8 warps
NUM_WARPS = 8
ACTIVATIONS = ("silu", "gelu_tanh")  # act(gate) * up: SwiGLU (LLaMA, Qwen, Phi-3) and GeGLU (Gemma)
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config.hidden_act -> ours


@triton.jit
def _tile(n_rows, I, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's [ROWS, BLOCK] tile: row indices (int64: row * stride can pass 2^31, e.g.
    8192 x 14336 x 19), column indices, and the mask of the tile's in-bounds elements."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    return row, cols, (row < n_rows) & (cols < I)


@triton.jit
def _gelu_tanh_arg(g):
    """2z = 2 sqrt(2/pi) (g + 0.044715 g^3): gelu_tanh(g) = g * sigmoid(2z).
    (0.7978845608028654 is sqrt(2/pi); 0.044715 is the approximation's constant.)"""
    return 2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g)


@triton.jit
def act_out(g, u, ACT: tl.constexpr):
    """act(g) * u from fp32 g and u, in fp32 (rounded once, by the caller's store)."""
    if ACT == "gelu_tanh":
        return g * tl.sigmoid(_gelu_tanh_arg(g)) * u
    return g * tl.sigmoid(g) * u


@triton.jit
def act_grads(dh, g, u, ACT: tl.constexpr):
    """(dg, du) in fp32 from fp32 dh, g and u: the chain rule through act(g) * u."""
    if ACT == "gelu_tanh":
        t = _gelu_tanh_arg(g)
        s = tl.sigmoid(t)  # recomputed, as sigmoid(g) is for SwiGLU
        act = g * s
        # d/dg [g * sigmoid(t(g))] = s + g * s * (1 - s) * dt/dg. Where s is near 1, 1 - s computed
        # as a difference keeps only the rounding error of s; sigmoid(-t) is the same value to full
        # relative precision (one more exp, free in a memory-bound kernel).
        dact = s + g * s * tl.sigmoid(-t) * (2.0 * 0.7978845608028654) * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        sig = tl.sigmoid(g)  # recomputed: cheaper than storing silu(g) in forward and reading it here
        act = g * sig
        dact = sig * (1.0 + g * (1.0 - sig))  # d/dg [g * sigmoid(g)]
    return dh * u * dact, dh * act


@triton.jit
def _swiglu_fwd(
    G,  # pointer to the gate, [n_rows, I], unit stride along I
    U,  # pointer to up, [n_rows, I], unit stride along I
    H,  # pointer to the output, [n_rows, I], contiguous
    stride_g,  # elements between two rows of G
    stride_u,  # elements between two rows of U
    n_rows,  # rows (tokens)
    I,  # row length (the MLP width)
    ROWS: tl.constexpr,  # rows per program (1 on a GPU; more in the interpreter)
    BLOCK: tl.constexpr,  # columns per program
    ACT: tl.constexpr,  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
):
    row, cols, mask = _tile(n_rows, I, ROWS, BLOCK)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(H + row * I + cols, act_out(g, u, ACT).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    DH,  # pointer to the upstream gradient, [n_rows, I], unit stride along I
    G,  # pointer to the saved gate
    U,  # pointer to the saved up
    DG,  # pointer to the gate gradient, [n_rows, I], unit stride along I
    DU,  # pointer to the up gradient, [n_rows, I], unit stride along I
    stride_d,  # elements between two rows of DG and of DU (I, or 2I when they are halves of one buffer)
    stride_dh,  # elements between two rows of DH
    stride_g,  # elements between two rows of G
    stride_u,  # elements between two rows of U
    n_rows,  # rows (tokens)
    I,  # row length
    ROWS: tl.constexpr,  # rows per program
    BLOCK: tl.constexpr,  # columns per program
    ACT: tl.constexpr,  # "silu" or "gelu_tanh", as in the forward pass
):
    row, cols, mask = _tile(n_rows, I, ROWS, BLOCK)
    dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dg, du = act_grads(dh, g, u, ACT)
    tl.store(DU + row * stride_d + cols, du.to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + row * stride_d + cols, dg.to(DG.dtype.element_ty), mask=mask)


def _launch(n_rows: int, width: int):
    """(grid, rows per program, columns per program). On a GPU one row and 2048 columns per program.
    The interpreter pays per program and per element of the block, so there a program takes many
    rows and no more columns than the row has."""
    if kernel_utils.INTERPRET:
        block = min(BLOCK, next_power_of_2(width))
        rows = max(1, min(64, 4096 // block))
    else:
        block, rows = BLOCK, 1
    return (triton.cdiv(n_rows, rows), triton.cdiv(width, block)), rows, block


def swiglu_forward(g2: torch.Tensor, u2: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    n_rows, width = g2.shape
    h = torch.empty((n_rows, width), dtype=g2.dtype, device=g2.device)
    if h.numel():
        grid, rows, block = _launch(n_rows, width)
        _swiglu_fwd[grid](g2, u2, h, g2.stride(0), u2.stride(0), n_rows, width, ROWS=rows, BLOCK=block,
                          ACT=activation, num_warps=NUM_WARPS)
    return h


def swiglu_backward(dh2, g2, u2, activation: str = "silu", packed: bool = False):
    """(dg, du), or with `packed` one [n_rows, 2I] tensor holding dg in its first half and du in its
    second: the gradient of a joined gate/up projection's output, written in place of a copy."""
    n_rows, width = g2.shape
    if packed:
        dgu = torch.empty((n_rows, 2 * width), dtype=g2.dtype, device=g2.device)
        dg, du = dgu[:, :width], dgu[:, width:]
    else:
        dg = torch.empty((n_rows, width), dtype=g2.dtype, device=g2.device)
        du = torch.empty((n_rows, width), dtype=u2.dtype, device=u2.device)
    if dg.numel():
        grid, rows, block = _launch(n_rows, width)
        _swiglu_bwd[grid](dh2, g2, u2, dg, du, dg.stride(0), dh2.stride(0), g2.stride(0), u2.stride(0), n_rows,
                          width, ROWS=rows, BLOCK=block, ACT=activation, num_warps=NUM_WARPS)
    return dgu if packed else (dg, du)


def halves(gu2: torch.Tensor):
    """gate and up, the two halves of a joined [rows, 2I] projection output (views, no copy)."""
    width = gu2.shape[-1] // 2
    return gu2[:, :width], gu2[:, width:]


# ------------------------------------------------------------------------------------------------
# Custom ops: what torch.compile, opcheck and FSDP see
# ------------------------------------------------------------------------------------------------
# Each launcher becomes a PyTorch operator (`torch.ops.playbook.swiglu_fwd`, ...): one opaque node
# to torch.compile, so Dynamo never traces into the Triton launch code. `register_fake` gives the
# compiler the outputs' shapes without running anything; `register_autograd` ties each forward
# operator to its backward one. The operators take [rows, I] matrices with unit stride along I;
# `activation` is "silu" or "gelu_tanh".
@torch.library.custom_op("playbook::swiglu_fwd", mutates_args=())
def swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    return swiglu_forward(as_rows(gate), as_rows(up), activation)


@swiglu_fwd_op.register_fake
def _(gate, up, activation="silu"):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("playbook::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(as_rows(dh), as_rows(gate), as_rows(up), activation)


@swiglu_bwd_op.register_fake
def _(dh, gate, up, activation="silu"):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:-1])  # g and u (and the weight): the matmuls keep them alive anyway
    ctx.activation = inputs[-1]


def _swiglu_backward(ctx, dh):
    gate, up = ctx.saved_tensors
    return *swiglu_bwd_op(dh, gate, up, ctx.activation), None


swiglu_fwd_op.register_autograd(_swiglu_backward, setup_context=_save_inputs)
refuse_double_backward(swiglu_bwd_op, "swiglu")


# down_proj(silu(gate) * up) without keeping h = silu(gate) * up for backward.
#
# A plain `down_proj(swiglu(g, u))` saves h: nn.Linear keeps its input for the weight gradient.
# That is N x I x 2 bytes per layer (235 MB at 8192 tokens, 7.5 GB for LLaMA 3.1 8B's 32 layers),
# alive from the forward pass to the backward pass, while g and u, from which h follows by one
# cheap element-wise pass, are saved anyway. So these operators save g, u and the weight only and
# recompute h in backward for the weight gradient: one extra SwiGLU forward per layer (~0.1 ms
# at 8192 tokens on an H200, against ~20 ms for the layer) buys back the whole h.
@torch.library.custom_op("playbook::swiglu_down_fwd", mutates_args=())
def swiglu_down_fwd_op(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                       activation: str = "silu") -> torch.Tensor:
    """gate, up [rows, I], weight [out, I] -> (act(gate) * up) @ weight.T, [rows, out]."""
    return swiglu_forward(as_rows(gate), as_rows(up), activation) @ weight.t()


@swiglu_down_fwd_op.register_fake
def _(gate, up, weight, activation="silu"):
    return gate.new_empty((gate.shape[0], weight.shape[0]))


def _down_grads(dout, g2, u2, weight, need_gate_up: bool, need_weight: bool, activation: str, packed: bool):
    """The backward of (act(gate) * up) @ weight.T: (the gate and up gradients, as a pair or with `packed`
    as one [rows, 2I] tensor; d weight), None for what is not asked for. h is recomputed for d weight."""
    dw = dout.t() @ swiglu_forward(g2, u2, activation) if need_weight else None  # h recomputed, used, dropped
    grads = swiglu_backward(dout @ weight, g2, u2, activation, packed) if need_gate_up else None
    return grads, dw


@torch.library.custom_op("playbook::swiglu_down_bwd", mutates_args=())
def swiglu_down_bwd_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                       need_gate_up: bool, need_weight: bool,
                       activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d gate, d up [rows, I] and d weight [out, I]; a gradient not asked for is an empty tensor."""
    grads, dw = _down_grads(dout, as_rows(gate), as_rows(up), weight, need_gate_up, need_weight, activation, False)
    dg, du = grads or (weight.new_empty(0), weight.new_empty(0))  # separate empties: outputs may not alias
    return dg, du, weight.new_empty(0) if dw is None else dw


@swiglu_down_bwd_op.register_fake
def _(dout, gate, up, weight, need_gate_up, need_weight, activation="silu"):
    if need_gate_up:
        dg, du = gate.new_empty(gate.shape), up.new_empty(up.shape)
    else:
        dg, du = weight.new_empty(0), weight.new_empty(0)
    return dg, du, weight.new_empty(weight.shape if need_weight else 0)


def _swiglu_down_backward(ctx, dout):
    gate, up, weight = ctx.saved_tensors  # not h: it is recomputed
    need_gate, need_up, need_weight = ctx.needs_input_grad[:3]
    dg, du, dw = swiglu_down_bwd_op(dout, gate, up, weight, need_gate or need_up, need_weight, ctx.activation)
    return dg if need_gate else None, du if need_up else None, dw if need_weight else None, None


swiglu_down_fwd_op.register_autograd(_swiglu_down_backward, setup_context=_save_inputs)
refuse_double_backward(swiglu_down_bwd_op, "swiglu_down")


# The same two operations on gate and up *joined*: one [rows, 2I] tensor, the output of one matmul
# with the gate and up weights side by side (projections_kernel.py; Phi-3's `gate_up_proj`). gate
# and up are read as its two halves in place, and backward writes d gate and d up into the two
# halves of one new [rows, 2I] gradient, which is what the joined matmul's backward takes. (Split
# into two tensors and joined again by autograd, the gradient would cost one more copy of
# rows x 2I: 470 MB per layer at 8192 tokens of LLaMA 3.1 8B.)
@torch.library.custom_op("playbook::swiglu_joined_fwd", mutates_args=())
def swiglu_joined_fwd_op(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate_up [rows, 2I] -> act(gate) * up [rows, I]."""
    return swiglu_forward(*halves(gate_up), activation)


@swiglu_joined_fwd_op.register_fake
def _(gate_up, activation="silu"):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op("playbook::swiglu_joined_bwd", mutates_args=())
def swiglu_joined_bwd_op(dh: torch.Tensor, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """d gate_up [rows, 2I] (d gate, then d up)."""
    return swiglu_backward(as_rows(dh), *halves(gate_up), activation, packed=True)


@swiglu_joined_bwd_op.register_fake
def _(dh, gate_up, activation="silu"):
    return gate_up.new_empty(gate_up.shape)


def _swiglu_joined_backward(ctx, dh):
    (gate_up,) = ctx.saved_tensors
    return swiglu_joined_bwd_op(dh, gate_up, ctx.activation), None


swiglu_joined_fwd_op.register_autograd(_swiglu_joined_backward, setup_context=_save_inputs)
refuse_double_backward(swiglu_joined_bwd_op, "swiglu_joined")


@torch.library.custom_op("playbook::swiglu_down_joined_fwd", mutates_args=())
def swiglu_down_joined_fwd_op(gate_up: torch.Tensor, weight: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate_up [rows, 2I], weight [out, I] -> (act(gate) * up) @ weight.T; h is recomputed in backward."""
    return swiglu_forward(*halves(gate_up), activation) @ weight.t()


@swiglu_down_joined_fwd_op.register_fake
def _(gate_up, weight, activation="silu"):
    return gate_up.new_empty((gate_up.shape[0], weight.shape[0]))


@torch.library.custom_op("playbook::swiglu_down_joined_bwd", mutates_args=())
def swiglu_down_joined_bwd_op(dout: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor, need_gate_up: bool,
                              need_weight: bool, activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """d gate_up [rows, 2I] and d weight [out, I]; a gradient not asked for is an empty tensor."""
    dgu, dw = _down_grads(dout, *halves(gate_up), weight, need_gate_up, need_weight, activation, True)
    return (weight.new_empty(0) if dgu is None else dgu), (weight.new_empty(0) if dw is None else dw)


@swiglu_down_joined_bwd_op.register_fake
def _(dout, gate_up, weight, need_gate_up, need_weight, activation="silu"):
    dgu = gate_up.new_empty(gate_up.shape) if need_gate_up else weight.new_empty(0)
    return dgu, weight.new_empty(weight.shape if need_weight else 0)


def _swiglu_down_joined_backward(ctx, dout):
    gate_up, weight = ctx.saved_tensors
    need_gate_up, need_weight = ctx.needs_input_grad[:2]
    dgu, dw = swiglu_down_joined_bwd_op(dout, gate_up, weight, need_gate_up, need_weight, ctx.activation)
    return dgu if need_gate_up else None, dw if need_weight else None, None


swiglu_down_joined_fwd_op.register_autograd(_swiglu_down_joined_backward, setup_context=_save_inputs)
refuse_double_backward(swiglu_down_joined_bwd_op, "swiglu_down_joined")


# ------------------------------------------------------------------------------------------------
# Functional API
# ------------------------------------------------------------------------------------------------
def _check_pair(gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    check_float("gate", gate)
    check_float("up", up)
    check_device(gate, up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have the same shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for tensors of the same shape and dtype; differentiable once.

    activation: "silu" (SwiGLU, LLaMA) or "gelu_tanh" (GeGLU, Gemma: GELU's tanh approximation)."""
    _check_pair(gate, up, activation)
    return swiglu_fwd_op(as_rows(gate), as_rows(up), activation).view(gate.shape)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up: `swiglu(gate, up, "gelu_tanh")`."""
    return swiglu(gate, up, "gelu_tanh")


def _check_down_weight(weight: torch.Tensor, acts: torch.Tensor, width: int) -> None:
    """The down projection's weight against what it multiplies (gate, or gate_up), I = `width` wide."""
    check_float("weight", weight)
    if weight.device != acts.device:
        raise ValueError(f"the down-projection weight is on {weight.device}, gate and up on {acts.device}: "
                         "they must be on one device")
    if weight.dtype != acts.dtype:
        raise ValueError(f"the down-projection weight is {weight.dtype}, gate and up are {acts.dtype}: cast the "
                         "model to one dtype, or run it under torch.autocast")
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ValueError(f"weight must be [out, {width}], got {tuple(weight.shape)}")


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """(act(gate) * up) @ weight.T, recomputing act(gate) * up in backward instead of storing it."""
    _check_pair(gate, up, activation)
    _check_down_weight(weight, gate, gate.shape[-1])
    out = swiglu_down_fwd_op(as_rows(gate), as_rows(up), weight, activation)
    return out.view(*gate.shape[:-1], weight.shape[0])


def check_joined(gate_up: torch.Tensor, activation: str) -> None:
    check_float("gate_up", gate_up)
    check_device(gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2I] (gate, then up), got {tuple(gate_up.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def swiglu_joined(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up where gate and up are the two halves of gate_up's last dimension ([..., 2I] -> [..., I])."""
    check_joined(gate_up, activation)
    return swiglu_joined_fwd_op(as_rows(gate_up), activation).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def swiglu_down_joined(gate_up: torch.Tensor, weight: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """`swiglu_down` on the two halves of gate_up [..., 2I]; its gradient comes back as one [..., 2I] tensor."""
    check_joined(gate_up, activation)
    width = gate_up.shape[-1] // 2
    _check_down_weight(weight, gate_up, width)
    out = swiglu_down_joined_fwd_op(as_rows(gate_up), weight, activation)
    return out.view(*gate_up.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------------------------
# The Hugging Face drop-in and patching a model
# ------------------------------------------------------------------------------------------------
def swiglu_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP, `down_proj(act(gate) * up)`, with the fused activation: `mlp_down` of `gate_and_up`.

    A plain bias-free nn.Linear down_proj is folded into `swiglu_down` (h not stored); any other
    down_proj (a bias, an adapter wrapper, an FP8 layer) is called as a module on the fused
    activation. Under torch.autocast the projections return the autocast dtype while the weights
    keep theirs: the down-projection weight is then cast as autocast would cast it for nn.Linear.
    The activation is `mlp.fused_activation` ("silu" unless patch_model set it).
    """
    return mlp_down(mlp, x, *gate_and_up(mlp, x))


def gate_and_up(mlp: nn.Module, x: torch.Tensor):
    """(gate, up, None) from `gate_proj` and `up_proj`, one matmul each; or (None, None, gate_up [..., 2I])
    when one matmul computes both: Phi-3's `gate_up_proj`, or `gate_proj` and `up_proj` joined by
    projections_kernel.py (their weights side by side in memory)."""
    import projections_kernel

    if hasattr(mlp, "gate_up_proj"):
        return None, None, mlp.gate_up_proj(x)
    gu = projections_kernel.joined_output(mlp, x)  # None unless gate and up are joined
    if gu is None:
        return mlp.gate_proj(x), mlp.up_proj(x), None
    return None, None, gu


def folds_down(down: nn.Module) -> bool:
    """Whether `mlp_down` folds this down projection into `swiglu_down` (a plain bias-free nn.Linear)."""
    return type(down) is nn.Linear and down.bias is None


def mlp_down(mlp: nn.Module, x: torch.Tensor, g, u, gu) -> torch.Tensor:
    """down_proj(act(gate) * up) from what `gate_and_up` returned (`swiglu_mlp_forward`); x: the MLP's input."""
    activation = getattr(mlp, "fused_activation", "silu")
    down = mlp.down_proj
    if folds_down(down):
        weight = down.weight
        dtype = g.dtype if gu is None else gu.dtype
        if weight.dtype != dtype and torch.is_autocast_enabled(x.device.type):
            weight = weight.to(dtype)
        return swiglu_down(g, u, weight, activation) if gu is None else swiglu_down_joined(gu, weight, activation)
    return down(swiglu(g, u, activation) if gu is None else swiglu_joined(gu, activation))


def patch_model(model: nn.Module) -> int:
    """Run every MLP of a Hugging Face causal LM through `swiglu_mlp_forward`; return how many.

    MLPs are found by class (LlamaMLP, GemmaMLP, Phi3MLP, ...). The activation is the config's
    (`hidden_act`, or Gemma 2's `hidden_activation`): SiLU gives SwiGLU, "gelu_pytorch_tanh"
    GeGLU; any other is refused with NotImplementedError before anything is patched. Patching
    twice sets the same forward again and returns the same count.
    """
    kind = model_type(model)
    act = mlp_activation(model.config)
    if act not in HF_ACTIVATIONS:
        raise NotImplementedError(f"the fused MLP computes {' or '.join(HF_ACTIVATIONS)} activations; this {kind} "
                                  f"model's is {act!r}")
    mlps = [m for m in model.modules() if isinstance(m, family_classes("MLP", kind))]
    for mlp in mlps:
        mlp.fused_activation = HF_ACTIVATIONS[act]
        mlp.forward = types.MethodType(swiglu_mlp_forward, mlp)
    return len(mlps)


def expected_patches(config) -> int:
    """One MLP per decoder layer."""
    return config.num_hidden_layers


def ideal_bytes(n_rows: int, width: int, dtype: torch.dtype, backward: bool = False) -> int:
    """The fewest bytes the fused SwiGLU can move for [n_rows, width] gate and up of `dtype`.

    Forward reads gate and up and writes h (3 values per element); `backward=True` adds the
    backward pass, which reads dh, gate and up and writes d gate and d up (5 more).
    """
    values = 3 + (5 if backward else 0)
    return values * n_rows * width * dtype.itemsize


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------
def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Plain PyTorch, as Hugging Face's LlamaMLP ("silu") and GemmaMLP ("gelu_tanh") compute it."""
    if activation == "gelu_tanh":
        return nn.functional.gelu(gate, approximate="tanh") * up
    return nn.functional.silu(gate) * up
