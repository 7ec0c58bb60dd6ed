"""Memory options for long context and full fine-tuning: selective checkpointing, offloaded
checkpoints, a tiled MLP, and for the layers not checkpointed, recomputed norms and offloaded saved
tensors. Each changes what a step keeps in GPU memory, never what it computes.

    >>> from playbook.memory import activations
    >>> layers = models.decoder_layers(model)
    >>> activations.apply_checkpointing(layers, "every:4", offload=True)   # layers 0, 4, 8, ... of 32
    (0, 4, 8, 12, 16, 20, 24, 28)
    >>> activations.apply_tiled_mlp(layers, chunk_tokens=8192)             # after the kernels and LoRA
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

Offloaded checkpoints (`HostOffload`)
    A checkpointed layer's input reaches the checkpoint inside a `_Stash` (not as a tensor argument,
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

Attention kept, the rest recomputed (`keep_attention=True`, --keep-attention)
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

Recomputed norms and offloaded layers (`apply_saved_activations`, --recompute-norms, --offload-layers)
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

Tiled MLP (`apply_tiled_mlp`)
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
import types
import weakref
from collections.abc import Sequence

import torch
import torch.utils._python_dispatch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

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


# ------------------------------------------------------------------------------------------------
# Offloaded checkpoints: the layer inputs in pinned host memory, fetched back one layer ahead
# ------------------------------------------------------------------------------------------------
class _Stash:
    """One checkpointed layer's input: the GPU tensor during that layer's forward, then a host copy."""

    __slots__ = ("gpu", "host", "shape", "dtype", "device", "requires_grad", "fetched", "release", "__weakref__")


def _unregister(ptr: int) -> None:
    torch.cuda.synchronize()  # no copy may still read or write the memory
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """numel values of pinned host memory, no more: ordinary host memory pinned in place (cudaHostRegister),
    unpinned when the tensor is freed. torch.empty(pin_memory=True) takes its blocks from PyTorch's caching
    host allocator, which rounds each one up to a power of two: the 32 layer inputs of a 327,680-token
    sequence (2.7 GB each) would take 4 GiB each, 137 GB in all instead of 86 GB."""
    buf = torch.empty(numel, dtype=dtype)
    register = getattr(torch.cuda.cudart(), "cudaHostRegister", None)
    if register is None or numel == 0:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    ptr = buf.data_ptr()
    if register(ptr, numel * buf.element_size(), 0) != torch.cuda.cudart().cudaError.success:
        return torch.empty(numel, dtype=dtype, pin_memory=True)  # the allocator's way, rounded up
    weakref.finalize(buf, _unregister, ptr).atexit = False
    return buf


class HostOffload:
    """The host side of --offload-activations for one model: a side stream, a pool of pinned buffers,
    and the stack of stashed inputs in forward order (backward takes them in reverse)."""

    def __init__(self):
        self.free: dict[torch.dtype, list[torch.Tensor]] = {}  # host buffers not in use, by dtype
        self.allocations = 0  # host buffers ever created (a pool that works stops counting after step 1)
        self.host_bytes = 0  # bytes of host memory the pool holds, in use or free
        self.stack: list[weakref.ref] = []  # stashes not yet fetched, oldest first
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    # -- the pool ---------------------------------------------------------------------------------
    def _take(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """The smallest free buffer of `dtype` with room for `numel` values, or a new one (pinned for a GPU)."""
        free = self.free.setdefault(dtype, [])
        fits = [b for b in free if b.numel() >= numel]
        if fits:
            buf = min(fits, key=torch.Tensor.numel)
            del free[next(i for i, b in enumerate(free) if b is buf)]  # by identity: == compares values
            return buf
        for small in free:  # a longer sequence than before: the smaller buffers would stay unused
            self.host_bytes -= small.numel() * small.element_size()
        free.clear()
        buf = _pinned(numel, dtype) if pinned else torch.empty(numel, dtype=dtype)
        self.allocations += 1
        self.host_bytes += buf.numel() * buf.element_size()
        return buf

    def _give(self, buf: torch.Tensor) -> None:
        self.free.setdefault(buf.dtype, []).append(buf)

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    # -- the copies, on the side stream ---------------------------------------------------------------
    def copy_to_host(self, src: torch.Tensor, host: torch.Tensor) -> None:
        """Queue src -> host on the side stream, behind the compute stream's work so far (src is complete
        then); src's memory is reused only once the copy has run. On a CPU: a plain copy."""
        stream = self._stream(src.device)
        if stream is None:
            host.copy_(src.detach())
            return
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            host.copy_(src.detach(), non_blocking=True)
        src.record_stream(stream)

    def copy_to_device(self, pairs, device: torch.device):
        """Queue the (host, gpu) copies on the side stream, behind the compute stream's work so far (it may
        still use the memory the GPU tensors were just given); returns the event that marks them done
        (None on a CPU, where they are plain copies)."""
        stream = self._stream(device)
        if stream is None:
            for host, gpu in pairs:
                gpu.copy_(host)
            return None
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for host, gpu in pairs:
                gpu.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    # -- forward: stash ---------------------------------------------------------------------------
    def stash(self, hidden: torch.Tensor) -> _Stash:
        """Start copying `hidden` to a host buffer; the returned stash holds the GPU tensor until the
        caller's forward is done with it (`drop_gpu`), then only the host copy."""
        s = _Stash()
        s.gpu, s.shape, s.dtype, s.device = hidden, hidden.shape, hidden.dtype, hidden.device
        s.requires_grad, s.fetched = hidden.requires_grad, None
        buf = self._take(hidden.numel(), hidden.dtype, pinned=hidden.device.type == "cuda")
        s.host = buf[: hidden.numel()].view(hidden.shape)
        self.copy_to_host(hidden, s.host)
        # back to the pool when fetched, or when the graph holding the stash is freed unfetched
        # (a forward without backward); a later copy into it is queued behind on the same stream
        s.release = weakref.finalize(s, self._give, buf)
        self.stack = [r for r in self.stack if r() is not None]
        self.stack.append(weakref.ref(s))
        return s

    @staticmethod
    def drop_gpu(s: _Stash) -> None:
        s.gpu = None

    # -- backward: fetch, and prefetch the next one ------------------------------------------------
    def _copy_back(self, s: _Stash) -> None:
        """Queue the host-to-GPU copy of a stash (on the side stream): s.fetched = (tensor, event)."""
        gpu = torch.empty(s.shape, dtype=s.dtype, device=s.device)  # allocated on the compute stream
        s.fetched = (gpu, self.copy_to_device([(s.host, gpu)], s.device))
        s.host = None
        s.release()  # the buffer back to the pool: the next copy into it waits behind this one

    def fetch(self, s: _Stash) -> torch.Tensor:
        """The stashed input on the GPU again, for the layer's recompute; starts the previous layer's."""
        if s.gpu is not None:  # still in the layer's first forward
            return s.gpu
        self.stack = [r for r in self.stack if r() is not None and r() is not s]
        if s.fetched is None:
            if s.host is None:
                raise RuntimeError("--offload-activations: this layer's input was already fetched for one backward; "
                                   "a second backward through the same forward (retain_graph=True) is not supported")
            self._copy_back(s)  # not prefetched (the last checkpointed layer, or an unusual order)
        gpu, event = s.fetched
        s.fetched = None
        if event is not None:
            torch.cuda.current_stream(s.device).wait_event(event)  # a GPU-side wait: the host does not block
        nxt = self.stack[-1]() if self.stack else None
        if nxt is not None and nxt.gpu is None and nxt.fetched is None and nxt.host is not None:
            self._copy_back(nxt)  # overlaps this layer's recompute and backward
        return gpu.detach().requires_grad_(s.requires_grad)


