"""Fused SwiGLU in Triton: `silu(gate) * up`, forward and backward, one pass each.

    h = silu(g) * u,  silu(g) = g * sigmoid(g)
    dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),   du = dh * silu(g)

What you build here: the activation of LLaMA's MLP, `down_proj(silu(gate_proj(x)) * up_proj(x))`,
as one forward kernel and one backward kernel, saving only the two inputs for backward.
What you learn: an element-wise kernel over rows with strides, and *recomputation*: the backward
re-derives sigmoid(g) from g (cheap arithmetic) instead of storing it (expensive memory).

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

Layout of this file: kernels -> launchers -> custom ops (PyTorch operators, with their autograd)
-> functional API -> the MLP drop-in and `patch_model` -> reference.
"""

import types

import torch
from torch import nn

import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from kernel_utils import as_rows, check_device, check_float, next_power_of_2, refuse_double_backward
from model_families import family_classes, model_type

import triton
import triton.language as tl

BLOCK = 2048  # columns per program: 8 values per thread at 8 warps
NUM_WARPS = 8


@triton.jit
def _tile(n_rows, I, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's [ROWS, BLOCK] tile: row indices (int64: row * stride can pass 2^31, e.g.
    8192 x 14336 x 19), column indices, and the mask of the tile's in-bounds elements."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    return row, cols, (row < n_rows) & (cols < I)


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
):
    row, cols, mask = _tile(n_rows, I, ROWS, BLOCK)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u  # all in fp32, rounded once on store
    tl.store(H + row * I + cols, h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    DH,  # pointer to the upstream gradient, [n_rows, I], unit stride along I
    G,  # pointer to the saved gate
    U,  # pointer to the saved up
    DG,  # pointer to the gate gradient, [n_rows, I], contiguous
    DU,  # pointer to the up gradient, [n_rows, I], contiguous
    stride_dh,  # elements between two rows of DH
    stride_g,  # elements between two rows of G
    stride_u,  # elements between two rows of U
    n_rows,  # rows (tokens)
    I,  # row length
    ROWS: tl.constexpr,  # rows per program
    BLOCK: tl.constexpr,  # columns per program
):
    row, cols, mask = _tile(n_rows, I, ROWS, BLOCK)
    dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)  # recomputed: cheaper than storing silu(g) in forward and reading it here
    silu = g * sig
    tl.store(DU + row * I + cols, (dh * silu).to(DU.dtype.element_ty), mask=mask)
    dsilu = sig * (1.0 + g * (1.0 - sig))  # d/dg [g * sigmoid(g)]
    tl.store(DG + row * I + cols, (dh * u * dsilu).to(DG.dtype.element_ty), mask=mask)


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


