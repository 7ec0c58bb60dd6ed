"""Pinned host memory for what a step keeps: the stash a checkpointed layer's input travels in, and the
side-stream copies to and from pooled pinned buffers (playbook/memory/activations.py's docstring, "Offloaded
checkpoints", says how the copies are ordered and why they hide behind the compute).
"""

from __future__ import annotations

import weakref

import torch


class Stash:
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
    def stash(self, hidden: torch.Tensor) -> Stash:
        """Start copying `hidden` to a host buffer; the returned stash holds the GPU tensor until the
        caller's forward is done with it (`drop_gpu`), then only the host copy."""
        s = Stash()
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
    def drop_gpu(s: Stash) -> None:
        s.gpu = None

    # -- backward: fetch, and prefetch the next one ------------------------------------------------
    def _copy_back(self, s: Stash) -> None:
        """Queue the host-to-GPU copy of a stash (on the side stream): s.fetched = (tensor, event)."""
        gpu = torch.empty(s.shape, dtype=s.dtype, device=s.device)  # allocated on the compute stream
        s.fetched = (gpu, self.copy_to_device([(s.host, gpu)], s.device))
        s.host = None
        s.release()  # the buffer back to the pool: the next copy into it waits behind this one

    def fetch(self, s: Stash) -> torch.Tensor:
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
