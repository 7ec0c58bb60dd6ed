"""The whole training step as one CUDA graph: the host queues a step in about a millisecond, not hundreds.

Why: an eager step of the 8B model launches a few thousand kernels, and for each one Python walks the
module, the autograd engine and the launcher. A step takes at least the time its host needs to queue it
(the "host queue" figure of every run's summary), whatever the GPU: the larger that share of the step, the
less a faster GPU helps (docs/troubleshooting.md, "Is the step host-bound?", has the H200's figures). A CUDA
graph records the step's kernels once and replays them with one launch: forward, backward, gradient
clipping and the optimizer, for every micro-batch of the step.

What a graph needs, and what this module checks before it captures (`graph_blocker`):
  - fixed shapes and addresses: the batches are copied into static input tensors before each replay;
    synthetic, text and packed batches are [B, T] every step (packed rows' example boundaries have one
    length for the whole run: playbook/model/packed_attention.py). Right-padded rows with their padding mask
    are not: Hugging Face reads the 2-D mask on the host to pick the attention path (a host sync, which a
    graph cannot hold), so they run eagerly.
  - no host synchronisation inside the step: the loop's `.item()` happens after the replay.
  - an optimizer that keeps its step count and learning rate on the GPU: PyTorch's AdamW or the Triton
    AdamW (adamw_kernel.py) with `capturable=True` and the rate as a tensor, which `LRSchedule` fills in
    place each step.
  - one process: FSDP2's collectives are issued by hooks on the host each step.
  - no seed drawn on the host per step: NVFP4's stochastic rounding of the gradients (fp8_recipes_kernel.py)
    passes each quantizer launch a fresh seed from a host counter, which a replayed graph would freeze (the
    same random numbers every step), so NVFP4 runs, emulated or not, stay eager.
  - no programmatic dependent launch (Triton's `launch_pdl=True` and `gdc_wait`), which has made graph
    capture fail on Blackwell: no kernel here uses it, and tests/blackwell_test.py fails when one does
    (it would have to be switched off while a graph is captured). The capture itself asks nothing of
    the GPU generation: the same step is captured on Hopper and on every Blackwell.
A capture that fails anyway (an operation the checks did not foresee) is dropped, the step runs
eagerly, and the run says why in one line.

Memory: the step's intermediate tensors live in the graph's private pool, as they would in eager mode
(the peak is the eager peak); the gradients too, from the first backward of each step's capture (the
replayed backward writes them, as the first eager backward after `zero_grad(set_to_none=True)` does).
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.nn.functional as F

from core.fp8_support import get_recipe
from core.process import log, world
from playbook.memory import options
from playbook.model import packed_attention
from playbook.sections import RunConfig


def graph_blocker(cfg: RunConfig, data=None) -> str | None:
    """Why this run's step cannot be one CUDA graph (a short clause), or None when it can.
    data: the run's TrainData (its rows say whether batches carry a 2-D padding mask)."""
    if not cfg.on_gpu:
        return "no GPU"
    if cfg.training.cuda_graphs == "off":
        return "--cuda-graphs off"
    if world()[1] > 1:
        return "FSDP2 issues its collectives from host-side hooks each step"
    blocker = options.graph_blocker(options.values(cfg))  # copies to host memory under the host's control
    if blocker:
        return blocker
    if cfg.model.fp8 and cfg.model.fp8_backend == "playbook" and get_recipe(cfg.model.fp8_recipe).scaling == "nvfp4":
        return ("NVFP4 rounds each gradient stochastically with a seed the host draws per launch; a replayed graph "
                "would reuse the same random numbers every step")
    if cfg.model.load_in_4bit:
        return "--load-in-4bit: bitsandbytes' NF4 layers are not checked for capture"
    if data is None:
        return None
    if data.packing and data.attention.packed == "boundaries" and not data.attention.packed_kernel:
        return "packed rows' attention falls back to one SDPA call per example, which reads the boundaries on the host"
    if data.rows is not None and "attention_mask" in data.rows and not data.attention.causal_padding:  # with its mask
        return ("right-padded rows: Hugging Face reads their padding mask on the host to choose the attention "
                    "path (finetune_optimized.py leaves the redundant mask out; --packing gives rows a graph can take)")
    return None


@contextlib.contextmanager
def _capture_patches():
    """What the capture of an eager model runs under: transformers' causal skip, SDPA calls with a mask counted."""
    undo = packed_attention.install_causal_skip()
    try:
        with count_masked_attention() as masked:
            yield masked
    finally:
        undo()


@contextlib.contextmanager
def count_masked_attention():
    """Count the SDPA calls given an explicit mask (yields a one-element list, filled on the way)."""
    original, count = F.scaled_dot_product_attention, [0]

    def sdpa(*args, **kwargs):
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        count[0] += mask is not None
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield count
    finally:
        F.scaled_dot_product_attention = original


