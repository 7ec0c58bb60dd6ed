"""The memory plan: the peak memory a run will need, estimated from the model's config before it is built.

    $ python finetune_optimized.py --model llama-3.1-8b --batch-size 8
    Memory plan (estimated from the config, before the model is built; docs/memory.md#the-memory-plan):
      weights            16.06 GB  bf16, 8.03 B parameters
      gradients          16.06 GB  bf16, every parameter (freed after each step)
      optimizer states   32.12 GB  AdamW's two moments in bf16
      activations        58.05 GB  32 plain layers x 1.81 GB, 8 x 2048 tokens
      loss                4.30 GB  fused linear cross-entropy: 1 chunk of 16,384 tokens, the head's gradient
      peak              111.08 GB  at the loss: weights, optimizer states, activations, loss
      free               84.93 GB  NVIDIA H100 80GB HBM3: does not fit
    error: the plan needs 111.1 GB at its peak and the GPU has 84.9 GB free; ...

    $ python selfcheck.py --memory-table results/runs/*.json     # estimate against measured

Everything here is arithmetic on the config's numbers (hidden size, MLP width, layers, heads, vocabulary)
and the run's options: no model is built, no GPU memory is touched. `estimate(shape, setup)` is the pure
function; `check(cfg)` is what the scripts call once the command line is parsed (config.parse_config).

Where the peak comes from. A training step holds, besides the weights and AdamW's moments:
  - at the loss, the end of forward: every layer's saved activations and the loss's buffers;
  - in backward, layer by layer from the last: the gradients made so far, the saved activations of the
    layers below, and the working set of the layer in hand (a checkpointed layer's recompute, the
    gradients of its MLP's [N, I] tensors);
  - at the optimizer step: every gradient.
`estimate` walks these points and reports the largest. The bytes each layer keeps (docs/memory.md's
table) are counted per token from the config; three constants are fitted to measured peaks
(results/runs/, the table of `--table`), each named below with what it stands for.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from core import gpu_arch
from core.fp8_support import FP8_MIN_WIDTH, bf16_layer_counts, get_recipe
from core.process import is_main, log
from linear_cross_entropy_kernel import CHUNK_BYTES  # the fused head's logits buffer
from playbook.memory.activations import PREFETCH_LAYERS  # offloaded layers brought back ahead of backward
from playbook.memory.activations import parse_layers
from playbook.model.lora import parse_targets
from playbook.model.presets import PRESETS, weights_dtype
from playbook.optim.optimizer import rounding_of
from playbook.runtime import environment
from playbook.runtime.common import usage_error
from playbook.sections import RunConfig

GB = 1e9  # the scripts' summaries count GB as 10^9 bytes
FREE_MEMORY_ENV = environment.FREE_MEMORY_GB  # a stand-in for the free memory (tests, or planning for another GPU)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Fitted to the measured peaks (docs/memory.md#the-memory-plan):
MISC_BYTES_PER_TOKEN = 880  # per layer and token, beyond the tensors counted by name (RoPE's tables, small buffers)
FP8_WEIGHT_BYTES = 0.17  # per FP8 projection weight: the FP8 copies and scales a step keeps (full fine-tune)
FP8_TOKEN_BYTES = 0.5  # per token and hidden unit, in each FP8 layer: the inputs' FP8 copies and scales
HOST_LINK_BYTES = 9e9  # what --offload-layers moves to the host during a forward (H100, PCIe; docs/memory.md)

# Counted, not fitted:
OFFLOADED_INPUTS_ON_GPU = 3  # --offload-activations: the input in use, the one being fetched, the one being sent
DISTILL_FULL_BYTES = 56  # per logit: distill.py's baseline loss, counted op by op (distill.py's docstring)
HF_LOSS_BYTES = 12  # per logit: Hugging Face's fp32 log-softmax, its gradient and the gradient of the logits
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # bitsandbytes NF4: 4 bits, an 8-bit scale per 64, an fp32 one per 256 of those
# Bytes per value of one quantized copy with its block scales (mx_quant_kernel.py): MXFP8 an e4m3 byte and an
# e8m0 scale per 32 values; NVFP4 half a byte (packed e2m1) and an e4m3 scale per 16 values
QUANTIZED_BYTES = {"mx": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
# The peak bytes per value of an emulated recipe's dequantization (mx_quant_kernel.dequantize_*), all alive at
# once: MXFP8 the fp32 values, the fp32 scales repeated to every value, their fp32 product (12); NVFP4 the
# int64 codes of the e2m1 nibbles, their fp32 values and the uint8 nibbles they came from (13)
DEQUANTIZE_BYTES = {"mx": 12, "nvfp4": 13}
LORA_DEFAULT_RANK = 16


# ------------------------------------------------------------------------------------------------
# The model's numbers and the run's options
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """The numbers of a LLaMA-family config that decide its memory."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    positions: int | None = None  # the positions it was trained on (max_position_embeddings); None: not known

    @classmethod
    def from_config(cls, config, num_layers: int | None = None) -> "Shape":
        """From a Hugging Face config (an object or its dict); `num_layers` keeps the first N layers."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        layers = int(get("num_hidden_layers"))
        return cls(vocab=int(get("vocab_size")), hidden=hidden, intermediate=int(get("intermediate_size")),
                   layers=min(num_layers, layers) if num_layers else layers, heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or hidden // heads), tied=bool(get("tie_word_embeddings", False)),
                   positions=int(get("max_position_embeddings") or 0) or None)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def projection_sizes(self) -> dict:
        """(in, out) of each of a layer's seven projections."""
        h, i, q, kv = self.hidden, self.intermediate, self.q, self.kv
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def projection_params(self) -> int:  # per layer
        return sum(a * b for a, b in self.projection_sizes().values())

    @property
    def params(self) -> int:
        layer = self.projection_params + 2 * self.hidden  # and the two norms
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    def lora_params(self, r: int, targets) -> int:
        return self.layers * sum(r * (a + b) for name, (a, b) in self.projection_sizes().items() if name in targets)

    def fp8_groups(self, rule: str) -> list:
        """(in, out) of the matmuls per layer that FP8 converts: with rule 'auto', the groups that share an
        input (q/k/v, gate/up) and the others of harmonic width in x out / (in + out) >= FP8_MIN_WIDTH."""
        h, i, q, kv = self.hidden, self.intermediate, self.q, self.kv
        groups = ((h, q + 2 * kv), (q, h), (h, 2 * i), (i, h))
        return [(a, b) for a, b in groups if rule == "all" or a * b / (a + b) >= FP8_MIN_WIDTH]

    def fp8_params(self, rule: str) -> int:
        """Projection weights per layer that FP8 converts (`fp8_groups`)."""
        return sum(a * b for a, b in self.fp8_groups(rule))


@dataclass(frozen=True)
class Setup:
    """The options of a run that decide its memory (`setup_from`: from a RunConfig or a saved summary)."""

    batch: int
    seq: int
    grad_accum: int = 1
    lora_r: int = 0
    lora_targets: tuple = PROJECTIONS
    load_in_4bit: bool = False
    fp8: bool = False
    fp8_rule: str = "auto"  # --fp8-layers
    fp8_recipe: str = "rowwise"  # --fp8-recipe as the run names it ("nvfp4-emulated" under --fp8-emulate)
    layer_kinds: tuple = ()  # per decoder layer: "plain", "checkpointed" or "offloaded" (--offload-layers)
    offload_activations: bool = False
    keep_attention: bool = False
    recompute_norms: bool = False
    mlp_chunk: int = 0
    optimizer: str = "adamw-fused"
    rounding: str = "nearest"  # "nearest", "stochastic", "kahan" or "fp32-master"
    in_backward: bool = False
    kernels: str = "playbook"  # "playbook" (this project's kernels), "liger" (a peer's), "hf" (none)
    loss: str = "fused"  # "fused" (linear cross-entropy), "chunked" (cross-entropy kernel), "full" (fp32 logits)
    world: int = 1
    weight_bytes: int = 2  # bf16; 4 where a CPU trains in fp32
    trains: bool = True
    partial_kernels: bool = False  # a kernel set between none and the default one: estimated from the nearest

    @property
    def tokens(self) -> int:  # per micro-batch
        return self.batch * self.seq

    def fp8_layers(self, layers: int) -> int:
        """How many of the model's decoder layers run FP8 (the recipe keeps some at the ends in bf16)."""
        return max(0, layers - sum(bf16_layer_counts(self.fp8_recipe, layers))) if self.fp8 else 0