def _run_stashed(function, s: _Stash, offload: HostOffload, device_marker: torch.Tensor, *args):
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
    layer, its input kept on the GPU (offload None) or stashed in host memory; keep_attention: the
    outputs of attention's forward are kept too, and not recomputed."""

    def __init__(self, offload: HostOffload | None = None, keep_attention: bool = False):
        self.offload = offload
        self.keep_attention = keep_attention

    def _options(self, kwargs: dict) -> dict:
        if self.keep_attention:
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
                        keep_attention: bool = False) -> tuple[int, ...]:
    """Checkpoint the decoder layers `spec` names (parse_layers); returns their indices.

    offload: their inputs go to pinned host memory (one HostOffload shared by these layers).
    keep_attention: attention's forward outputs are kept, not recomputed (selective checkpointing).
    The other layers are left as they are. ValueError for a SPEC naming a layer that does not exist,
    TypeError for layers that are not Hugging Face GradientCheckpointingLayers.
    """
    chosen = parse_layers(spec, len(layers))
    wrong = [type(layer).__name__ for layer in layers if not hasattr(layer, "gradient_checkpointing")]
    if wrong:
        raise TypeError(f"{wrong[0]} has no `gradient_checkpointing` flag (transformers' GradientCheckpointingLayer "
                        "provides it): these decoder layers cannot be checkpointed one by one")
    checkpointed = LayerCheckpoint(HostOffload() if offload else None, keep_attention)
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
# Tiled MLP: one chunk of tokens at a time, forward and backward
# ------------------------------------------------------------------------------------------------
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
    """The MLP's forward over chunks of `mlp.mlp_chunk_tokens` tokens (TiledMLPFunction)."""
    run, chunk = mlp.untiled_forward, mlp.mlp_chunk_tokens
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
        mlp.mlp_chunk_tokens = chunk_tokens
    return len(mlps)


