"""Tiled MLP: each decoder layer's MLP over chunks of tokens, forward and backward, one chunk's [N, I]
intermediates at a time (playbook/memory/activations.py's docstring, "Tiled MLP", says how and what it costs).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from torch import nn


def _uses_randomness(module: nn.Module) -> bool:
    """Dropout that draws random numbers now (LoRA's --lora-dropout in training mode)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in module.modules())


class TiledMLPFunction(torch.autograd.Function):
    """y = run(x) computed over chunks of `chunk` rows of x [N, H]; saves x only.

    Inputs: run (the MLP's forward), chunk, rng (the random state to replay, or None), x, then the
    MLP's trainable parameters, so that their gradients leave backward summed over the chunks.
    """

    @staticmethod
    def forward(ctx, run, chunk: int, rng, x, *params):
        n = x.shape[0]
        out = None
        for start in range(0, n, chunk):  # gradients are off inside forward: nothing is kept per chunk
            y = run(x[start:start + chunk])
            if out is None:
                out = y.new_empty((n, y.shape[-1]))
            out[start:start + chunk] = y
        device = x.device.type
        ctx.run, ctx.chunk, ctx.rng, ctx.params = run, chunk, rng, params
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[4:]) if need]
        dx = torch.empty_like(x) if need_x else None
        sums = [None] * len(wanted)  # fp32 (or wider) running sums of the parameters' gradients
        device = x.device
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                   enabled=ctx.rng is not None, device_type=device.type):
            if ctx.rng is not None:  # replay the forward's dropout masks, chunk by chunk
                torch.set_rng_state(ctx.rng[0])
                if ctx.rng[1] is not None:
                    torch.cuda.set_rng_state(ctx.rng[1], device)
            for start in range(0, x.shape[0], ctx.chunk):
                xc = x[start:start + ctx.chunk].detach().requires_grad_(need_x)
                with torch.enable_grad(), torch.autocast(device.type, dtype=dtype, enabled=enabled):
                    y = ctx.run(xc)
                grads = torch.autograd.grad(y, ([xc] if need_x else []) + wanted, dout[start:start + ctx.chunk],
                                            allow_unused=True)
                if need_x:
                    dx[start:start + ctx.chunk] = grads[0]
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        if sums[i] is None:
                            sums[i] = g.to(torch.promote_types(g.dtype, torch.float32))
                        else:
                            sums[i] += g
                del y, grads  # this chunk's intermediates go before the next chunk's are made
        sums.reverse()
        param_grads = []  # one per parameter input, None where none is needed
        for p, need in zip(ctx.params, ctx.needs_input_grad[4:]):
            total = sums.pop() if need else None
            param_grads.append(None if total is None else total.to(p.dtype))
        return None, None, None, dx, *param_grads


def _tiled_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's forward over chunks of `mlp.tiled_chunk_tokens` tokens (TiledMLPFunction)."""
    run, chunk = mlp.untiled_forward, mlp.tiled_chunk_tokens
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= chunk:  # one chunk: the MLP as it is
        return run(x)
    if not torch.is_grad_enabled():
        return torch.cat([run(rows[s:s + chunk]) for s in range(0, rows.shape[0], chunk)]).view(*x.shape[:-1], -1)
    return _apply_tiled(mlp, rows, chunk).view(*x.shape[:-1], -1)


@torch.compiler.disable  # its backward runs autograd itself: the chunk loop stays eager under torch.compile
def _apply_tiled(mlp: nn.Module, rows: torch.Tensor, chunk: int) -> torch.Tensor:
    rng = None
    if _uses_randomness(mlp):
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(rows.device) if rows.device.type == "cuda" else None)
    params = [p for p in mlp.parameters() if p.requires_grad]
    return TiledMLPFunction.apply(mlp.untiled_forward, chunk, rng, rows, *params)


def apply_tiled_mlp(layers: Sequence[nn.Module], chunk_tokens: int) -> int:
    """Compute each decoder layer's MLP over chunks of `chunk_tokens` tokens; returns how many MLPs.

    Call it last among the changes to the MLPs (kernels, FP8, LoRA): each chunk runs the forward the
    MLP has at this call. Calling it again changes the chunk size and keeps that forward.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not mlps or any(m is None for m in mlps):
        raise TypeError("the tiled MLP needs decoder layers with an `mlp` module")
    for mlp in mlps:
        if getattr(mlp.forward, "__func__", None) is not _tiled_forward:
            mlp.untiled_forward = mlp.forward  # the MLP's forward as patched so far (a bound method)
            mlp.forward = types.MethodType(_tiled_forward, mlp)
        mlp.tiled_chunk_tokens = chunk_tokens
    return len(mlps)