@dataclass
class Plan:
    """What `estimate` found: the parts in bytes, the peak, where it comes, and notes on the approximations."""

    parts: dict  # name -> (bytes, what)
    peak: float
    where: str
    notes: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# The estimate
# ------------------------------------------------------------------------------------------------
def layer_bytes(shape: Shape, s: Setup) -> dict:
    """Bytes per token one decoder layer keeps or works with (docs/memory.md's table, from the config).

    plain        what a layer that is not checkpointed saves for backward
    input        a checkpointed layer's input
    kept         --keep-attention: attention's output and softmax statistics
    mlp          the part of `plain` that the tiled MLP keeps per chunk instead ([N, 2I] gate and up)
    mlp_backward the MLP's backward: the gradients of its [N, I] tensors
    attention_backward  attention's backward: dq, dk, dv, the gradients of its output and the residual
    """
    h, i, q, kv, heads, w = shape.hidden, shape.intermediate, shape.q, shape.kv, shape.heads, s.weight_bytes
    lora = s.lora_r > 0
    if s.kernels == "playbook" or (s.kernels == "liger" and not lora):
        norms = 2 * w * h * (1 if s.recompute_norms else 2)  # each norm's input, and its output the projections read
        attention = w * (q + 2 * kv) + w * q + 4 * heads  # q, k, v; the output; the softmax statistics (fp32)
        mlp = 2 * w * i  # gate and up
        if s.kernels == "liger":  # its SwiGLU returns h = silu(gate) * up to a plain down_proj, which saves h
            mlp = 3 * w * i  # (this project's MLP recomputes h in backward instead)
    else:  # Hugging Face's modules, op by op
        if lora:  # frozen norm weights and projections save nothing; peft casts each adapter's input to fp32
            fused = s.kernels == "liger"  # Liger's norms keep their input, its SwiGLU gate and up
            norms = 2 * (w if fused else 4) * h
            sizes = shape.projection_sizes()
            casts = sum(4 * sizes[t][0] for t in s.lora_targets)
            attention = w * (2 * q + 2 * kv) + 4 * heads + casts
            mlp = (2 if fused else 3) * w * i
        else:  # each norm: its fp32 input, the normalized bf16 tensor, its output; o_proj's and down_proj's inputs
            norms = 2 * (4 * h + 2 * w * h)
            attention = w * (2 * q + 2 * kv) + w * q + 4 * heads
            mlp = 4 * w * i
    fp8 = FP8_TOKEN_BYTES * h if s.fp8 and not lora else 0
    if s.fp8 and not lora and get_recipe(s.fp8_recipe).scaling == "nvfp4":
        # NVFP4's layer keeps its bf16 input for backward (its scales are pairs save_for_backward does not take)
        # where the fitted recipes keep a 1-byte transposed copy with 1/32 byte of scales: about a byte more per
        # input value, in the layers that run FP8 (averaged over all layers: the recipe keeps its last ones bf16)
        inputs = sum(a for a, _ in shape.fp8_groups(s.fp8_rule))
        fp8 += (w - 1 - 1 / 32) * inputs * s.fp8_layers(shape.layers) / shape.layers
    plain = norms + attention + mlp + fp8 + MISC_BYTES_PER_TOKEN
    # The MLP's backward makes the gradients of gate, up and h; Liger's SwiGLU writes those of gate and up into
    # gate's and up's own storage, so a full fine-tune with it adds only h's gradient (with LoRA, peft's adapter
    # path around down_proj keeps the measured rows at three)
    mlp_backward = (1 if s.kernels == "liger" and not lora else 3) * w * i
    return {"plain": plain, "input": w * h, "kept": (w * q + 4 * heads) if s.keep_attention else 0, "mlp": mlp,
            "mlp_backward": mlp_backward, "attention_backward": w * (2 * q + 2 * kv + 2 * h)}


