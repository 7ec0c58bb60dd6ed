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
function; `check.check(cfg)` (playbook/plan/check.py) is what the scripts call once the command line is parsed
(config.parse_config).

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

import math
from dataclasses import replace

from core.fp8_support import bf16_layer_counts, get_recipe
from linear_cross_entropy_kernel import CHUNK_BYTES  # the fused head's logits buffer
from playbook.memory.saved_activations import PREFETCH_LAYERS  # offloaded layers brought back ahead of backward
from playbook.plan.inputs import GB, Plan, Setup, Shape

# Fitted to the measured peaks (docs/memory.md#the-memory-plan):
MISC_BYTES_PER_TOKEN = 880  # per layer and token, beyond the tensors counted by name (RoPE's tables, small buffers)
FP8_WEIGHT_BYTES = 0.17  # per FP8 projection weight: the FP8 copies and scales a step keeps (full fine-tune)
FP8_TOKEN_BYTES = 0.5  # per token and hidden unit, in each FP8 layer: the inputs' FP8 copies and scales
HOST_LINK_BYTES = 9e9  # what --offload-layers moves to the host during a forward (H100, PCIe; docs/memory.md)

# Counted, not fitted:
OFFLOADED_INPUTS_ON_GPU = 3  # --offload-activations: the input in use, the one being fetched, the one being sent
DISTILL_FULL_BYTES = 56  # per logit: distill.py's baseline loss, counted op by op (distill.py's docstring)
HF_LOSS_BYTES = 12  # per logit: Hugging Face's fp32 log-softmax, its gradient and the gradient of the logits
# bitsandbytes NF4: 4 bits, an 8-bit scale per 64 values, an fp32 one per 256 of those
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# Bytes per value of one quantized copy with its block scales (mx_quant_kernel.py): MXFP8 an e4m3 byte and an
# e8m0 scale per 32 values; NVFP4 half a byte (packed e2m1) and an e4m3 scale per 16 values
QUANTIZED_BYTES = {"mx": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
# The peak bytes per value of an emulated recipe's dequantization on a GPU (mx_quant_kernel.dequantize_*, straight
# to bf16), all alive at once: the bf16 values, the bf16 scales repeated to every value, their product (6; NVFP4's
# int32 byte indices, 2 per value, are freed before the scales are repeated); DEQUANTIZED_BYTES per value after
DEQUANTIZE_BYTES = {"mx": 6, "nvfp4": 6}
DEQUANTIZED_BYTES = 2


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
        norms = 2 * w * h * (1 if s.norms_recomputed else 2)  # each norm's input, and its output the projections read
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
    # (NVFP4's layers keep a transposed copy of 0.5 + 1/16 byte per input value, MXFP8's 1 + 1/32: both counted as
    # the fitted recipes' 1-byte copies, which over-counts NVFP4's by less than half a byte per input value)
    plain = norms + attention + mlp + fp8 + MISC_BYTES_PER_TOKEN
    # The MLP's backward makes the gradients of gate, up and h; Liger's SwiGLU writes those of gate and up into
    # gate's and up's own storage, so a full fine-tune with it adds only h's gradient (with LoRA, peft's adapter
    # path around down_proj keeps the measured rows at three)
    mlp_backward = (1 if s.kernels == "liger" and not lora else 3) * w * i
    return {"plain": plain, "input": w * h, "kept": (w * q + 4 * heads) if s.attention_kept else 0, "mlp": mlp,
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
    then each operand of dx = dy W and of dW = dy^T x dequantized to bf16 (DEQUANTIZE_BYTES while it is
    made, DEQUANTIZED_BYTES after), one while the other is made; 0 where the matmuls are native. LoRA's
    frozen base (fp8_lora_kernel.BlockScaledFrozenLinear) keeps its weight's copies and makes only dx."""
    if not (s.fp8 and s.trains and get_recipe(s.fp8_recipe).emulated and s.fp8_layers(shape.layers)):
        return 0
    recipe = get_recipe(s.fp8_recipe)
    n, copy, deq = s.tokens, QUANTIZED_BYTES[recipe.scaling], DEQUANTIZE_BYTES[recipe.scaling]

    def product(a: int, b: int) -> float:  # a @ b.T from quantized operands of a and b values
        return max(deq * a, DEQUANTIZED_BYTES * a + deq * b)

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
    if s.inputs_on_host and checkpointed:  # their inputs wait in host memory, but for a few
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
    extras = [flag for flag, on in (("inputs on the host", s.inputs_on_host), ("attention kept", s.attention_kept),
                                    ("norms recomputed", s.norms_recomputed),
                                    (f"MLP in chunks of {s.mlp_chunk:,}", s.mlp_chunk)) if on]
    return text + (f" ({', '.join(extras)})" if extras else "") + f", {s.batch} x {s.seq} tokens"



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