# ------------------------------------------------------------------------------------------------
# Plain layers: the norms' outputs recomputed, what backward reads offloaded (saved-tensor hooks)
# ------------------------------------------------------------------------------------------------
OFFLOAD_MIN_BYTES = 1 << 20  # smaller saved tensors (rstd, softmax statistics, RoPE tables) stay on the GPU
PREFETCH_LAYERS = 3  # backward starts copying an offloaded layer back this many layers before it reaches it


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its memory exactly, in some order of dimensions (no gaps, no overlap):
    then a host buffer of numel values with the same strides holds it, and a copy keeps its layout."""
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _region(t: torch.Tensor) -> tuple | None:
    """The memory a dense tensor covers (storage, first element, count, dtype); None if it is not dense.
    Views that cover the same memory ([B, T, H] and its [N, H] rows) share one region."""
    if not _dense(t):
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)


class _Recomputed:
    """A norm's output saved as the norm and its (packed) input: backward runs the norm again."""

    __slots__ = ("layer", "output", "norm", "source", "version", "autocast", "result", "uses")


class _Offloaded:
    """A saved tensor's memory in a pinned host buffer until backward's group fetch brings it back."""

    __slots__ = ("host", "gpu", "numel", "dtype", "device", "group", "source", "version", "uses", "release",
                 "__weakref__")


class _View:
    """What one node saved: its shape and strides over a _Recomputed or _Offloaded tensor's memory."""

    __slots__ = ("base", "shape", "stride")

    def __init__(self, base, t: torch.Tensor):
        self.base, self.shape, self.stride = base, t.shape, t.stride()


class _Kept:
    """A saved tensor kept on the GPU, with the layer that saved it (so backward knows where it is)."""

    __slots__ = ("layer", "tensor", "version")

    def __init__(self, layer: int, t: torch.Tensor):
        self.layer, self.tensor, self.version = layer, t, t._version


class _Group:
    """The offloaded tensors of one layer's forward; backward fetches them together."""

    __slots__ = ("layer", "items", "event", "fetched", "__weakref__")

    def __init__(self, layer: int):
        self.layer, self.items = layer, []
        self.event, self.fetched = None, False


