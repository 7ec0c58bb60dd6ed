"""Attention kept inside each example of a packed row, without a [T, T] mask.

A packed row holds several examples back to back (playbook/data/dataset.py). Each token may attend only to the
earlier tokens of its own example. The batch says where the examples begin with one small tensor, the
boundaries: the offsets of every example in the flattened batch of B x T tokens, as varlen attention
kernels take them (`cu_seqlens`: 0, the end of the first example, ..., B x T). The tail of a row that
no example fills is one more "example" of its own (padding: its labels are -100, nothing reads its
outputs). The boundaries have a fixed length for the whole run (the most examples a batch can hold,
plus one): the unused entries repeat B x T, empty examples that a kernel skips. Fixed shapes and
device-side boundaries are what a CUDA graph needs to replay the step with every batch.

The boundaries travel as the batch's `attention_mask`, shaped [1, 1, 1, N + 1] (int32): Hugging Face
passes any 4-D mask to the attention function as given, without building a mask of its own. The
attention function registered here, `ATTENTION` (set as the model's `_attn_implementation`), reads it:

  - on a GPU with flash attention (compute capability 8.0 or newer, bf16 or fp16, head size up to 256):
    FlashAttention-2's varlen kernels through PyTorch (`aten::_flash_attention_forward` / `_backward`),
    grouped-query heads as they are, memory linear in the tokens, nothing read on the host;
  - elsewhere (a CPU, an fp32 model): a correct fallback, SDPA's causal path once per example, which
    reads the boundaries on the host (so the step is not captured as a CUDA graph there).

Any other mask (generation, right-padded rows, a dense 4-D mask) goes to PyTorch SDPA exactly as the
`sdpa` implementation would take it, so one model serves both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTENTION = "playbook_packed"  # the attention implementation's name in transformers' registry
MAX_HEAD_DIM = 256  # FlashAttention-2's largest head size


def is_boundaries(mask) -> bool:
    """Whether an attention_mask is the packed batch's boundaries (not a real mask)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.int32 and mask.shape[:3] == (1, 1, 1)


def as_mask(bounds: torch.Tensor) -> torch.Tensor:
    """The boundaries [N + 1] in the batch's attention_mask slot: [1, 1, 1, N + 1] int32."""
    return bounds.to(torch.int32).view(1, 1, 1, -1)


def boundaries(row_lengths: list[list[int]], seq_len: int, size: int) -> torch.Tensor:
    """[size] int32: the offsets of every example of the rows (each row a list of example lengths summing to
    seq_len, its padding tail included), in the flattened rows, padded with len(rows) x seq_len."""
    out, at = [0], 0
    for r, lengths in enumerate(row_lengths):
        if sum(lengths) != seq_len:
            raise ValueError(f"row {r}: example lengths sum to {sum(lengths)}, not the row's {seq_len} tokens")
        for n in lengths:
            at += n
            out.append(at)
    if len(out) > size:
        raise ValueError(f"{len(out) - 1} examples in one batch, more than the {size - 1} its boundaries hold")
    out += [at] * (size - len(out))
    return torch.tensor(out, dtype=torch.int32)


def _fallback_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashAttention's varlen kernels cannot take these inputs (a clause), or None where they can."""
    if device.type != "cuda":
        return "no GPU"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{str(dtype).replace('torch.', '')} weights"
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        return f"head size {head_dim}"
    if torch.cuda.get_device_capability(device)[0] < 8 or not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this GPU has no flash attention"
    return None


def kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The name of the fused kernel that runs packed attention for these inputs, or None (the fallback)."""
    return None if _fallback_reason(device, dtype, head_dim) else "FlashAttention-2 varlen"


def describe(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """One line for the log: how packed rows are attended on this machine."""
    why = _fallback_reason(device, dtype, head_dim)
    if why is None:
        return (f"attention on packed rows: {kernel(device, dtype, head_dim)} (each example attends only to itself; "
                "boundaries on the GPU, memory linear in the tokens)")
    return (f"attention on packed rows: SDPA once per example ({why}: the fallback, exact, memory linear in the "
            "tokens; it reads the boundaries on the host, so the step is not captured as a CUDA graph)")


class _FlashVarlen(torch.autograd.Function):
    """Causal attention over the examples of a flattened batch: q [N, H, D], k and v [N, Hkv, D]."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, max_len: int, scale: float | None):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, bounds, bounds, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, bounds, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, bounds, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, bounds, bounds, ctx.max_len, ctx.max_len, 0.0, True, rng, unused,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


