"""Plain layers: the norms' outputs recomputed and what backward reads offloaded, through saved-tensor hooks
around the layers' forwards (playbook/memory/activations.py's docstring, "Recomputed norms and offloaded layers").
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from playbook.memory.activations import parse_layers
from playbook.memory.host_offload import HostOffload

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

    def __init__(self, norms_recomputed: bool, offload: HostOffload | None, min_bytes: int = OFFLOAD_MIN_BYTES):
        self.norms_recomputed, self.offload, self.min_bytes = norms_recomputed, offload, min_bytes
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
        if (state is None or not self.norms_recomputed or not torch.is_grad_enabled()
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


def apply_saved_activations(layers: Sequence[nn.Module], norms_recomputed: bool = False,
                            offload_spec: str | None = None, min_bytes: int = OFFLOAD_MIN_BYTES) -> SavedActivations:
    """--recompute-norms and --offload-layers SPEC on the decoder layers (see SavedActivations).

    norms_recomputed: every layer's norm outputs are recomputed in backward instead of kept.
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
    saved = SavedActivations(norms_recomputed, HostOffload() if offloaded else None, min_bytes)
    for i, layer in enumerate(layers):
        if not (norms_recomputed or offloaded):
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