def swiglu_forward(g2: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    n_rows, width = g2.shape
    h = torch.empty((n_rows, width), dtype=g2.dtype, device=g2.device)
    if h.numel():
        grid, rows, block = _launch(n_rows, width)
        _swiglu_fwd[grid](g2, u2, h, g2.stride(0), u2.stride(0), n_rows, width, ROWS=rows, BLOCK=block,
                          num_warps=NUM_WARPS)
    return h


def swiglu_backward(dh2, g2, u2):
    n_rows, width = g2.shape
    dg = torch.empty((n_rows, width), dtype=g2.dtype, device=g2.device)
    du = torch.empty((n_rows, width), dtype=u2.dtype, device=u2.device)
    if dg.numel():
        grid, rows, block = _launch(n_rows, width)
        _swiglu_bwd[grid](dh2, g2, u2, dg, du, dh2.stride(0), g2.stride(0), u2.stride(0), n_rows, width,
                          ROWS=rows, BLOCK=block, num_warps=NUM_WARPS)
    return dg, du


# ------------------------------------------------------------------------------------------------
# Custom ops: what torch.compile, opcheck and FSDP see
# ------------------------------------------------------------------------------------------------
# Each launcher becomes a PyTorch operator (`torch.ops.playbook.swiglu_fwd`, ...): one opaque node
# to torch.compile, so Dynamo never traces into the Triton launch code. `register_fake` gives the
# compiler the outputs' shapes without running anything; `register_autograd` ties each forward
# operator to its backward one. The operators take [rows, I] matrices with unit stride along I.
@torch.library.custom_op("playbook::swiglu_fwd", mutates_args=())
def swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_forward(as_rows(gate), as_rows(up))


@swiglu_fwd_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("playbook::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(as_rows(dh), as_rows(gate), as_rows(up))


@swiglu_bwd_op.register_fake
def _(dh, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # g and u (and the weight): the matmuls keep them alive anyway


def _swiglu_backward(ctx, dh):
    gate, up = ctx.saved_tensors
    return swiglu_bwd_op(dh, gate, up)


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
def swiglu_down_fwd_op(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gate, up [rows, I], weight [out, I] -> (silu(gate) * up) @ weight.T, [rows, out]."""
    return swiglu_forward(as_rows(gate), as_rows(up)) @ weight.t()


@swiglu_down_fwd_op.register_fake
def _(gate, up, weight):
    return gate.new_empty((gate.shape[0], weight.shape[0]))


@torch.library.custom_op("playbook::swiglu_down_bwd", mutates_args=())
def swiglu_down_bwd_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                       need_gate_up: bool, need_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d gate, d up [rows, I] and d weight [out, I]; a gradient not asked for is an empty tensor."""
    g2, u2 = as_rows(gate), as_rows(up)
    dg, du, dw = (weight.new_empty(0) for _ in range(3))  # three tensors: outputs may not alias
    if need_weight:
        dw = dout.t() @ swiglu_forward(g2, u2)  # h recomputed, used, dropped
    if need_gate_up:
        dg, du = swiglu_backward(dout @ weight, g2, u2)
    return dg, du, dw


@swiglu_down_bwd_op.register_fake
def _(dout, gate, up, weight, need_gate_up, need_weight):
    if need_gate_up:
        dg, du = gate.new_empty(gate.shape), up.new_empty(up.shape)
    else:
        dg, du = weight.new_empty(0), weight.new_empty(0)
    return dg, du, weight.new_empty(weight.shape if need_weight else 0)


def _swiglu_down_backward(ctx, dout):
    gate, up, weight = ctx.saved_tensors  # not h: it is recomputed
    need_gate, need_up, need_weight = ctx.needs_input_grad
    dg, du, dw = swiglu_down_bwd_op(dout, gate, up, weight, need_gate or need_up, need_weight)
    return dg if need_gate else None, du if need_up else None, dw if need_weight else None


swiglu_down_fwd_op.register_autograd(_swiglu_down_backward, setup_context=_save_inputs)
refuse_double_backward(swiglu_down_bwd_op, "swiglu_down")


# ------------------------------------------------------------------------------------------------
# Functional API
# ------------------------------------------------------------------------------------------------
def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_float("gate", gate)
    check_float("up", up)
    check_device(gate, up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have the same shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for tensors of the same shape and dtype; differentiable once."""
    _check_pair(gate, up)
    return swiglu_fwd_op(as_rows(gate), as_rows(up)).view(gate.shape)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T, recomputing silu(gate) * up in backward instead of storing it."""
    _check_pair(gate, up)
    check_float("weight", weight)
    if weight.device != gate.device:
        raise ValueError(f"the down-projection weight is on {weight.device}, gate and up on {gate.device}: "
                         "they must be on one device")
    if weight.dtype != gate.dtype:
        raise ValueError(f"the down-projection weight is {weight.dtype}, gate and up are {gate.dtype}: cast the "
                         "model to one dtype, or run it under torch.autocast")
    if weight.dim() != 2 or weight.shape[1] != gate.shape[-1]:
        raise ValueError(f"weight must be [out, {gate.shape[-1]}], got {tuple(weight.shape)}")
    out = swiglu_down_fwd_op(as_rows(gate), as_rows(up), weight)
    return out.view(*gate.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------------------------
# The Hugging Face drop-in and patching a model
# ------------------------------------------------------------------------------------------------
def swiglu_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LLaMA's MLP (`down_proj(act(gate_proj(x)) * up_proj(x))`) with the fused activation.

    A plain bias-free nn.Linear down_proj is folded into `swiglu_down` (h not stored); any other
    down_proj (a bias, an adapter wrapper) is called as a module on the fused activation. Under
    torch.autocast the projections return the autocast dtype while the weights keep theirs: the
    down-projection weight is then cast as autocast would cast it for nn.Linear.
    """
    g, u = mlp.gate_proj(x), mlp.up_proj(x)
    down = mlp.down_proj
    if type(down) is nn.Linear and down.bias is None:
        weight = down.weight
        if weight.dtype != g.dtype and torch.is_autocast_enabled(g.device.type):
            weight = weight.to(g.dtype)
        return swiglu_down(g, u, weight)
    return down(swiglu(g, u))


def patch_model(model: nn.Module) -> int:
    """Run every MLP of a Hugging Face causal LM through `swiglu_mlp_forward`; return how many.

    MLPs are found by class (LlamaMLP, Qwen2MLP, ...). Only for models whose activation is SiLU.
    Patching twice sets the same forward again and returns the same count.
    """
    kind = model_type(model)
    act = getattr(model.config, "hidden_act", None)
    if act != "silu":
        raise NotImplementedError(f"the fused SwiGLU computes silu(gate) * up; this {kind} model's hidden_act "
                                  f"is {act!r}")
    mlps = [m for m in model.modules() if isinstance(m, family_classes("MLP"))]
    for mlp in mlps:
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
def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch, as Hugging Face's LlamaMLP computes it."""
    return nn.functional.silu(gate) * up