class _LayerForward:
    """What the hooks know while one layer's forward runs."""

    __slots__ = ("layer", "group", "packed", "norms", "params")

    def __init__(self, layer: int, group: _Group | None, params: set):
        self.layer, self.group, self.params = layer, group, params
        self.packed: dict[tuple, object] = {}  # region (and version) -> its _Recomputed or _Offloaded
        self.norms: dict[tuple, tuple] = {}  # a norm output's region -> (weakref to it, the norm, its input)


def _modified(what: str) -> RuntimeError:
    return RuntimeError(f"{what} was modified in place after the forward saved it for backward; the saved "
                        "activations (--recompute-norms, --offload-layers) need it unchanged")


class SavedActivations:
    """The saved-tensor hooks of --recompute-norms and --offload-layers for one model's decoder layers.

    While a hooked layer's forward runs, every tensor an autograd node saves for backward passes through
    `_pack`, and backward gets it back through `_unpack`:
      - a norm's output (registered by the norm's wrapped forward), or any view covering exactly its
        memory, is saved as the norm and its input: backward runs the norm's forward again on that input,
        the same kernel on the same values, so the result is bitwise the one the forward made. Those who
        save it are the projections after the norm (q/k/v, gate/up, LoRA's A): 2 N H bytes per norm, 4 N H
        per layer, no longer kept;
      - in an offloaded layer, every other saved tensor of at least `min_bytes` (dense, not a parameter)
        is copied to a pinned host buffer on the side stream, as the checkpoint offload does, and its GPU
        memory is released once the forward drops it. Backward brings each offloaded layer back whole (one
        copy each, one event) when it reaches the layer PREFETCH_LAYERS above it, so the copies overlap
        the compute of the layers in between. With offloading, every layer that is not checkpointed is
        hooked, so that backward's position is known from the first offloaded layer on.
    Memory saved several times (the layer input, read by the norm as [N, H] rows; a norm output read by
    two projections) is packed, copied and recomputed once. A saved tensor changed in place before
    backward reads it raises a RuntimeError, as autograd's own check of saved tensors would.
    """

    def __init__(self, recompute_norms: bool, offload: HostOffload | None, min_bytes: int = OFFLOAD_MIN_BYTES):
        self.recompute_norms, self.offload, self.min_bytes = recompute_norms, offload, min_bytes
        self.active: _LayerForward | None = None
        self.groups: list[weakref.ref] = []  # offloaded layers not yet fetched, in forward order
        self.recomputed = 0  # norm outputs run again in backward (tests count them)
        self.fetched = {"ahead": 0, "on demand": 0}  # offloaded layers back on the GPU, and how

    # -- forward -----------------------------------------------------------------------------------
    def run_layer(self, layer: nn.Module, offloaded: bool, *args, **kwargs):
        index = layer.saved_layer_index
        group = _Group(index) if offloaded and self.offload is not None else None
        if group is not None:
            self.groups = [r for r in self.groups if r() is not None]
            self.groups.append(weakref.ref(group))
        # what the layer owns is never offloaded (only an offloaded layer needs to know it)
        owned = ({t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
                 if group is not None else set())
        state = _LayerForward(index, group, owned)
        outer, self.active = self.active, state
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(state, t), self._unpack):
                return layer.unhooked_forward(*args, **kwargs)
        finally:
            self.active = outer

    def norm_output(self, norm: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """Called by a wrapped norm: y = norm(x) may be saved as the recipe (norm, x)."""
        state = self.active
        if (state is None or not self.recompute_norms or not torch.is_grad_enabled()
                or not isinstance(y, torch.Tensor) or not isinstance(x, torch.Tensor)):
            return
        region = _region(y)
        if region is not None:
            state.norms[region] = (weakref.ref(y), norm, x)

    def _keep(self, state: _LayerForward, t: torch.Tensor):
        """A tensor kept as autograd would keep it; with offloading, tagged with its layer."""
        return t if self.offload is None else _Kept(state.layer, t)

    def _pack(self, state: _LayerForward, t: torch.Tensor):
        region = _region(t)
        if region is None:
            return self._keep(state, t)
        norm = state.norms.get(region)
        if norm is not None and norm[0]() is not None:
            base = state.packed.get(("norm",) + region)
            if base is None or base.output is not norm[0]:  # none yet, or an earlier norm output's memory reused
                x = norm[2]
                base = _Recomputed()
                base.layer = state.layer
                base.output, base.norm, base.version, base.result, base.uses = norm[0], norm[1], x._version, None, 0
                device = x.device.type
                base.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                base.source = self._pack(state, x)  # x itself, or its offloaded copy
                state.packed[("norm",) + region] = base
        elif (state.group is not None and t.numel() * t.element_size() >= max(self.min_bytes, 1)
              and region[0] not in state.params):
            base = state.packed.get(region + (t._version,))
            if base is not None and base.source() is None:  # that tensor is gone: its memory may hold another now
                base = None
            if base is None:
                base = self._stash(state.group, t)
                state.packed[region + (t._version,)] = base
        else:
            return self._keep(state, t)
        base.uses += 1
        return _View(base, t)

    def _stash(self, group: _Group, t: torch.Tensor) -> _Offloaded:
        h = _Offloaded()
        h.numel, h.dtype, h.device = t.numel(), t.dtype, t.device
        h.gpu, h.group, h.uses = None, group, 0
        # the tensor whose memory this is: a view's base outlives the view objects autograd hands over
        h.source, h.version = weakref.ref(t if t._base is None else t._base), t._version
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset())  # the region, in memory order
        buf = self.offload._take(t.numel(), t.dtype, pinned=t.device.type == "cuda")
        h.host = buf[: t.numel()]
        self.offload.copy_to_host(flat, h.host)
        h.release = weakref.finalize(h, self.offload._give, buf)  # unfetched (no backward): back to the pool
        group.items.append(weakref.ref(h))
        return h

    # -- backward ----------------------------------------------------------------------------------
    def _unpack(self, obj):
        if isinstance(obj, torch.Tensor):
            return obj
        if type(obj) is _Kept:
            if obj.tensor._version != obj.version:
                raise _modified("a saved tensor")
            self._reached(obj.layer)
            return obj.tensor
        base = obj.base
        self._reached(base.layer if isinstance(base, _Recomputed) else base.group.layer)
        memory = self._recompute(base) if isinstance(base, _Recomputed) else self._fetched(base)
        base.uses -= 1
        if base.uses == 0:  # every node that saved it has it: autograd holds it while they need it
            if isinstance(base, _Recomputed):
                base.result = None
            else:
                base.gpu = None
        return memory.as_strided(obj.shape, obj.stride, memory.storage_offset())

    def _recompute(self, base: _Recomputed) -> torch.Tensor:
        if base.result is None:
            x = self._unpack(base.source)
            if isinstance(base.source, torch.Tensor) and x._version != base.version:
                raise _modified("a norm's input")
            device, enabled, dtype = base.autocast
            with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                base.result = base.norm.unhooked_forward(x)
            self.recomputed += 1
        return base.result

    def _fetched(self, h: _Offloaded) -> torch.Tensor:
        source = h.source()
        if source is not None and source._version != h.version:
            raise _modified("a tensor of an offloaded layer")
        group = h.group
        if not group.fetched:  # an order of backward _reached did not foresee
            self._fetch(group)
            self.fetched["on demand"] += 1
        if group.event is not None:
            torch.cuda.current_stream(h.device).wait_event(group.event)  # a GPU-side wait
            group.event = None
        return h.gpu

    def _reached(self, layer: int) -> None:
        """Backward is in `layer`: start bringing back every offloaded layer from there down to
        PREFETCH_LAYERS below it (nearest first). "ahead": a layer fetched before backward reached it."""
        if not self.groups:
            return
        waiting = [g for g in (r() for r in self.groups) if g is not None and not g.fetched]
        for g in sorted((g for g in waiting if g.layer >= layer - PREFETCH_LAYERS), key=lambda g: -g.layer):
            self._fetch(g)
            self.fetched["on demand" if g.layer >= layer else "ahead"] += 1

    def _fetch(self, group: _Group) -> None:
        """Queue the copies of one layer's offloaded tensors back to the GPU (one event for all)."""
        group.fetched = True
        self.groups = [r for r in self.groups if r() is not None and r() is not group]
        items = [h for h in (r() for r in group.items) if h is not None and h.host is not None]
        if not items:
            return
        device = items[0].device
        for h in items:  # allocated on the compute stream, written on the side stream after its pending work
            h.gpu = torch.empty(h.numel, dtype=h.dtype, device=device)
        group.event = self.offload.copy_to_device([(h.host, h.gpu) for h in items], device)
        for h in items:
            h.host = None
            h.release()  # the buffer back to the pool: a later copy into it waits behind this one


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") or isinstance(module, nn.LayerNorm)