def loss_bytes(shape: Shape, s: Setup) -> tuple[float, str]:
    """The loss's buffers at their peak, and what they are."""
    n, v, h, w = s.tokens, shape.vocab, shape.hidden, s.weight_bytes
    head_trains = s.trains and not s.lora_r
    if s.loss == "full":
        return HF_LOSS_BYTES * n * v, f"fp32 logits of {n:,} tokens x {v:,}, their log-softmax and gradients"
    if s.loss == "distill-full":
        return DISTILL_FULL_BYTES * n * v, f"both models' fp32 logits of {n:,} tokens x {v:,} and the JSD's tensors"
    if s.loss == "distill-fused":  # the cross-entropy's pass, then the JSD's with the teacher's chunk beside it
        ce, _ = loss_bytes(shape, replace(s, loss="fused"))
        chunk = min(n, max(128, CHUNK_BYTES // (v * 2) // 128 * 128))
        return 2 * ce + chunk * v * 2, "fused cross-entropy and JSD, a chunk of the teacher's logits beside"
    if s.loss == "chunked":
        return 2 * n * v * 2 + n * h * w, f"the logits of {n:,} tokens x {v:,} and their gradient"
    acc = v * h * 4 if head_trains else 0
    if n * v * 2 <= CHUNK_BYTES + acc:
        chunk, acc = n, 0
    else:
        chunk = min(n, max(128, CHUNK_BYTES // (v * 2) // 128 * 128))
    total = n * h * w + chunk * v * 2 + acc + (v * h * w if head_trains else 0)
    chunks = math.ceil(n / chunk)
    what = (f"fused linear cross-entropy: {chunks} chunk{'s' if chunks > 1 else ''} of {chunk:,} tokens"
            + (", the head's gradient" if head_trains else "") + (" and its fp32 sum" if acc else ""))
    return total, what


def _weights(shape: Shape, s: Setup, lora: bool) -> tuple[float, int, int, str]:
    """(weight bytes, trained parameters, bytes of one parameter's gradient and of each optimizer moment, what
    the weights are): the whole model in its dtype, or a LoRA run's frozen base (NF4 or FP8 projections where
    asked) with its fp32 adapters; FP8 training adds its weight copies."""
    w, L = s.weight_bytes, shape.layers
    if lora:
        base_proj = shape.projection_params * L
        if s.load_in_4bit:
            proj_bytes, kind = base_proj * NF4_BYTES, "the projections in NF4"
        elif s.fp8:
            fp8_layers = s.fp8_layers(L)
            per_layer = shape.fp8_params("all")
            quantized = fp8_layers * per_layer
            proj_bytes = quantized * frozen_fp8_bytes(s.fp8_recipe) + (base_proj - quantized) * w
            kind = f"the projections of {fp8_layers} layers in {_format(s.fp8_recipe)}"
        else:
            proj_bytes, kind = base_proj * w, ""
        adapters = shape.lora_params(s.lora_r, s.lora_targets)
        weights = (shape.params - base_proj) * w + proj_bytes + adapters * 4
        trained, state_bytes = adapters, 4  # the adapters train in fp32
        what = f"{_dtype(w)} base{', ' + kind if kind else ''}; {adapters / 1e6:,.1f} M adapter parameters in fp32"
    else:
        weights, trained, state_bytes = shape.params * w, shape.params, w
        what = f"{_dtype(w)}, {shape.params / 1e9:.2f} B parameters"
        if s.fp8 and s.trains:
            fp8_layers = s.fp8_layers(L)
            weights += FP8_WEIGHT_BYTES * fp8_layers * shape.fp8_params(s.fp8_rule)
            what += f", FP8 copies for {fp8_layers} layers"
    return weights, trained, state_bytes, what


def frozen_fp8_bytes(recipe: str) -> float:
    """Bytes per parameter of LoRA's frozen base kept quantized (fp8_lora_kernel.py): a row-scaled recipe one
    e4m3 copy (its per-row scales are negligible); MXFP8 and NVFP4 two copies, along K and along N, each
    with its block scales (a block scale cannot be folded into the other operand as a row scale can)."""
    scaling = get_recipe(recipe).scaling
    return 2 * QUANTIZED_BYTES[scaling] if scaling in QUANTIZED_BYTES else 1


def emulated_work(shape: Shape, s: Setup) -> float:
    """The largest working set of an emulated block-scaled matmul in backward (`--fp8-emulate`,
    fp8_recipes_kernel.Float8ScaledLinearFunction): dy's two quantized copies and the weight's transposed one,
    then each operand of dx = dy W and of dW = dy^T x dequantized to fp32 (DEQUANTIZE_BYTES while it is
    made, 4 bytes per value after) and cast to bf16 for the product; 0 where the matmuls are native. LoRA's
    frozen base (fp8_lora_kernel.BlockScaledFrozenLinear) keeps its weight's copies and makes only dx."""
    if not (s.fp8 and s.trains and get_recipe(s.fp8_recipe).emulated and s.fp8_layers(shape.layers)):
        return 0
    recipe = get_recipe(s.fp8_recipe)
    n, copy, deq = s.tokens, QUANTIZED_BYTES[recipe.scaling], DEQUANTIZE_BYTES[recipe.scaling]

    def product(a: int, b: int) -> float:  # a @ b.T from quantized operands of a and b values
        return max(deq * a, 4 * a + deq * b, (4 + 2) * (a + b))

    if s.lora_r:
        groups = shape.fp8_groups("all")
        return max(copy * n * out + product(n * out, k * out) for k, out in groups)
    return max(copy * (2 * n * out + k * out) + max(product(n * out, k * out), product(out * n, k * n))
               for k, out in shape.fp8_groups(s.fp8_rule))


def estimate(shape: Shape, s: Setup) -> Plan:
    """The plan of one run: every part in bytes and the peak over the step's points (module docstring)."""
    n, w, L = s.tokens, s.weight_bytes, shape.layers
    kinds = s.layer_kinds or ("plain",) * L
    notes = []
    lora = s.lora_r > 0 and s.trains
    weights, trained, state_bytes, what = _weights(shape, s, lora)
    if not s.trains:
        trained = 0
    grads = trained * state_bytes
    states = 2 * trained * state_bytes
    states_what = f"AdamW's two moments in {_dtype(state_bytes)}"
    if s.rounding == "kahan":
        states += trained * 2
        states_what += ", the Kahan compensation in bf16"
    elif s.rounding == "fp32-master":
        states += trained * 4
        states_what += ", the fp32 master weights"
    world = max(1, s.world)
    if world > 1:  # FSDP2 shards all three; a layer's weights are gathered whole while it runs
        weights, grads, states = weights / world, grads / world, states / world
        gathered = 2 * (shape.projection_params + 2 * shape.hidden) * w + shape.vocab * shape.hidden * w
        weights += gathered
        what += f", 1/{world} of them per GPU and 2 layers and the head gathered whole"
    static = weights + states
    layer_grads = (shape.projection_params + 2 * shape.hidden) * w / world if not lora else 0
    head_grads = (grads - L * layer_grads) if not lora else grads
    if s.in_backward:  # each gradient is used and dropped as backward makes it
        layer_grads_kept, head_kept = 0, 0
    else:
        layer_grads_kept, head_kept = layer_grads, head_grads
    persistent = grads if s.grad_accum > 1 else 0  # the micro-batches after the first add to the kept gradients

    # activations: per layer, what stays on the GPU from forward to backward
    b = layer_bytes(shape, s)
    tiled = s.mlp_chunk and s.mlp_chunk < n
    plain = b["plain"] - (b["mlp"] if tiled else 0)
    kept = {"plain": plain * n, "checkpointed": (b["input"] + b["kept"]) * n, "offloaded": plain * n}
    on_gpu = [kept[k] for k in kinds]
    checkpointed = [j for j, k in enumerate(kinds) if k == "checkpointed"]
    offloaded = [j for j, k in enumerate(kinds) if k == "offloaded"]
    if s.offload_activations and checkpointed:  # their inputs wait in host memory, but for a few
        for j in checkpointed:
            on_gpu[j] = b["kept"] * n
        resident_inputs = min(len(checkpointed), OFFLOADED_INPUTS_ON_GPU) * b["input"] * n
    else:
        resident_inputs = 0
    moved = min(sum(on_gpu[j] for j in offloaded), HOST_LINK_BYTES)
    activations = sum(on_gpu) + resident_inputs - moved
    chunk = min(n, s.mlp_chunk) if tiled else n
    mlp_work = (b["mlp_backward"] + (b["mlp"] if tiled else 0)) * chunk
    if tiled and not lora:
        mlp_work += 4 * 3 * shape.hidden * shape.intermediate  # the MLP's weight gradients summed in fp32
    work = max(mlp_work, b["attention_backward"] * n)
    emulated = emulated_work(shape, s)  # in the layers that run FP8, between the recipe's bf16 ends
    first, last = bf16_layer_counts(s.fp8_recipe, L) if s.fp8 else (0, 0)
    loss, loss_what = loss_bytes(shape, s)
    grad_out = n * shape.hidden * w  # the gradient flowing down the residual stream

    points = {"at the loss": static + persistent + activations + loss}
    if s.trains:
        # backward, layer i from the last: gradients made so far, the layers below, the layer in hand
        for i in reversed(range(L)):
            below = sum(on_gpu[:i])
            if offloaded:  # offloaded layers below come back a few layers ahead
                below -= sum(on_gpu[j] for j in offloaded if j < i - PREFETCH_LAYERS)
            own = plain * n if kinds[i] != "checkpointed" else plain * n - b["kept"] * n + on_gpu[i]
            made = max(persistent, head_kept + (L - 1 - i) * layer_grads_kept) + layer_grads
            extra = emulated if first <= i < L - last else 0
            points[f"in backward, layer {i}"] = static + made + below + resident_inputs + own + work + extra + grad_out
        step_extra = grads if s.optimizer == "adamw-foreach" and not s.in_backward else 0  # foreach's temporaries
        points["at the optimizer step"] = static + (grads if not s.in_backward else layer_grads) + step_extra
    where = max(points, key=points.get)
    peak = points[where]
    if where.startswith("in backward"):
        where = "in backward" + (" (the last layer first)" if where.endswith(f"layer {L - 1}") else
                                 " (the first layers, with the gradients of the others)")
    parts = {"weights": (weights, what)}
    if s.trains:
        parts["gradients"] = (grads, _grads_what(s, lora, state_bytes))
        parts["optimizer states"] = (states, states_what)
    parts["activations"] = (activations, _activations_what(shape, s, kinds, plain * n))
    parts["loss"] = (loss, loss_what)
    if s.partial_kernels:
        notes.append("estimated for this kernel set from the nearest one measured (docs/memory.md)")
    return Plan(parts=parts, peak=peak, where=where, notes=notes)


def _format(recipe: str) -> str:
    """The number format a recipe keeps a frozen weight in, as the plan names it."""
    return {"mx": "MXFP8 (two copies)", "nvfp4": "NVFP4 (two copies)"}.get(get_recipe(recipe).scaling, "FP8")


def _dtype(nbytes: int) -> str:
    return {1: "fp8", 2: "bf16", 4: "fp32"}.get(nbytes, f"{nbytes}-byte")


def _grads_what(s: Setup, lora: bool, nbytes: int) -> str:
    what = f"{_dtype(nbytes)}, " + ("the adapters only" if lora else "every parameter")
    if s.in_backward:
        return what + " (--optimizer-in-backward: one at a time)"
    return what + (" (kept across the micro-batches)" if s.grad_accum > 1 else " (freed after each step)")


def _activations_what(shape: Shape, s: Setup, kinds, plain_bytes: float) -> str:
    counts = {k: kinds.count(k) for k in ("plain", "checkpointed", "offloaded") if kinds.count(k)}
    text = ", ".join(f"{c} {k}" for k, c in counts.items()) + " layers"
    if counts.get("plain") == len(kinds):
        text = f"{len(kinds)} plain layers x {plain_bytes / GB:.2f} GB"
    extras = [flag for flag, on in (("inputs on the host", s.offload_activations), ("attention kept", s.keep_attention),
                                    ("norms recomputed", s.recompute_norms),
                                    (f"MLP in chunks of {s.mlp_chunk:,}", s.mlp_chunk)) if on]
    return text + (f" ({', '.join(extras)})" if extras else "") + f", {s.batch} x {s.seq} tokens"


# ------------------------------------------------------------------------------------------------
# Options that would fit
# ------------------------------------------------------------------------------------------------
MAX_INT = 2**31 - 1  # the largest count or size an option takes (config.MAX_INT): an offer never goes past it
MEMORY_OPTIONS = "memory"  # an Offer's kind: it trains the same model the same way, in less memory
OTHER_TRAINING = "other"  # trains something else: adapters instead of the weights, a quantized base, other kernels
SIZE = "size"  # fewer tokens per micro-batch


@dataclass(frozen=True)
class Offer:
    """An option the plan offers where a run does not fit, and the run it makes.

    text     as the error line names it
    add      the command-line words it gives; drop: the flags it takes out (with their values)
    script   another script to run it with (the baseline's way to this project's kernels); None: the same one
    changes  the RunConfig's fields as the command line, so changed, makes them
    variants further changes that command line may make as well (an --optimizer default that the flags dropped
             had set): each is planned, and the offer's peak is the largest
    kind     MEMORY_OPTIONS, OTHER_TRAINING or SIZE
    peak     the peak the run it makes plans, as it starts (a rounding left open chosen as start() chooses it)"""

    text: str
    add: tuple = ()
    drop: tuple = ()
    script: str | None = None
    changes: dict = field(default_factory=dict)
    variants: tuple = ()
    kind: str = MEMORY_OPTIONS
    peak: float = math.inf


def offers(cfg: RunConfig, free: float, where: str = "") -> list[Offer]:
    """The options that bring this run's peak under `free`, each planned as the run it makes will start (its
    config changed as its command line would change it, every model the run holds, the rounding start() would
    choose), closest to this run first: each option alone, the memory options together where none alone fits,
    the largest batch that fits (its --grad-accum keeping the tokens of a step), else the longest sequence.
    None is a command the script refuses, and none proposes a --seq-len past the positions the model was
    trained on. `cfg`: the run as its command line gave it (optimizer_rounding "auto" where left open)."""
    plans = run_plans(cfg)
    if not plans:
        return []
    single = [planned(cfg, o, free, where) for o in _options(cfg, plans[-1][1], plans[-1][2])]
    fits = [o for o in single if o.peak <= free]
    if not [o for o in fits if o.kind == MEMORY_OPTIONS]:
        together = _together([o for o in single if o.kind == MEMORY_OPTIONS])
        if together is not None:
            together = planned(cfg, together, free, where)
            if together.peak <= free:
                fits.append(together)
    size = _smaller_run(cfg, plans[-1][1], free, where)
    if size is not None:
        fits.append(size)
    return sorted(fits, key=lambda o: -o.peak)  # the closest to this run first


def planned(cfg: RunConfig, offer: Offer, free: float, where: str) -> Offer:
    """The offer with its peak: the largest of the runs its command line may make."""
    peaks = [peak_as_run(cfg.changed(**{**offer.changes, **variant}), free, where)
             for variant in ({}, *offer.variants)]
    return replace(offer, peak=max(peaks))


def peak_as_run(cfg: RunConfig, free: float, where: str) -> float:
    """The peak of the plan the run of `cfg` will print as it starts: a rounding left open ("auto") chosen as
    start() chooses it, for the free memory `free` (`where`: where that figure comes from)."""
    if cfg.training.optimizer_rounding == "auto":
        cfg = replace(cfg, training=replace(cfg.training, optimizer_rounding=_rounding(cfg, free, where)[0]))
    plans = run_plans(cfg)
    return combine(plans).peak if plans else math.inf


def _refuses(cfg: RunConfig, dest: str) -> bool:
    """Whether the script refuses the shared option `dest` (distill.py refuses --grad-accum, for one): its own
    section of the RunConfig lists those it refuses as `refused_options`."""
    return cfg.extra is not None and dest in cfg.extra.refused_options


def _explicit_rounding(cfg: RunConfig) -> list[str]:
    """The flags of the command line that set how the Triton AdamW rounds (a rounding start() chose is not one)."""
    flags = []
    if cfg.training.optimizer_rounding in ("stochastic", "kahan"):
        flags.append(f"--optimizer-rounding {cfg.training.optimizer_rounding}")
    if cfg.training.master_weights == "fp32":
        flags.append("--master-weights fp32")
    return flags


def _default_optimizer(cfg: RunConfig, kernels) -> str:
    """--optimizer as config.parse_config chooses it where the command line names none and no rounding flag
    implies the Triton AdamW."""
    if not cfg.on_gpu:
        return "adamw-foreach"
    own = cfg.run.defaults is None or cfg.run.defaults.own_optimizer
    return "adamw-triton" if "adamw" in kernels and own else "adamw-fused"


def _options(cfg: RunConfig, shape: Shape, s: Setup) -> list[Offer]:
    """Each option alone that needs less memory than this run, as the command line takes it (config.py's
    refusals: an option that clashes with one already given is offered with that one dropped, or not at all)."""
    from core.process import world

    found = []
    plain = "plain" in (s.layer_kinds or ("plain",))
    # The roundings that keep small updates in less memory than the run's (start() chooses kahan only where
    # it fits, so a run that stops was given its rounding)
    if cfg.training.master_weights == "fp32":
        for rounding in ("kahan", "stochastic"):
            found.append(Offer(f"--optimizer-rounding {rounding} instead of --master-weights fp32",
                               add=("--optimizer-rounding", rounding), drop=("--master-weights",),
                               changes=dict(master_weights="none", optimizer_rounding=rounding)))
    if cfg.training.optimizer_rounding == "kahan":
        found.append(Offer("--optimizer-rounding stochastic instead of kahan",
                           add=("--optimizer-rounding", "stochastic"), drop=("--optimizer-rounding",),
                           changes=dict(optimizer_rounding="stochastic")))
    if plain and not cfg.memory.offload_layers:  # (--gradient-checkpointing with --offload-layers is refused)
        if cfg.memory.checkpoint_layers is None:
            found.append(Offer("--gradient-checkpointing", add=("--gradient-checkpointing",),
                               changes=dict(gradient_checkpointing=True, checkpoint_layers="all")))
        else:
            found.append(Offer(f"--gradient-checkpointing instead of --checkpoint-layers {cfg.memory.checkpoint_layers}",
                               add=("--gradient-checkpointing",), drop=("--checkpoint-layers",),
                               changes=dict(gradient_checkpointing=True, checkpoint_layers="all")))
    elif cfg.memory.checkpoint_layers and not cfg.memory.offload_activations and cfg.on_gpu:  # (on a CPU the host holds both)
        found.append(Offer("--offload-activations", add=("--offload-activations",),
                           changes=dict(offload_activations=True)))
    if cfg.memory.keep_attention:
        found.append(Offer("no --keep-attention", drop=("--keep-attention",), changes=dict(keep_attention=False)))
    if not cfg.memory.mlp_chunk_tokens and s.tokens > 16384:
        found.append(Offer("--mlp-chunk-tokens 16384", add=("--mlp-chunk-tokens", "16384"),
                           changes=dict(mlp_chunk_tokens=16384)))
    if s.kernels == "playbook" and not cfg.memory.recompute_norms and plain and not cfg.model.compile:
        found.append(Offer("--recompute-norms", add=("--recompute-norms",), changes=dict(recompute_norms=True)))
    if (not cfg.model.lora_r and not cfg.training.optimizer_in_backward and cfg.training.grad_accum == 1
        and cfg.training.max_grad_norm is None
            and world()[1] == 1 and (cfg.run.defaults is None or cfg.run.defaults.own_optimizer)
            and not _refuses(cfg, "optimizer_in_backward")):
        found.append(Offer("--optimizer-in-backward", add=("--optimizer-in-backward",),
                           changes=dict(optimizer_in_backward=True)))
    if not cfg.model.lora_r:
        given = _explicit_rounding(cfg)  # LoRA's fp32 adapters lose nothing to rounding: refused with them
        default = _default_optimizer(cfg, cfg.model.kernels)
        found.append(Offer(f"--lora-r {LORA_DEFAULT_RANK}" + (f" without {' and '.join(given)}" if given else ""),
                           add=("--lora-r", str(LORA_DEFAULT_RANK)),
                           drop=tuple(flag.split()[0] for flag in given),
                           changes=dict(lora_r=LORA_DEFAULT_RANK, optimizer_rounding="nearest", master_weights="none"),
                           variants=({"optimizer": default},) if given and default != cfg.training.optimizer else (),
                           kind=OTHER_TRAINING))
    elif not cfg.model.load_in_4bit and not cfg.model.fp8 and not cfg.model.merge_lora:  # (--merge-lora: a quantized base is refused)
        if not cfg.on_gpu or _capability(cfg.run.device) >= (8, 9):
            found.append(Offer("--fp8 (the frozen projections in FP8)", add=("--fp8",), changes=dict(fp8=True),
                               kind=OTHER_TRAINING))
        if importlib.util.find_spec("bitsandbytes") is not None:
            found.append(Offer("--load-in-4bit", add=("--load-in-4bit",), changes=dict(load_in_4bit=True),
                               kind=OTHER_TRAINING))
    if (s.kernels != "playbook" or s.loss != "fused") and cfg.extra is None:  # (distill.py's losses: --mode)
        from playbook.model.registry import parse_kernels

        kernels = tuple(parse_kernels("default"))
        baseline = cfg.run.defaults is not None and cfg.run.defaults.huggingface_attention  # (it has no --kernels)
        default = _default_optimizer(cfg, kernels)
        variants = ()
        if default == "adamw-triton" and cfg.training.optimizer != default:  # its default where --optimizer is not given
            variants = ({"optimizer": default, "optimizer_rounding": "auto" if not cfg.model.lora_r and
                         cfg.training.master_weights == "none" else cfg.training.optimizer_rounding},)
        found.append(Offer("finetune_optimized.py (this project's kernels)" if baseline
                           else "--kernels default (this project's kernels)",
                           add=("--kernels", "default"), drop=("--kernels",),
                           script="finetune_optimized" if baseline else None, changes=dict(kernels=kernels),
                           variants=variants, kind=OTHER_TRAINING))
    return found


def _capability(device) -> tuple:
    return tuple(gpu_arch.device_capability(device))


def _together(memory: list[Offer]) -> Offer | None:
    """The memory options together, where none alone fits (the rounding that needs none rather than kahan,
    no --recompute-norms once every layer is checkpointed)."""
    names, add, drop, changes = [], [], [], {}
    for o in memory:
        if o.text.startswith("--optimizer-rounding kahan") or (
                o.text == "--recompute-norms" and "gradient_checkpointing" in changes):
            continue
        names.append(o.text)
        add += o.add
        drop += [f for f in o.drop if f not in drop]
        changes.update(o.changes)
    if len(names) < 2:
        return None
    return Offer("together: " + ", ".join(names), add=tuple(add), drop=tuple(drop), changes=changes)


def _smaller_run(cfg: RunConfig, shape: Shape, free: float, where: str) -> Offer | None:
    """The run with fewer tokens per micro-batch that fits, closest to this one: the model's positions where
    --seq-len goes past them; else the largest --batch-size (with --grad-accum keeping the tokens of a step,
    where the batch divides and the script takes it); else at --batch-size 1 the longest --seq-len, never past
    the model's positions."""
    positions = shape.positions
    if positions and cfg.data.seq_len > positions:
        text = f"--seq-len {positions} (the {positions:,} positions {trained_model(cfg)} was trained on)"
        o = planned(cfg, Offer(text, add=("--seq-len", str(positions)), drop=("--seq-len",),
                               changes=dict(seq_len=positions), kind=SIZE), free, where)
        if o.peak <= free:
            return o
    for batch in _halves(cfg.data.batch_size):
        accum = cfg.training.grad_accum * cfg.data.batch_size // batch
        keep = (cfg.data.batch_size % batch == 0 and accum <= MAX_INT and not cfg.training.optimizer_in_backward
                and not _refuses(cfg, "grad_accum"))
        words = ("--batch-size", str(batch)) + (("--grad-accum", str(accum)) if keep else ())
        o = planned(cfg, Offer(" ".join(words), add=words, drop=("--batch-size", "--grad-accum") if keep
                               else ("--batch-size",), changes=dict(batch_size=batch, **({"grad_accum": accum} if keep
                                                                                         else {})), kind=SIZE),
                    free, where)
        if o.peak <= free:
            return o
    for seq in _shorter(cfg.data.seq_len, positions):
        words = (("--batch-size", "1") if cfg.data.batch_size > 1 else ()) + ("--seq-len", str(seq))
        o = planned(cfg, Offer(" ".join(words), add=words, drop=tuple(w for w in words if w.startswith("--")),
                               changes=dict(batch_size=1, seq_len=seq), kind=SIZE), free, where)
        if o.peak <= free:
            return o
    return None


def trained_model(cfg: RunConfig) -> str:
    """The model a run trains: --model, or distill.py's student."""
    return (cfg.extra is not None and cfg.extra.student) or cfg.model.model


def _halves(n: int):
    while n > 1:
        n //= 2
        yield n


def _shorter(seq: int, positions: int | None):
    """Sequence lengths below `seq`, longest first: the model's positions where `seq` is past them, then the
    powers of two below both."""
    top = seq - 1
    if positions and top >= positions:
        yield positions
        top = positions - 1
    power = 1 << (top.bit_length() - 1) if top >= 1 else 0
    while power >= 1:
        yield power
        power //= 2


# ------------------------------------------------------------------------------------------------
# From a run's configuration
# ------------------------------------------------------------------------------------------------
def setup_from(values: dict, shape: Shape, world: int = 1, weight_bytes: int = 2, trains: bool = True) -> Setup:
    """A Setup from a RunConfig's fields (`cfg.as_dict()`, or the `config` of a saved summary)."""
    kernels = tuple(values.get("kernels") or ())
    L = shape.layers

    def layers(spec):
        if not spec:
            return set()
        try:
            return set(parse_layers(spec, L))
        except ValueError:  # (the command line checked the SPEC against --num-layers, the model does later)
            return set()

    checkpointed = layers(values.get("checkpoint_layers") or ("all" if values.get("gradient_checkpointing") else None))
    offloaded = layers(values.get("offload_layers"))
    kinds = tuple("checkpointed" if j in checkpointed else "offloaded" if j in offloaded else "plain" for j in range(L))
    if "liger" in kernels:
        layer_kind = "liger"
    else:
        layer_kind = "hf" if not ({"rmsnorm", "swiglu"} & set(kernels)) else "playbook"
    loss = ("fused" if "linear_cross_entropy" in kernels or "liger" in kernels else
            "chunked" if "cross_entropy" in kernels else "full")
    recipe = values.get("fp8_recipe") or ""
    rounding = rounding_of(values.get("master_weights"), values.get("optimizer_rounding"))

    lora_r = int(values.get("lora_r") or 0)
    return Setup(
        batch=int(values["batch_size"]), seq=int(values["seq_len"]), grad_accum=int(values.get("grad_accum") or 1),
        lora_r=lora_r, lora_targets=tuple(parse_targets(values.get("lora_targets") or "all")),
        load_in_4bit=bool(values.get("load_in_4bit")), fp8=bool(values.get("fp8")),
        fp8_rule=values.get("fp8_layers") or "auto", fp8_recipe=recipe or "rowwise",
        layer_kinds=kinds, offload_activations=bool(values.get("offload_activations")),
        keep_attention=bool(values.get("keep_attention")), recompute_norms=bool(values.get("recompute_norms")),
        mlp_chunk=int(values.get("mlp_chunk_tokens") or 0), optimizer=values.get("optimizer") or "adamw-fused",
        rounding=rounding, in_backward=bool(values.get("optimizer_in_backward")), kernels=layer_kind, loss=loss,
        world=world, weight_bytes=weight_bytes, trains=trains,
        partial_kernels=bool(kernels) and "liger" not in kernels and not _full_set(kernels))


def _full_set(kernels) -> bool:
    return {"rmsnorm", "linear_cross_entropy", "swiglu"} <= set(kernels)


# The real model's shape as its GGUF header gives it (tests/memory_plan_test.py checks the two agree where the
# file is installed): a plan for it before the file is installed or converted.
KNOWN_SHAPES = {"smollm2-135m": dict(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3,
                                     head_dim=64, tied=True, positions=8192)}


def _known_shape(name: str, num_layers: int | None) -> Shape | None:
    known = KNOWN_SHAPES.get(name.lower())
    if known is None:
        return None
    return replace(Shape(**known), layers=min(num_layers or known["layers"], known["layers"]))


def model_shape(name: str, num_layers: int | None = None) -> Shape | None:
    """The Shape of --model NAME from what is on this machine (a preset, a local directory, a GGUF file,
    the Hugging Face cache); None where its config is not here yet (it comes with the weights)."""
    if name in PRESETS:
        return Shape.from_config(PRESETS[name], num_layers)
    try:
        from playbook.model import pretrained

        if pretrained.is_pretrained_name(name):
            folder = pretrained.cached_directory(name)
            if (folder / "config.json").is_file():
                return Shape.from_config(json.loads((folder / "config.json").read_text()), num_layers)
            try:
                return _gguf_shape(pretrained.gguf_file(name), num_layers)
            except (OSError, ValueError, KeyError, TypeError, SystemExit, ImportError):
                return _known_shape(name, num_layers)  # its file is not installed here (yet)
        local = Path(name).expanduser()
        if local.is_dir():
            return Shape.from_config(json.loads((local / "config.json").read_text()), num_layers)
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            return Shape.from_config(json.loads(Path(cached).read_text()), num_layers)
    except (OSError, ValueError, KeyError, TypeError, SystemExit, ImportError):
        return None
    return None


def _gguf_shape(path: Path, num_layers: int | None) -> Shape | None:
    """A GGUF file's architecture from its metadata (the gguf package reads the header, not the weights)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(key):
        f = reader.fields.get(key)
        return None if f is None else f.parts[f.data[0]].tolist()[0]

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    hidden, heads = value(f"{arch}.embedding_length"), value(f"{arch}.attention.head_count")
    return Shape.from_config({
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data), "hidden_size": hidden,
        "intermediate_size": value(f"{arch}.feed_forward_length"), "num_hidden_layers": value(f"{arch}.block_count"),
        "num_attention_heads": heads, "num_key_value_heads": value(f"{arch}.attention.head_count_kv"),
        "head_dim": value(f"{arch}.attention.key_length") or hidden // heads,
        "max_position_embeddings": value(f"{arch}.context_length"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}, num_layers)


GPU_FREE = "free on "  # free_memory's `where` on a GPU: "free on <its name>"
HOST_AVAILABLE = "available on the host (MemAvailable)"
CGROUP_LIMIT = "this process's memory limit (cgroup)"
PROCESS_LIMIT = "this process's memory limit"


def free_memory(device) -> tuple[float, str]:
    """(bytes free, where): the GPU's free memory (torch.cuda.mem_get_info), the host's MemAvailable on a
    CPU, or the stand-in of PLAYBOOK_FREE_MEMORY_GB (a value it cannot take: environment.BadValue, a ValueError
    holding the line that says so). `where` names the figure's source, as the plan's table shows it (said_free:
    as a sentence)."""
    stand_in = environment.free_memory_gb()
    if stand_in is not None:
        return stand_in * GB, f"{FREE_MEMORY_ENV}={shlex.quote(os.environ[FREE_MEMORY_ENV].strip())}"
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"{GPU_FREE}{torch.cuda.get_device_name(device)}"
    from playbook.runtime.common import host_memory_limit

    limit = host_memory_limit()  # a container's or job's cgroup limit, where lower than the RAM
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = float(line.split()[1]) * 1024
                if limit is not None and limit < available:
                    return float(limit), CGROUP_LIMIT
                return available, HOST_AVAILABLE
    except OSError:
        pass
    if limit is not None:
        return float(limit), PROCESS_LIMIT
    return math.inf, "on the host (unknown)"


def _free(device) -> tuple[float, str]:
    """free_memory for the plan's own lines: a stand-in it cannot take ends the run with that line, exit code 2."""
    try:
        return free_memory(device)
    except environment.BadValue as err:
        raise environment.refused(err) from None


def said_free(free: float, where: str) -> str:
    """The free memory in a sentence that names where the figure comes from (free_memory's `where`):
    "PLAYBOOK_FREE_MEMORY_GB=2.4 says this machine has 2.4 GB free", "the GPU has 79.1 GB free (NVIDIA H100 ...)"."""
    amount = f"{gb_text(free)} GB"
    if where.startswith(f"{FREE_MEMORY_ENV}="):
        return f"{where} says this machine has {amount} free"
    if where.startswith(GPU_FREE):
        return f"the GPU has {amount} free ({where[len(GPU_FREE):]})"
    if where == HOST_AVAILABLE:
        return f"this machine has {amount} available (MemAvailable)"
    if where in (CGROUP_LIMIT, PROCESS_LIMIT):
        return f"this process may use {amount} ({where.replace('this process', 'its')})"
    return f"{amount} {where}"


def gb_text(nbytes: float) -> str:
    """Bytes as GB in the messages: one decimal from 1 GB up, two significant digits below (0.45, 0.0034), so
    that a small plan or stand-in does not read as 0.0."""
    value = nbytes / GB
    return f"{value:,.1f}" if value >= 0.95 or value == 0 else f"{value:.2g}"


def format_plan(plan: Plan, free: float, where_free: str) -> str:
    lines = ["Memory plan (estimated from the config, before the model is built; docs/memory.md#the-memory-plan):"]
    width = max(len(name) for name in plan.parts)
    smallest = min(plan.peak, free) / GB
    decimals = 2 if smallest >= 0.1 or smallest == 0 else 4  # a tiny model's plan in MB-sized GB, not 0.00
    for name, (nbytes, what) in plan.parts.items():
        lines.append(f"  {name:<{width}} {nbytes / GB:8.{decimals}f} GB  {what}")
    lines.append(f"  {'peak':<{width}} {plan.peak / GB:8.{decimals}f} GB  {plan.where}")
    if math.isfinite(free):
        verdict = (f"fits, {(free - plan.peak) / GB:.{decimals}f} GB to spare" if plan.peak <= free
                   else "does not fit")
        lines.append(f"  {'free':<{width}} {free / GB:8.{decimals}f} GB  {where_free}: {verdict}")
    lines += [f"  ({note})" for note in plan.notes]
    return "\n".join(lines)


def run_plans(cfg: RunConfig) -> list[tuple[str, Shape, Setup]]:
    """(title, Shape, Setup) of each model the run holds at once: the model it fine-tunes, or distill.py's
    teacher and student (its section's `plan_models()`); [] when a config is not on this machine yet."""
    from core.process import world

    values = cfg.as_dict()
    models = ((cfg.extra is not None and cfg.extra.plan_models())
              or [(cfg.model.model, cfg.model.num_layers, True, None, None)])
    out = []
    for name, num_layers, trains, config, loss in models:
        shape = Shape.from_config(config, num_layers) if config is not None else model_shape(name, num_layers)
        if shape is None and name == cfg.model.model and not cfg.model.model_explicit:
            shape = Shape.from_config(PRESETS["llama-3.1-8b"], num_layers)  # load_model's fallback
        if shape is None:
            return []
        role = dict(values, model=name)
        wbytes = 2 if name in PRESETS or config is not None else weights_dtype(replace_model(cfg, name),
                                                                                torch.bfloat16).itemsize
        if not trains:  # a frozen teacher: its weights, one forward without saved activations
            role.update(lora_r=0, load_in_4bit=False, fp8=False, gradient_checkpointing=False, checkpoint_layers=None)
        setup = setup_from(role, shape, world=world()[1], weight_bytes=wbytes, trains=trains)
        out.append((name, shape, replace(setup, loss=loss) if loss else setup))
    return out


def replace_model(cfg: RunConfig, name):
    return replace(cfg, model=replace(cfg.model, model=name))


def combine(plans: list[tuple[str, Shape, Setup]]) -> Plan:
    """One plan for the models a run holds at once (distill.py: a frozen teacher beside the student)."""
    if len(plans) == 1:
        return estimate(plans[0][1], plans[0][2])
    frozen = [(name, estimate(shape, s)) for name, shape, s in plans if not s.trains]
    trained = [(name, estimate(shape, s)) for name, shape, s in plans if s.trains]
    held = {name: s.tokens * shape.hidden * s.weight_bytes for name, shape, s in plans if not s.trains}
    base = sum(p.parts["weights"][0] + held[name] for name, p in frozen)
    parts = {f"{name} weights (frozen)": p.parts["weights"] for name, p in frozen}
    peak, where = 0.0, ""
    for name, p in trained:
        parts.update({f"{name} {k}": v for k, v in p.parts.items()})
        if p.peak + base > peak:
            peak, where = p.peak + base, f"{name}: {p.where}"
    return Plan(parts=parts, peak=peak, where=where, notes=[n for _, p in trained for n in p.notes])


def start(cfg: RunConfig):
    """The memory plan's part of a run's start (run/start.py, settle), before any model is built: the default
    rounding chosen where the command line left it open (cfg.optimizer_rounding "auto": choose_rounding, one log
    line) and agreed between the processes of a torchrun job (agree_on_rounding), then the plan printed and
    checked (check). Returns the RunConfig the run goes on with, holding the rounding it uses: the one place a
    run's rounding is decided."""
    line = None
    chosen = cfg.training.optimizer_rounding == "auto"
    if chosen:
        rounding, line = choose_rounding(cfg)
        cfg = agree_on_rounding(replace(cfg, training=replace(cfg.training, optimizer_rounding=rounding)))
        if cfg.training.optimizer_rounding != rounding:
            line = None  # agree_on_rounding said why every process takes another
    check(cfg, note=line, rounding_chosen=chosen)
    return cfg


KAHAN_BYTES = 2  # per trained weight: the Kahan compensation, in bf16 (adamw_kernel.py)


def choose_rounding(cfg: RunConfig) -> tuple[str, str | None]:
    """The rounding of a run that left --optimizer-rounding open (config.default_rounding: a full fine-tune
    whose bf16 weights the Triton AdamW updates), and the log line that says why:
      kahan       where the plan with its buffer (2 bytes per weight) fits the free memory: the GPU's, or the
                  stand-in of PLAYBOOK_FREE_MEMORY_GB. On SmolLM2 it closed 97-100 % of the gap between rounding
                  to nearest and fp32 master weights, in half the memory of the master (docs/quality.md);
      stochastic  where it does not fit, and where the plan cannot say: no GPU (and no stand-in),
                  --ignore-memory-plan (the run is told not to go by the plan), a model whose config comes
                  with its weights. It needs no memory, and closed 83 % of that gap at lr 1e-5 (at 2e-5 it
                  ended worse than nearest: docs/quality.md);
      nearest     (no line) where the weights turn out fp32 (a real model on a CPU without bf16 matmuls):
                  rounding to bf16 loses nothing there.
    Under torchrun each process judges its own GPU's free memory; agree_on_rounding then gives every process the
    choice that fits on all of them."""
    free, where_free = (math.inf, "") if cfg.output.ignore_memory_plan else _free(cfg.run.device)
    return _rounding(cfg, free, where_free)


def _rounding(cfg: RunConfig, free: float, where_free: str) -> tuple[str, str | None]:
    """choose_rounding for the free memory `free` (`where_free`: where that figure comes from)."""
    plans = run_plans(replace(cfg, training=replace(cfg.training, optimizer_rounding="kahan")))
    if plans and plans[-1][2].weight_bytes != 2:
        return "nearest", None
    choose = "--optimizer-rounding kahan or nearest to choose"
    if not plans:
        return "stochastic", (f"Optimizer rounding: stochastic (no memory plan before {cfg.model.model} is loaded, so the "
                              f"Kahan buffer, {KAHAN_BYTES} bytes per weight, cannot be checked against the free "
                              f"memory; stochastic rounding needs none; {choose})")
    plan = combine(plans)
    buffer = plan_part(plan, "optimizer states") - plan_part(
        combine(run_plans(replace(cfg, training=replace(cfg.training,
                                                        optimizer_rounding="stochastic")))), "optimizer states")
    if cfg.output.ignore_memory_plan:
        return "stochastic", (f"Optimizer rounding: stochastic (--ignore-memory-plan: the run does not go by the "
                              f"plan, so it takes the rounding that needs no memory; kahan would add "
                              f"{gb_text(buffer)} GB; {choose})")
    if not cfg.on_gpu and not where_free.startswith(f"{FREE_MEMORY_ENV}="):
        return "stochastic", (f"Optimizer rounding: stochastic (no GPU: kahan is chosen where the memory plan fits "
                              f"it in a GPU's free memory, or in {FREE_MEMORY_ENV}; stochastic rounding needs no "
                              f"memory; {choose})")
    if plan.peak <= free:
        return "kahan", (f"Optimizer rounding: kahan (fits: the plan's peak with its {gb_text(buffer)} GB buffer is "
                         f"{gb_text(plan.peak)} GB, and {said_free(free, where_free)}; stochastic where it does not "
                         f"fit; --optimizer-rounding nearest to turn off)")
    return "stochastic", (f"Optimizer rounding: stochastic (kahan does not fit: the plan's peak with its "
                          f"{gb_text(buffer)} GB buffer would be {gb_text(plan.peak)} GB, and "
                          f"{said_free(free, where_free)}; stochastic rounding needs no memory; --optimizer-rounding "
                          f"nearest to turn off)")


def plan_part(plan: Plan, name: str) -> float:
    """The bytes of one part of a plan, summed over its models ("optimizer states", "student optimizer states")."""
    return sum(nbytes for key, (nbytes, _) in plan.parts.items() if key == name or key.endswith(" " + name))


ROUNDING_ORDER = ("nearest", "stochastic", "kahan")  # a process's choice, least memory first


def agree_on_rounding(cfg: RunConfig):
    """Under torchrun (the process group started by run/start.py's settle, before the plan): each process chose its
    default rounding from its own GPU's free memory, and near the limit they may differ. Every process takes the choice that fits on all of them
    (the first of ROUNDING_ORDER that any chose), with one line where that changes this one's. Returns the
    RunConfig to go on with; one process, or no process group: unchanged."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return cfg
    device = cfg.run.device if dist.get_backend() == "nccl" else "cpu"
    choice = torch.tensor([ROUNDING_ORDER.index(cfg.training.optimizer_rounding)], device=device)
    dist.all_reduce(choice, op=dist.ReduceOp.MIN)
    agreed = ROUNDING_ORDER[int(choice.item())]
    if agreed == cfg.training.optimizer_rounding:
        return cfg

    log(f"Optimizer rounding: {agreed} on every process (this one's plan chose {cfg.training.optimizer_rounding}; another "
        f"process's free memory did not fit it)")
    return replace(cfg, training=replace(cfg.training, optimizer_rounding=agreed))


def check(cfg: RunConfig, enforce: bool | None = None, note: str | None = None,
          rounding_chosen: bool = False) -> Plan | None:
    """Print the run's memory plan; stop (exit code 2) when it does not fit, naming the options that would
    (enforce: by default unless --ignore-memory-plan). Each script calls it as its run starts, before any
    model is built (training.train, profile_baseline.py and distill.py through start; finetune_trainer.py, whose
    Trainer builds its own optimizer, directly).
    note: a line printed after the plan (start's choice of rounding); rounding_chosen: start chose the rounding
    (the command line left it open, as it stays in the options offered)."""
    if enforce is None:
        enforce = not cfg.output.ignore_memory_plan

    plans = run_plans(cfg)
    if not plans:
        log(f"Memory plan: none before loading (the config of {cfg.model.model} is not on this machine yet)")
        if note:
            log(note)
        return None
    plan = combine(plans)
    free, where_free = _free(cfg.run.device)
    if is_main():
        log(format_plan(plan, free, where_free))
        if note:
            log(note)
    if plan.peak <= free or not enforce:
        return plan
    raise usage_error(too_big(replace(cfg, training=replace(cfg.training, optimizer_rounding="auto"))
                              if rounding_chosen else cfg, plans,
                              plan, free, where_free))


def problem(cfg: RunConfig) -> str | None:
    """The line check() stops a run with where its plan does not fit, found without printing the plan (for a
    command line with more than one thing wrong: config.parse_config names this one first); None where the run
    fits, where its plan cannot be made before loading, or with --ignore-memory-plan."""
    if cfg.output.ignore_memory_plan:
        return None
    free, where_free = _free(cfg.run.device)
    given = cfg
    if cfg.training.optimizer_rounding == "auto":
        cfg = replace(cfg, training=replace(cfg.training, optimizer_rounding=_rounding(cfg, free, where_free)[0]))
    plans = run_plans(cfg)
    if not plans:
        return None
    plan = combine(plans)
    return None if plan.peak <= free else too_big(given, plans, plan, free, where_free)


def too_big(given: RunConfig, plans: list, plan: Plan, free: float, where_free: str) -> str:
    """The one line of a run whose plan does not fit: what it needs, the free memory and where that figure
    comes from, a --seq-len past the model's positions, and the options that fit (offers). `given`: the run as
    its command line gave it (a rounding left open still "auto")."""
    shape = plans[-1][1]
    past = (f" (--seq-len {given.data.seq_len:,} is past the {shape.positions:,} positions {trained_model(given)} was "
            f"trained on)" if shape.positions and given.data.seq_len > shape.positions else "")
    fits = offers(given, free, where_free)
    way = ("; options that fit (estimated peak): " + "; ".join(f"{o.text} ({gb_text(o.peak)} GB)" for o in fits)
           if fits else "; no single option brings it under; see docs/memory.md, or use several GPUs (torchrun)")
    if not given.on_gpu and given.model.model != "llama-tiny":
        way += "; on a CPU, --model llama-tiny runs the CPU demo"
    return (f"--batch-size {given.data.batch_size} x --seq-len {given.data.seq_len}{past}: the plan needs {gb_text(plan.peak)} "
            f"GB at its peak and {said_free(free, where_free)}{way}; --ignore-memory-plan runs it anyway")


# ------------------------------------------------------------------------------------------------
# Estimate against measured, for the runs under results/
# ------------------------------------------------------------------------------------------------
def measured_run(path: Path) -> tuple[Shape, Setup, float, str] | None:
    """(Shape, Setup, measured peak in bytes, label) of a saved summary with a peak; None for other files."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):  # (a JSON list or value: chat.py --json's answers, not a run's summary)
        return None
    config, peak = data.get("config"), data.get("peak_memory_gb")
    if not config or not peak or "batch_size" not in config or data.get("script") == "distill":
        return None

    if config.get("model") not in PRESETS and not str(config.get("model")).startswith("smollm2"):
        return None
    name = config["model"]
    shape = model_shape(name, config.get("num_layers"))
    if shape is None:
        return None
    setup = setup_from(config, shape, world=int(data.get("world_size") or 1))
    return shape, setup, peak * GB, data.get("gpu", ""), _caveat(config, setup)


def _caveat(config: dict, setup: Setup) -> str:
    """What the estimate does not model in a saved run, for the table's last column."""
    if config.get("warmup_steps") == 0 and not setup.lora_r:
        return "peak of the first step: AdamW's moments are made at its end"
    if config.get("compile") and setup.kernels == "hf":
        return "torch.compile frees what the estimate counts"
    if setup.partial_kernels:
        return "a partial kernel set"
    if config.get("packing"):
        return "packed rows"
    return ""


def table(paths) -> str:
    rows = []
    for path in paths:
        found = measured_run(Path(path))
        if found is None:
            continue
        shape, setup, measured, gpu, caveat = found
        est = estimate(shape, setup).peak
        rows.append((str(path), gpu.split(" (")[0].replace("NVIDIA ", ""), f"{setup.batch} x {setup.seq}",
                     f"{est / GB:.1f}", f"{measured / GB:.1f}", f"{100 * (est - measured) / measured:+.1f}%", caveat))
    head = ("run", "GPU", "tokens", "estimated (GB)", "measured (GB)", "error", "not modelled")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = "| " + " | ".join(f"{{:{'<' if i < 3 or i == 6 else '>'}{w}}}" for i, w in enumerate(widths)) + " |"
    return "\n".join([fmt.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt.format(*r) for r in rows])