def _per_example(q, k, v, bounds: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The fallback: SDPA's causal path on each example alone (q [N, H, D], k and v [N, Hkv, D])."""
    edges = bounds.tolist()
    groups = q.shape[1] // k.shape[1]
    parts = []
    for a, e in zip(edges[:-1], edges[1:]):
        if e == a:
            continue
        qa, ka, va = (x[a:e].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if groups > 1:
            ka, va = ka.repeat_interleave(groups, dim=1), va.repeat_interleave(groups, dim=1)
        parts.append(F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale)[0].transpose(0, 1))
    return torch.cat(parts) if parts else q.new_empty(q.shape)


@torch.compiler.disable
def document_attention(q, k, v, bounds: torch.Tensor, max_len: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention within each example: q [N, H, D], k and v [N, Hkv, D] (Hkv divides H), bounds [E + 1]
    int32 offsets into the N tokens (the last entries may repeat N). Returns [N, H, D].

    Runs as written under torch.compile (`--compile`): the fallback reads the boundaries on the host, whose
    data-dependent shapes Inductor cannot compile, and the fused path is one kernel pair already."""
    if kernel(q.device, q.dtype, q.shape[-1]):
        return _FlashVarlen.apply(q, k, v, bounds, max_len, scale)
    return _per_example(q, k, v, bounds, scale)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function interface: query [B, H, T, D], key and value [B, Hkv, T, D];
    returns ([B, T, H, D], None)."""
    if not is_boundaries(attention_mask):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("attention dropout is not supported on packed rows")
    B, H, T, D = query.shape
    flat = [x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in (query, key, value)]
    out = document_attention(*flat, attention_mask.view(-1), T, scaling)
    return out.view(B, T, H, D), None


def _mask_function(*args, **kwargs):
    """The mask for calls without boundaries (generation): whatever SDPA's mask function gives, looked up
    when called (install_causal_skip below may have wrapped it)."""
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def install(model) -> None:
    """Register the attention function with transformers and make it the model's."""
    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, _mask_function)
    model.config._attn_implementation = ATTENTION


def unsupported(config) -> str | None:
    """Why this model's attention cannot run on packed boundaries (a clause), or None when it can."""
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention caps the logits (softcapping)"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < getattr(config, "max_position_embeddings", 0):
        return f"its attention looks back {window} tokens only (a sliding window)"
    return None


def install_causal_skip():
    """Let Hugging Face keep SDPA's `is_causal` path while a graph is captured or Dynamo traces. Returns a
    function that undoes it (a no-op where transformers has no SDPA mask function to wrap).

    transformers counts a CUDA stream capture as tracing (masking_utils.is_tracing in 5.x), and its
    SDPA mask function then builds a full [B, 1, T, T] causal mask instead of answering None (SDPA's
    is_causal=True), which also turns off SDPA's own grouped-query path (k and v are repeated to every
    head): attention forward and backward then run SDPA's slower masked path. Dynamo's tracing counts as
    tracing too (transformers 5.17), so `models.apply_compile` installs it as well (results/README.md lists
    the profile of a torch.compile'd step without it, against the step without torch.compile). The check
    exists because a padding mask would have to be read on the host, which a capture or a trace cannot do.
    `graph_blocker` keeps padded rows eager, so under our capture a causal mask without a padding mask
    is the only case answered here, and it is answered as an eager step would be: None. Every other
    call (a padding mask, sliding windows, packed sequences, custom mask functions) goes to transformers."""
    try:
        from transformers import masking_utils
    except ImportError:
        return lambda: None
    mapping = getattr(getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None), "_global_mapping", None)
    original = mapping.get("sdpa") if isinstance(mapping, dict) else None
    if original is None or getattr(original, "causal_skip", False):  # none, or installed already
        return lambda: None

    def sdpa_mask(*args, **kwargs):
        plain_causal = (not args and kwargs.get("attention_mask") is None and kwargs.get("allow_is_causal_skip", True)
                        and kwargs.get("q_length") is not None and kwargs.get("q_length") == kwargs.get("kv_length")
                        and not kwargs.get("q_offset") and kwargs.get("local_size") is None
                        and kwargs.get("mask_function", masking_utils.causal_mask_function)
                        is getattr(masking_utils, "causal_mask_function", None))
        return None if plain_causal else original(*args, **kwargs)

    # Without a mask and without a cache, transformers also looks for packed sequences in the position ids,
    # which it cannot read under capture (or trace) either, so it assumes they are packed. Our batches either carry no
    # position ids (the model's own are 0..T-1: one sequence per row) or carry their own 4-D mask, which
    # transformers takes as given before it would look: under our capture there is nothing to detect.
    find_packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    sdpa_mask.causal_skip, sdpa_mask.__wrapped__ = True, original
    mapping["sdpa"] = sdpa_mask
    if find_packed is not None:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None

    def undo():
        mapping["sdpa"] = original
        if find_packed is not None:
            masking_utils.find_packed_sequence_indices = find_packed

    return undo