@torch.compiler.disable  # saved-tensor hooks and host copies: eager
def _hooked_layer_forward(layer: nn.Module, *args, **kwargs):
    saved: SavedActivations = layer.saved_activations
    if not torch.is_grad_enabled() or (getattr(layer, "gradient_checkpointing", False) and layer.training):
        return layer.unhooked_forward(*args, **kwargs)  # a checkpointed layer keeps only its input anyway
    return saved.run_layer(layer, layer.offload_saved, *args, **kwargs)


def _registering_norm_forward(norm: nn.Module, x, *args, **kwargs):
    y = norm.unhooked_forward(x, *args, **kwargs)
    if not args and not kwargs:
        norm.saved_activations.norm_output(norm, x, y)
    return y


def apply_saved_activations(layers: Sequence[nn.Module], recompute_norms: bool = False,
                            offload_spec: str | None = None, min_bytes: int = OFFLOAD_MIN_BYTES) -> SavedActivations:
    """--recompute-norms and --offload-layers SPEC on the decoder layers (see SavedActivations).

    recompute_norms: every layer's norm outputs are recomputed in backward instead of kept.
    offload_spec: the layers (parse_layers) whose saved tensors wait in pinned host memory; a layer that
        is also checkpointed is a ValueError (a checkpointed layer keeps only its input: offload that with
        apply_checkpointing(offload=True)).
    Returns the SavedActivations the layers share.
    """
    offloaded = parse_layers(offload_spec, len(layers)) if offload_spec else ()
    both = [i for i in offloaded if getattr(layers[i], "gradient_checkpointing", False)]
    if both:
        raise ValueError(f"layer {both[0]} is both checkpointed and offloaded: a checkpointed layer keeps only its "
                         "input (offload that with --offload-activations); give each layer one of the two")
    saved = SavedActivations(recompute_norms, HostOffload() if offloaded else None, min_bytes)
    for i, layer in enumerate(layers):
        if not (recompute_norms or offloaded):
            continue
        if getattr(layer.forward, "__func__", None) is not _hooked_layer_forward:
            layer.unhooked_forward = layer.forward
            layer.forward = types.MethodType(_hooked_layer_forward, layer)
        layer.saved_activations, layer.offload_saved, layer.saved_layer_index = saved, i in offloaded, i
        for norm in (m for m in layer.modules() if _is_norm(m)):
            if getattr(norm.forward, "__func__", None) is not _registering_norm_forward:
                norm.unhooked_forward = norm.forward
                norm.forward = types.MethodType(_registering_norm_forward, norm)
            norm.saved_activations = saved
    return saved


def saved_activations_of(layers: Sequence[nn.Module]) -> SavedActivations | None:
    """The SavedActivations the layers share (None without --recompute-norms and --offload-layers)."""
    return next((layer.saved_activations for layer in layers if hasattr(layer, "saved_activations")), None)


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
