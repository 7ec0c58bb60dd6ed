"""Memory options for long context and full fine-tuning: selective checkpointing, offloaded
checkpoints, a tiled MLP, and for the layers not checkpointed, recomputed norms and offloaded saved
tensors. Each changes what a step keeps in GPU memory, never what it computes.

    >>> from playbook.memory import activations, tiled_mlp
    >>> layers = models.decoder_layers(model)
    >>> activations.apply_checkpointing(layers, "every:4", offload=True)   # layers 0, 4, 8, ... of 32
    (0, 4, 8, 12, 16, 20, 24, 28)
    >>> tiled_mlp.apply_tiled_mlp(layers, chunk_tokens=8192)               # after the kernels and LoRA
    32

The same from the command line (models.prepare_model applies them):

    $ python finetune_optimized.py --lora-r 16 --seq-len 131072 --batch-size 1 \\
          --gradient-checkpointing --offload-activations --mlp-chunk-tokens 8192
    $ python finetune_optimized.py --optimizer-in-backward --recompute-norms \\
          --offload-layers first:16 --checkpoint-layers 28,29,30,31       # the 8B under 64 GB

What a decoder layer of LLaMA 3.1 8B keeps (H = 4096 hidden, I = 14336 MLP width, bf16, N = B x T
tokens of the micro-batch; docs/memory.md has the whole table):

    plain layer          everything backward reads: roughly 30 N H bytes with the default kernels (both
                         norms' inputs, the projections' inputs, attention's q, k, v and output, and the
                         MLP's gate and up, [N, 2 I] alone 14 N H), 15 GiB per layer at 131,072 tokens
    checkpointed layer   its input only: 2 N H bytes = 8 KiB per token; 1 GiB per layer at 131,072
                         tokens, 32 GiB (34.4 GB) for the 32 layers. Backward runs the layer's forward
                         again first (about a third more compute for the layer)
    offloaded            that input in pinned host memory instead; on the GPU only the layer being
                         recomputed and the next one, fetched ahead
    tiled MLP            the MLP's [N, I] intermediates (gate, up, act(gate) * up and their gradients,
                         7 x 3.5 GiB at 131,072 tokens) exist for one chunk of C tokens at a time,
                         forward and backward: 2 C I bytes each

Selective checkpointing (`apply_checkpointing`)
    Hugging Face's decoder layers (transformers' GradientCheckpointingLayer) checkpoint themselves when
    their `gradient_checkpointing` flag is set, through the function in `_gradient_checkpointing_func`.
    Both are set here, per layer, for the layers a SPEC names (`parse_layers`), with a `LayerCheckpoint`
    as the function: PyTorch's non-reentrant checkpoint (torch.utils.checkpoint, use_reentrant=False),
    which keeps the layer's inputs and recomputes everything else when backward first needs it. It needs
    no input that requires a gradient, so LoRA's frozen embeddings do not cut the adapters off, and it
    works with FSDP2 and torch.compile as Hugging Face's own checkpointing does.

Offloaded checkpoints (`host_offload.HostOffload`)
    A checkpointed layer's input reaches the checkpoint inside a `Stash` (not as a tensor argument,
    which the checkpoint would keep): the forward reads the GPU tensor from it, and the stash then
    keeps only a copy in a pinned host buffer. In order:
      forward    the copy starts on a side CUDA stream as the layer starts (the input is final then,
                 so the copy overlaps the layer's own compute); `record_stream` tells PyTorch's
                 allocator that the side stream reads the tensor, so its memory is reused only once
                 the copy is done, after the layer has returned and dropped it.
      backward   recomputing layer i first fetches its input (waiting on the event of a copy started
                 earlier, or copying now), then starts copying layer i-1's input back on the side
                 stream: that copy overlaps layer i's recompute and backward.
    Both directions use one side stream, so a host buffer handed back to the pool after its copy to the
    GPU was queued cannot be overwritten before that copy has read it: the next write to it is queued
    behind. Host buffers are pooled by dtype and size and reused every step (pinning host memory is
    slow: the driver locks every page, a noticeable fraction of a second per GiB). On a CPU the same code runs with
    plain copies, no streams. The copies cost PCIe bandwidth: 2 N H bytes each way per layer, 1 GiB
    at 131,072 tokens, about 20 ms at 50 GB/s, against the ~8e14 FLOPs of that layer's forward,
    recompute and backward at that length (over a second at 600 TFLOP/s): the copies hide behind it.

    On a GPU with a coherent link to its host (GB300's NVLink-C2C, ~900 GB/s), the copies are nearly
    free and the host memory could even be read in place; the same stash, with its copies on the side
    stream, is the portable way and costs little there.

    Offloading is refused by the command line without checkpointing: a plain layer keeps dozens of
    tensors for backward, not one, and copying all of them would cost more than recomputing.

Attention kept, the rest recomputed (`selective=True`, --keep-attention)
    At long context attention is most of a checkpointed layer's recompute: at 131,072 tokens the 8B's
    attention forward is ~34 GFLOP per token against ~15 for all its matmuls. A checkpointed layer can keep
    what attention's forward returned (its output, 2 N H bytes, and the softmax statistics, 4 N x heads
    bytes: 1.1 GB per layer at 131,072 tokens) and recompute everything else: PyTorch's selective
    checkpointing (`create_selective_checkpoint_contexts`) with a policy that saves the outputs of the
    fused SDPA operators and recomputes every other operator. In backward the recompute then runs the
    norms, projections and RoPE again (cheap), takes attention's forward from what was kept, and
    attention's backward reads it as it would without checkpointing. Results are bitwise those of plain
    checkpointing: the kept tensors are the ones the recompute would have produced. Only SDPA's fused
    operators are kept (the scripts load models with attn_implementation="sdpa"); a model on another
    attention implementation recomputes everything, and the log says so.

Recomputed norms and offloaded layers (saved_activations.apply_saved_activations, --recompute-norms, --offload-layers)
    A layer that is not checkpointed keeps what each of its operations saves for backward. Two kinds of
    that can go without recomputing the layer, through saved-tensor hooks around its forward
    (torch.autograd.graph.saved_tensors_hooks; `SavedActivations` says how):
      norm outputs    the projections after each norm save its output, 2 N H bytes, twice a layer; the
                      norm's own backward keeps its input anyway, so the hooks keep (norm, input) and
                      run the norm again when backward asks: a memory-bound kernel, bitwise the same.
      offloaded       in the layers a SPEC names, every saved tensor of 1 MiB or more goes to pinned host
                      memory as the forward makes it (side stream, as above), and backward brings a whole
                      layer back at once, starting PREFETCH_LAYERS layers before it reaches it.
    The copies are bounded by the host link: over PCIe (~50 GB/s) a forward can send only so much, and
    what has not left when the forward ends is still on the GPU at the peak (docs/memory.md measures
    how many layers pay off on an H100). The step then runs eagerly: the host queues the copies.

Tiled MLP (`tiled_mlp.apply_tiled_mlp`)
    `TiledMLPFunction` computes the MLP over chunks of C tokens (the [B, T] rows flattened), saving only
    the MLP's input. Backward recomputes each chunk's forward and backpropagates through it at once, so
    one chunk's gate/up intermediates exist at a time in backward too. Each chunk runs the MLP module's
    own forward, whatever it is by then (Hugging Face's, swiglu_kernel's fused one, FP8 projections,
    LoRA adapters): `apply_tiled_mlp` runs after those patches (models.prepare_model's order).

    The MLP's trainable parameters are inputs of the Function: backward sums their gradients over the
    chunks (in fp32 for bf16 weights; 4 bytes x the MLP's trainable parameters, 0.7 GB for the 8B's
    full fine-tune, nothing worth counting for LoRA's adapters) and returns each once, so autograd
    accumulates each parameter's gradient once per backward as without tiling: a gradient hook
    (--optimizer-in-backward's per-parameter AdamW step) fires once, with the whole gradient.

    Chunking sums the weight gradients in another order (per chunk, then over chunks): results differ
    from the untiled MLP by rounding, not more. Cost: the MLP's forward runs once more, in backward; in
    a layer that is also checkpointed, a third time (the checkpoint's recompute runs it in chunks too,
    since its output feeds the rest of the layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.utils._python_dispatch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from playbook.memory.host_offload import HostOffload, Stash

# ------------------------------------------------------------------------------------------------
# Which layers: the --checkpoint-layers SPEC
# ------------------------------------------------------------------------------------------------
SPEC_HELP = "'all', 'every:K' (layers 0, K, 2K, ...), 'first:N', or a comma list of layer indices (0-based)"


def parse_layers(spec: str, num_layers: int | None = None) -> tuple[int, ...] | None:
    """The decoder layers a SPEC names, sorted; ValueError (one line) for a SPEC that names none.

    num_layers None checks the syntax only (the command line, before the model is loaded) and returns
    None for the SPECs that need the layer count ('all', 'every:K', 'first:N').
    """
    text = spec.strip().lower() if isinstance(spec, str) else ""
    if not text:
        raise ValueError(f"no layers named: give {SPEC_HELP}")
    if text == "all":
        return None if num_layers is None else tuple(range(num_layers))
    kind, colon, value = text.partition(":")
    if colon:
        if kind not in ("every", "first"):
            raise ValueError(f"{spec!r}: unknown form {kind + ':'!r}; give {SPEC_HELP}")
        try:
            k = int(value)
        except ValueError:
            raise ValueError(f"{spec!r}: {kind}:K takes a whole number, got {value!r}") from None
        if k < 1:
            raise ValueError(f"{spec!r}: {kind}:K needs K >= 1")
        if num_layers is None:
            return None
        if kind == "first" and k > num_layers:
            raise ValueError(f"{spec!r}: the model has only {num_layers} decoder layers")
        return tuple(range(0, num_layers, k)) if kind == "every" else tuple(range(k))
    words = [w.strip() for w in text.split(",")]
    if not all(w.isdigit() for w in words):  # isdigit: no sign, no blank
        raise ValueError(f"{spec!r}: not a layer list; give {SPEC_HELP}")
    indices = [int(w) for w in words]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{spec!r}: a layer is named twice")
    if num_layers is not None and max(indices) >= num_layers:
        raise ValueError(f"{spec!r}: layer {max(indices)} does not exist, the model has {num_layers} decoder "
                         f"layers (0 to {num_layers - 1})")
    return tuple(sorted(indices))


def _run_stashed(function, s: Stash, offload: HostOffload, device_marker: torch.Tensor, *args):
    """What the checkpoint runs: the layer on its input, the GPU tensor in forward, fetched in recompute.
    `device_marker` (an empty tensor on the input's device) tells the checkpoint which device's random
    state and autocast state to keep, since the input itself is not among its arguments."""
    # The fetch copies from host memory only in the recompute, not in the forward: outside any dispatch mode,
    # so selective checkpointing (--keep-attention), which matches the recompute's operators against the
    # forward's one for one, does not see operators the forward did not run.
    with torch.utils._python_dispatch._disable_current_modes():
        hidden = offload.fetch(s)
    return function(hidden, *args)


def _attention_operators() -> tuple:
    names = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return tuple(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


ATTENTION_OPERATORS = _attention_operators()  # the fused SDPA operators --keep-attention keeps (this torch's)


def _keep_attention_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPERATORS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_contexts():
    return create_selective_checkpoint_contexts(_keep_attention_policy)


class LayerCheckpoint:
    """A decoder layer's `_gradient_checkpointing_func`: called by the layer (in training mode, with
    gradients on) as `(forward, hidden_states, *args)`; PyTorch's non-reentrant checkpoint of the
    layer, its input kept on the GPU (offload None) or stashed in host memory; selective: the
    outputs of attention's forward are kept too, and not recomputed."""

    def __init__(self, offload: HostOffload | None = None, selective: bool = False):
        self.offload = offload
        self.selective = selective

    def _options(self, kwargs: dict) -> dict:
        if self.selective:
            kwargs = dict(kwargs, context_fn=_keep_attention_contexts)
        return dict(kwargs, use_reentrant=False)

    def __call__(self, function, *args, **kwargs):
        if self.offload is None:
            return checkpoint(function, *args, **self._options(kwargs))
        return self._offloaded(function, *args, **kwargs)

    @torch.compiler.disable  # streams and host buffers: runs eagerly under torch.compile
    def _offloaded(self, function, hidden, *args, **kwargs):
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"--offload-activations: a decoder layer's first argument must be its hidden states "
                            f"tensor, got {type(hidden).__name__}")
        s = self.offload.stash(hidden)
        try:
            return checkpoint(_run_stashed, function, s, self.offload, hidden.new_empty(0), *args,
                              **self._options(kwargs))
        finally:
            HostOffload.drop_gpu(s)  # from here on the stash holds only the host copy


