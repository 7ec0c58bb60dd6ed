"""Fingerprints of tensors: float64 sums and norms that tell one set of weights from another without a copy."""
from __future__ import annotations

import torch

FINGERPRINT_CHUNK = 1 << 24  # elements of an integer weight widened to float64 at a time (128 MB)


def sum_and_norm(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (sum, L2 norm) of a tensor's values. Floating tensors are reduced as they are; an
    integer one (QLoRA's NF4 weights, packed two 4-bit codes to a uint8) by its byte values, widened
    to float64 a chunk at a time, so that no full-size copy of a weight is made."""
    if t.is_floating_point() or t.is_complex():
        return torch.sum(t, dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64)
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    squares = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in flat.split(FINGERPRINT_CHUNK):
        wide = chunk.to(torch.float64)
        total += wide.sum()
        squares += wide.square().sum()
    return total, squares.sqrt()


def fingerprint(t: torch.Tensor) -> tuple[float, float]:
    """(float64 sum, float64 L2 norm) of one whole tensor, as a checkpoint's base fingerprint records it (playbook/store/checkpoint.py) (a sync).
    A module that replaces a frozen weight by another form of it (fp8_linear_kernel's weight kept in
    FP8) records its original's here, in `module.base_fingerprints` {attribute name: fingerprint}."""
    with torch.no_grad():
        total, norm = sum_and_norm(t)
    return total.item(), norm.item()