class GraphedStep:
    """`training_step` captured once, replayed every step after.

    step_fn(micro_batches) -> (loss, norm): the eager step (training.training_step bound to the model
    and optimizer). `example`: the micro-batches of one step, for the static inputs' shapes.

    The eager steps before the capture run on the capture's own side stream (`run`), as PyTorch's
    whole-network capture asks: autograd creates each parameter's gradient accumulator on the stream of
    the first backward that reaches it, and one made on the default stream would make the captured
    backward wait on that stream, which a capture cannot hold.
    """

    def __init__(self, step_fn, example: list[dict], compiled: bool = False):
        self.step_fn = step_fn
        # A torch.compile'd model runs the graphs Dynamo traced in the eager steps before the capture. Those
        # guard on the module globals they read: patching transformers' mask function or SDPA for the capture
        # (as an eager model needs) would fail the guards, and the recompilation, which synchronizes the GPU,
        # would fail the capture. The traced graphs already hold the eager steps' causal path (no mask).
        self.compiled = compiled
        self.static = [{k: v.clone() for k, v in b.items()} for b in example]
        self.stream = torch.cuda.Stream()
        self.graph = None
        self.outputs = None
        self.masked_attention = 0  # SDPA calls of the captured step that received an explicit mask
        self.capture_peak_bytes = 0  # torch.cuda.max_memory_allocated over the capture

    def run(self, micro_batches: list[dict], eager_fn):
        """The step: a replay once captured; before that, `eager_fn(micro_batches)` on the capture stream."""
        if self.graph is not None:
            return self.replay(micro_batches)
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = eager_fn(micro_batches)
        current.wait_stream(self.stream)
        return out

    def matches(self, micro_batches: list[dict]) -> bool:
        """Same keys, shapes and dtypes as the captured step."""
        if len(micro_batches) != len(self.static):
            return False
        return all(b.keys() == s.keys() and all(b[k].shape == s[k].shape and b[k].dtype == s[k].dtype for k in b)
                   for b, s in zip(micro_batches, self.static))

    def capture(self, optimizer) -> str | None:
        """Record the step. Returns None, or why the capture failed (the step then stays eager)."""
        torch.cuda.synchronize()
        optimizer.zero_grad(set_to_none=True)  # the captured backward creates the gradients in the graph's pool
        gc.collect()
        torch.cuda.empty_cache()  # the eager steps' cached blocks back to the driver: one pool, not two
        graph = torch.cuda.CUDAGraph()
        first_error = None
        # A replay allocates nothing: its tensors live in the graph's pool, allocated once, here. The peak of
        # the capture is the step's footprint (weights, optimizer state, gradients, activations); a peak
        # counted over replays alone would leave the activations out.
        torch.cuda.reset_peak_memory_stats()
        patches = contextlib.nullcontext([0]) if self.compiled else _capture_patches()
        try:
            with patches as masked, torch.cuda.graph(graph, stream=self.stream):
                try:
                    self.outputs = self.step_fn(self.static)
                except Exception as err:  # the first error says why; ending the capture then fails too
                    first_error = err
                    raise
        except Exception as err:  # noqa: BLE001  (any failure to capture leaves the run eager, with its reason)
            err = first_error or err
            text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
            reason = f"{type(err).__name__}: {text}" if text else type(err).__name__
        else:
            reason = None
        if reason is not None:
            # The failed graph owns a private memory pool with what the capture allocated (a capture that ran
            # out of memory holds nearly all of it). The exceptions' tracebacks keep this frame, and so the
            # graph, alive: drop them and the graph first, then hand the pool's blocks back to the driver, so
            # the eager steps that follow have the whole GPU again.
            self.outputs = None
            first_error = None
            del graph
            torch.cuda.synchronize()
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            return reason
        self.graph = graph
        self.capture_peak_bytes = torch.cuda.max_memory_allocated()
        self.masked_attention = masked[0]
        if masked[0] and not any("attention_mask" in b for b in self.static):
            log(f"CUDA graphs: {masked[0]} attention calls of the captured step received a mask although the batches "
                "have none (transformers built a causal mask under capture): attention runs its slower masked path")
        return None

    def replay(self, micro_batches: list[dict]):
        for static, batch in zip(self.static, micro_batches):
            for key, value in batch.items():
                static[key].copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs


def peak_bytes(graphed) -> int:
    """The run's peak allocated GPU memory since the last reset, the captured step's own footprint included."""
    peak = torch.cuda.max_memory_allocated()
    return max(peak, graphed.capture_peak_bytes) if graphed is not None and graphed.graph is not None else peak


def announce(blocker: str | None) -> None:
    log("CUDA graphs: the whole step (forward, backward, optimizer) is captured after the first step and replayed "
        "from then on" if blocker is None else f"CUDA graphs: off ({blocker}); each step is queued eagerly")