def apply_checkpointing(layers: Sequence[nn.Module], spec: str = "all", offload: bool = False,
                        selective: bool = False) -> tuple[int, ...]:
    """Checkpoint the decoder layers `spec` names (parse_layers); returns their indices.

    offload: their inputs go to pinned host memory (one HostOffload shared by these layers).
    selective: attention's forward outputs are kept, not recomputed (selective checkpointing).
    The other layers are left as they are. ValueError for a SPEC naming a layer that does not exist,
    TypeError for layers that are not Hugging Face GradientCheckpointingLayers.
    """
    chosen = parse_layers(spec, len(layers))
    wrong = [type(layer).__name__ for layer in layers if not hasattr(layer, "gradient_checkpointing")]
    if wrong:
        raise TypeError(f"{wrong[0]} has no `gradient_checkpointing` flag (transformers' GradientCheckpointingLayer "
                        "provides it): these decoder layers cannot be checkpointed one by one")
    checkpointed = LayerCheckpoint(HostOffload() if offload else None, selective)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i in chosen  # a layer left out keeps its activations
        if i in chosen:
            layer._gradient_checkpointing_func = checkpointed
    return chosen


def offload_of(layers: Sequence[nn.Module]) -> HostOffload | None:
    """The HostOffload the layers' checkpoints share (None without --offload-activations)."""
    for layer in layers:
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and isinstance(func, LayerCheckpoint):
            return func.offload
    return None


# ------------------------------------------------------------------------------------------------
# Bytes: what each option keeps (docs/memory.md explains the choice with these)
# ------------------------------------------------------------------------------------------------
def layer_input_bytes(tokens: int, hidden: int, dtype_bytes: int = 2) -> int:
    """A checkpointed layer's input: what it keeps in GPU memory (or, offloaded, in host memory)."""
    return tokens * hidden * dtype_bytes


def mlp_intermediate_bytes(tokens: int, intermediate: int, dtype_bytes: int = 2) -> int:
    """One [tokens, intermediate] tensor of the MLP (gate, up, act(gate) * up, or one of their gradients)."""
    return tokens * intermediate * dtype_bytes


def chunks(tokens: int, chunk_tokens: int) -> int:
    return math.ceil(tokens / chunk_tokens)
