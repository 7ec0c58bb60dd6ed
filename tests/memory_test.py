"""Memory options (playbook/memory/): selective checkpointing, offloaded checkpoints, the tiled MLP.

    $ PYTHONPATH=. python tests/memory_test.py       # a readable report
    $ pytest tests/memory_test.py

On the CPU, a tiny LLaMA of 4 layers (hidden 64, MLP width 96, fp32, 2 x 12 tokens of which about a
quarter are -100) runs one forward and backward plain, then with each option; its loss and the
gradient of every parameter must be:
  - bitwise the plain model's where the option does the same arithmetic: checkpointing (each SPEC)
    recomputes the same operations on the same inputs, and offloading adds exact copies;
  - within testkit/__init__.py's rule where it does not: the tiled MLP sums each weight gradient per
    chunk and then over chunks, another order than one sum over all tokens. Its error against a float64
    copy of the model may be at most twice the plain fp32 model's, plus one ulp and the rounding noise
    of an fp32 sum of tokens x width terms, of each tensor's scale (FP8: twice the untiled FP8 model's).
Each option is also checked to act: the checkpointed layers (and only they) run twice, an offloaded
layer input is freed once the layer has run and its host buffer is reused the next step, backward
fetches each input one layer ahead, the tiled MLP runs one call per chunk, and its weights' gradient
hooks fire once per backward (--optimizer-in-backward steps in them). The same with the fused SwiGLU
kernel, with peft's LoRA adapters (plain and on lora_kernel's fused path), with FP8 projections, and
through the command line and models.prepare_model; a bad --checkpoint-layers SPEC exits with code 2.

On a GPU (skipped elsewhere), torch.cuda.max_memory_allocated shows the memory actually drops: the
tiled MLP of the 8B's width on 32,768 tokens by more than two of its [tokens, 14336] intermediates,
and offloading 12 checkpointed layers by more than 6 layer inputs; an offloaded model's gradients on
the GPU (side stream, pinned buffers) are bitwise the checkpointed model's.
"""

import copy
import gc
import math
import sys
import types
import weakref

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import pytest
import torch
import torch.utils._python_dispatch

from playbook.memory import activations, host_offload, saved_activations, tiled_mlp
from playbook.model import models
from playbook.config import make_parser, parse_config
from core.kernel_utils import DEVICE
from playbook.model.registry import DEFAULT_KERNELS
from testkit import (BATCH, FACTOR, N_TERMS, SEQ, ULP, batch, loss_and_grads, record, run_as_script,
                              tiny_model)
from playbook.optim.optimizer import make_optimizer
from playbook.run.start import make_run_data

LAYERS = 4
TOKENS = BATCH * SEQ  # 24: chunks of 5 and 7 leave a partial last chunk
CPU_ONLY = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU comparisons (the GPU tests follow)")
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (peak memory, streams)")


def tiny(seed: int = 0, dtype=torch.float32):
    model = tiny_model("llama", seed, num_hidden_layers=LAYERS).to(dtype).train()  # HF checkpoints in training only
    model.config.use_cache = False
    return model


def layers(model):
    return models.decoder_layers(model)


def run(model):
    ids, labels = batch()
    return loss_and_grads(model, ids, labels)


def _tensors(result):
    loss, grads = result
    return {"loss": loss, **grads}


def same(name: str, got, want):
    """Bitwise equality of the loss and every gradient (None where the other is None)."""
    got, want = _tensors(got), _tensors(want)
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    differ = [k for k in want if (got[k] is None) != (want[k] is None)
              or want[k] is not None and not torch.equal(got[k], want[k])]
    err = max([(got[k].double() - want[k].double()).abs().max().item() for k in differ
               if got[k] is not None and want[k] is not None] + [0.0])
    record(name, err, 0.0, passed=not differ, note=f"differ: {differ[:3]}" if differ else "")


def close(name: str, got, plain, ref, dtype=torch.float32):
    """testkit's rule (close_to_reference) for the loss and each gradient; records the tensor nearest its
    tolerance: max|got - ref| <= FACTOR max|plain - ref| + ulp(dtype) scale + 2^-23 sqrt(n) scale."""
    got, plain, ref = _tensors(got), _tensors(plain), _tensors(ref)
    worst, failed = (0.0, 1.0, ""), []
    for k, r in ref.items():
        if r is None:
            assert got[k] is None and plain[k] is None, k
            continue
        g, t, r = got[k].double(), plain[k].double(), r.double()
        scale = r.abs().max().item()
        err = (g - r).abs().max().item()
        tol = FACTOR * (t - r).abs().max().item() + ULP[dtype] * scale + 2.0**-23 * N_TERMS**0.5 * scale
        if err > tol:
            failed.append(k)
        if err / tol >= worst[0] / worst[1]:
            worst = (err, tol, k)
    record(f"{name} (nearest: {worst[2]})", worst[0], worst[1], passed=not failed,
           note=f"over: {failed[:3]}" if failed else "")


def float64_copy(model):
    return copy.deepcopy(model).double()


def count_calls(modules) -> list:
    """Forward calls of each module (a checkpointed layer's run again in backward)."""
    counts = [0] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


# ------------------------------------------------------------------------------------------------
# The SPEC
# ------------------------------------------------------------------------------------------------
def test_layer_specs():
    cases = {"all": (0, 1, 2, 3, 4, 5, 6), "every:1": (0, 1, 2, 3, 4, 5, 6), "every:3": (0, 3, 6),
             "every:9": (0,), "first:2": (0, 1), "first:7": tuple(range(7)), "5,0,2": (0, 2, 5), " 1 , 6 ": (1, 6),
             "ALL": tuple(range(7))}
    for spec, want in cases.items():
        assert activations.parse_layers(spec, 7) == want, spec
        assert activations.parse_layers(spec) in (None, want), spec  # the syntax alone: None for the counted forms
    bad = {"every:0": "K >= 1", "first:0": "K >= 1", "every:": "whole number", "first:two": "whole number",
           "some:3": "unknown form", "garbage": "not a layer list", "1,x": "not a layer list", "-1": "not a layer list",
           "1,,2": "not a layer list", "0,0": "named twice", "": "no layers named", "7": "does not exist",
           "first:8": "only 7"}
    for spec, words in bad.items():
        with pytest.raises(ValueError) as err:
            activations.parse_layers(spec, 7)
        assert words in str(err.value) and "\n" not in str(err.value), (spec, str(err.value))
    record(f"--checkpoint-layers: {len(cases)} SPECs select their layers, {len(bad)} bad ones refused", 0.0, 0.0, True)


BAD_COMMAND_LINES = [
    (["--checkpoint-layers", "every:0"], "--checkpoint-layers"),
    (["--checkpoint-layers", "first:0"], "--checkpoint-layers"),
    (["--checkpoint-layers", "garbage"], "--checkpoint-layers"),
    (["--checkpoint-layers", "1,-2"], "--checkpoint-layers"),
    (["--checkpoint-layers", "0,0"], "--checkpoint-layers"),
    (["--checkpoint-layers", "2", "--num-layers", "2"], "does not exist"),
    (["--checkpoint-layers", "first:3", "--num-layers", "2"], "only 2"),
    (["--offload-activations"], "needs --gradient-checkpointing or --checkpoint-layers"),
    (["--gradient-checkpointing", "--checkpoint-layers", "every:2"], "give one of them"),
    (["--mlp-chunk-tokens", "-1"], "--mlp-chunk-tokens"),
    (["--keep-attention"], "needs --gradient-checkpointing or --checkpoint-layers"),
    (["--offload-layers", "every:0"], "--offload-layers"),
    (["--offload-layers", "3", "--num-layers", "2"], "does not exist"),
    (["--offload-layers", "first:1", "--gradient-checkpointing"], "name the checkpointed ones"),
    (["--recompute-norms", "--compile"], "not with --compile"),
    (["--offload-layers", "all", "--compile"], "not with --compile"),
]


@pytest.mark.parametrize("argv, mentions", BAD_COMMAND_LINES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_memory_options_exit_2_with_one_line(argv, mentions, capsys):
    parser = make_parser("test", kernels_default=DEFAULT_KERNELS)
    with pytest.raises(SystemExit) as info:
        parse_config(parser, "finetune_optimized", argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2, info.value.code
    assert err and err[-1].startswith(("error:", parser.prog)) and mentions in err[-1], err  # argparse's usage line above
    record(f"{' '.join(argv)}: exit 2, {err[-1][:60]}", 0.0, 0.0, True)


def test_a_spec_past_the_loaded_model_exits_2(capsys):
    """The tiny preset has 2 layers, known only once it is loaded: prepare_model refuses layer 5."""
    parser = make_parser("test", kernels_default=DEFAULT_KERNELS)
    cfg = parse_config(parser, "finetune_optimized", ["--model", "llama-tiny", "--checkpoint-layers", "0,5"])
    with pytest.raises(SystemExit) as info:
        models.prepare_model(cfg)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and "layer 5 does not exist" in err[-1], err
    record(f"prepare_model: {err[-1][:70]}", 0.0, 0.0, True)


def test_the_config_fields():
    parser = make_parser("test", kernels_default=DEFAULT_KERNELS)
    fields = lambda *argv: (lambda c: (c.memory.gradient_checkpointing, c.memory.checkpoint_layers,  # noqa: E731
                                       c.memory.offload_activations, c.memory.mlp_chunk_tokens))(parse_config(parser,
                                                                                                              "finetune_optimized", list(argv)))
    assert fields() == (False, None, False, 0)
    assert fields("--gradient-checkpointing") == (True, "all", False, 0)
    assert fields("--gradient-checkpointing", "--checkpoint-layers", "all") == (True, "all", False, 0)
    assert fields("--checkpoint-layers", "Every:4", "--offload-activations") == (True, "every:4", True, 0)
    assert fields("--mlp-chunk-tokens", "4096") == (False, None, False, 4096)
    keep = lambda *argv: parse_config(parser, "finetune_optimized", list(argv)).memory.keep_attention  # noqa: E731
    assert (keep(), keep("--gradient-checkpointing", "--keep-attention")) == (False, True)
    saved = lambda *argv: (lambda c: (c.memory.recompute_norms, c.memory.offload_layers))(  # noqa: E731
        parse_config(parser, "finetune_optimized", list(argv)))
    assert saved() == (False, None)
    assert saved("--recompute-norms", "--offload-layers", "First:3") == (True, "first:3")
    record("RunConfig: gradient_checkpointing, checkpoint_layers, offload_activations, mlp_chunk_tokens, "
           "keep_attention, recompute_norms, offload_layers", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# Checkpointing and offloading: bitwise the plain model
# ------------------------------------------------------------------------------------------------
CHECKPOINT_CASES = [("all", False, (0, 1, 2, 3)), ("every:2", False, (0, 2)), ("first:1", False, (0,)),
                    ("1,3", False, (1, 3)), ("all", True, (0, 1, 2, 3)), ("every:3", True, (0, 3)),
                    ("2", True, (2,))]


@CPU_ONLY
@pytest.mark.parametrize("spec, offload, chosen", CHECKPOINT_CASES,
                         ids=[f"{s}{'+offload' if o else ''}" for s, o, _ in CHECKPOINT_CASES])
def test_checkpointing_is_bitwise_the_plain_model(spec, offload, chosen):
    want = run(tiny())
    model = tiny()
    assert activations.apply_checkpointing(layers(model), spec, offload=offload) == chosen
    calls = count_calls([layer.input_layernorm for layer in layers(model)])
    got = run(model)
    assert calls == [2 if i in chosen else 1 for i in range(LAYERS)], f"forward calls per layer: {calls}"
    same(f"{spec}{' + offload' if offload else ''}: loss and {len(want[1])} gradients; recomputed {chosen}", got, want)


class _CountAttention(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the fused SDPA forward operators that actually run (a kept output served to the recompute
    by selective checkpointing never reaches this mode)."""

    def __init__(self):
        super().__init__()
        self.forward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forward += func in activations.ATTENTION_OPERATORS
        return func(*args, **(kwargs or {}))


def tiny_sdpa(seed: int = 0):
    model = tiny(seed)
    model.set_attn_implementation("sdpa")  # --keep-attention keeps SDPA's fused operators (the scripts' attention)
    return model


@CPU_ONLY
@pytest.mark.parametrize("spec, offload, chosen", [("all", False, (0, 1, 2, 3)), ("1,3", False, (1, 3)),
                                                   ("every:2", True, (0, 2))],
                         ids=["all", "1,3", "every:2+offload"])
def test_keep_attention_skips_its_recompute_bitwise(spec, offload, chosen):
    """--keep-attention: the checkpointed layers run attention's forward once, not twice, and the loss and
    every gradient are bitwise those of the plain model (the kept tensors are what the recompute makes)."""
    with _CountAttention() as plain_count:
        want = run(tiny_sdpa())
    runs = {}
    for keep in (False, True):
        model = tiny_sdpa()
        activations.apply_checkpointing(layers(model), spec, offload=offload, selective=keep)
        calls = count_calls([layer.input_layernorm for layer in layers(model)])
        with _CountAttention() as counted:
            runs[keep] = run(model)
        assert calls == [2 if i in chosen else 1 for i in range(LAYERS)], f"forward calls per layer: {calls}"
        assert counted.forward == LAYERS + (0 if keep else len(chosen)), (keep, counted.forward)
    assert plain_count.forward == LAYERS
    same(f"{spec}{' + offload' if offload else ''} + keep attention: attention forwards {LAYERS} "
         f"(checkpointing alone {LAYERS + len(chosen)}); loss and gradients", runs[True], want)


@CPU_ONLY
def test_keep_attention_via_prepare_model(capsys):
    parser = make_parser("test", kernels_default=DEFAULT_KERNELS)
    cfg = parse_config(parser, "finetune_optimized", ["--model", "llama-tiny", "--gradient-checkpointing",
                                                      "--keep-attention"])
    model, *_ = models.prepare_model(cfg)
    funcs = {type(layer._gradient_checkpointing_func).__name__ for layer in layers(model)}
    assert funcs == {"LayerCheckpoint"} and all(layer._gradient_checkpointing_func.selective
                                                for layer in layers(model))
    out = capsys.readouterr()
    line = [x for x in (out.out + out.err).splitlines() if x.startswith("Gradient checkpointing")]
    assert line and "attention" in line[0], line
    record(f"prepare_model: {line[0][:90]}", 0.0, 0.0, True)


@CPU_ONLY
def test_offload_frees_inputs_reuses_buffers_and_prefetches():
    """The input of an offloaded layer is gone once forward has passed it (a checkpoint without offload
    keeps it); the host buffers of step 1 serve steps 2 and 3; backward finds each input but the first
    it needs already on its way back (fetched one layer ahead)."""
    seen = {}

    def watch(model):
        for i, layer in enumerate(layers(model)):
            layer.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, weakref.ref(args[0])))

    kept = tiny()
    activations.apply_checkpointing(layers(kept), "all")
    watch(kept)
    ids, labels = batch()
    loss = kept(input_ids=ids, labels=labels).loss
    gc.collect()
    alive = [i for i in (1, 2, 3) if seen[i]() is not None]
    assert alive == [1, 2, 3], f"checkpointing without offload keeps each layer input: alive {alive}"
    del loss

    model = tiny()
    activations.apply_checkpointing(layers(model), "all", offload=True)
    offload = activations.offload_of(layers(model))
    watch(model)
    ready_at_fetch = []
    fetch = offload.fetch

    def spy(s):
        if s.gpu is None:  # the recompute's fetch, not the first forward's read
            ready_at_fetch.append(s.fetched is not None)
        return fetch(s)

    offload.fetch = spy
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        gc.collect()
        # layer 0's input is Hugging Face's inputs_embeds, which its forward keeps in a variable
        alive = [i for i in (1, 2, 3) if seen[i]() is not None]
        assert not alive, f"step {step}: offloaded inputs still on the device: layers {alive}"
        loss.backward()
        assert not [r for r in offload.stack if r() is not None], "stashes left unfetched after backward"
    per_layer = TOKENS * 64 * 4  # [2, 12, 64] fp32
    assert offload.allocations == LAYERS and offload.host_bytes == LAYERS * per_layer, (offload.allocations,
                                                                                        offload.host_bytes)
    assert ready_at_fetch == [False, True, True, True] * 3, ready_at_fetch
    record(f"offload: inputs freed in forward; {offload.allocations} host buffers ({offload.host_bytes:,} bytes) for "
           "3 steps; layers 2, 1, 0 prefetched", 0.0, 0.0, True)


@CPU_ONLY
def test_an_offloaded_forward_without_backward_returns_its_buffers():
    model = tiny()
    activations.apply_checkpointing(layers(model), "all", offload=True)
    offload = activations.offload_of(layers(model))
    ids, labels = batch()
    for _ in range(3):  # forwards whose graphs are dropped unused (an evaluation with gradients on)
        model(input_ids=ids, labels=labels).loss
        gc.collect()
    assert offload.allocations == LAYERS and sum(map(len, offload.free.values())) == LAYERS, offload.allocations
    record("offload: graphs dropped without backward give their host buffers back", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# Plain layers: norms recomputed, saved tensors offloaded (bitwise the plain model)
# ------------------------------------------------------------------------------------------------
SAVED_CASES = [(True, None, None), (False, "all", None), (False, "1,3", None), (True, "every:2", None),
               (True, "first:2", "2,3")]


def norm_outputs(model):
    """Weak references to every norm output of the decoder layers' last forward."""
    refs = []
    for layer in layers(model):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_hook(lambda m, args, out: refs.append(weakref.ref(out)))
    return refs


@CPU_ONLY
@pytest.mark.parametrize("recompute, offload, checkpointed", SAVED_CASES,
                         ids=[f"{'norms' if r else ''}{'+' if r and o else ''}{'offload ' + o if o else ''}"
                              f"{' ckpt ' + c if c else ''}" for r, o, c in SAVED_CASES])
def test_saved_activations_are_bitwise_the_plain_model(recompute, offload, checkpointed):
    """--recompute-norms and --offload-layers over three steps: the loss and every gradient bitwise the plain
    model's; each norm output of a hooked layer is gone after forward and run again once per backward; the
    offloaded layers' host buffers are made in step 1 and reused; backward fetches the first offloaded layer
    it reaches on demand (if it is one) and the rest ahead. min_bytes 0: the tiny model's tensors are all small."""
    want = run(tiny())
    model = tiny()
    if checkpointed:
        activations.apply_checkpointing(layers(model), checkpointed)
    saved = saved_activations.apply_saved_activations(layers(model), recompute, offload, min_bytes=0)
    plain = [i for i in range(LAYERS) if not (checkpointed and i in activations.parse_layers(checkpointed, LAYERS))]
    offloaded = activations.parse_layers(offload, LAYERS) if offload else ()
    refs = norm_outputs(model)
    ids, labels = batch()
    allocations = []
    for step in range(3):
        refs.clear()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        gc.collect()
        alive = sorted({i // 2 for i, r in enumerate(refs[:2 * LAYERS]) if r() is not None})
        # kept only by plain layers that neither recompute nor offload them (checkpointed ones keep their input)
        kept = [] if recompute else [i for i in plain if i not in offloaded]
        assert alive == kept, f"step {step}: norm outputs alive in layers {alive}, expected {kept}"
        loss.backward()
        got = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        same(f"step {step + 1}: loss and {len(want[1])} gradients", got, want)
        if saved.offload is not None:
            allocations.append(saved.offload.allocations)
    assert saved.recomputed == (3 * 2 * len(plain) if recompute else 0), saved.recomputed
    if offloaded:
        assert allocations[0] > 0 and allocations == allocations[:1] * 3, allocations
        # backward starts copying each offloaded layer back 3 layers before it reaches it: only an offloaded
        # layer that is the first one backward reaches (the last not checkpointed) is fetched on demand
        first = plain[-1] in offloaded
        assert saved.fetched == {"on demand": 3 * first, "ahead": 3 * (len(offloaded) - first)}, saved.fetched
    record(f"norms recomputed {saved.recomputed}x in 3 steps; offloaded {offloaded or 'none'}: "
           f"{allocations[:1] or [0]} host buffers, fetched {saved.fetched}", 0.0, 0.0, True)


@CPU_ONLY
def test_saved_activations_with_kernels_and_lora():
    """The default kernels (Triton RMSNorm, fused SwiGLU + down, joined projections) and lora_kernel's fused
    adapters: the norm output the joined projection and the adapter A save is recognised (a [N, H] view of
    it), and the results stay bitwise."""
    from playbook.model.registry import apply_kernels

    def build(lora: bool):
        model = lora_model(fused=True) if lora else tiny()
        if not lora:
            apply_kernels(model, [k for k in DEFAULT_KERNELS if k not in ("adamw", "lora")], verbose=False)
        return model

    for lora in (False, True):
        want = run(build(lora))
        model = build(lora)
        saved = saved_activations.apply_saved_activations(layers(model), True, "0,2", min_bytes=0)
        got = run(model)
        assert saved.recomputed == 2 * LAYERS, saved.recomputed
        same(f"{'fused LoRA' if lora else 'default kernels'} + norms + offload 0,2: recomputed {saved.recomputed}",
             got, want)


@CPU_ONLY
def test_saved_activations_refuse_a_changed_tensor():
    """A saved tensor written in place before backward reads it: a clear RuntimeError, as autograd's own
    version check gives without the hooks."""
    for recompute, offload in ((True, None), (False, "all")):
        model = tiny()
        saved_activations.apply_saved_activations(layers(model), recompute, offload, min_bytes=0)
        changed = []
        target = layers(model)[1].input_layernorm
        target.register_forward_pre_hook(lambda m, args: changed.append(args[0]))
        ids, labels = batch()
        loss = model(input_ids=ids, labels=labels).loss
        with torch.no_grad():
            changed[0].mul_(2.0)  # layer 1's input, read by its norm
        with pytest.raises(RuntimeError, match="modified in place"):
            loss.backward()
    record("a saved tensor changed in place before backward: RuntimeError (norms, offload)", 0.0, 0.0, True)


@CPU_ONLY
def test_saved_activations_leave_checkpointed_layers_alone():
    model = tiny()
    activations.apply_checkpointing(layers(model), "1")
    with pytest.raises(ValueError, match="both checkpointed and offloaded"):
        saved_activations.apply_saved_activations(layers(model), False, "0,1")
    parser = make_parser("test", kernels_default=DEFAULT_KERNELS)
    cfg = parse_config(parser, "finetune_optimized", ["--model", "llama-tiny", "--checkpoint-layers", "0",
                                                      "--offload-layers", "all"])
    with pytest.raises(SystemExit) as info:
        models.prepare_model(cfg)
    assert info.value.code == 2
    record("a layer both checkpointed and offloaded: ValueError, exit 2 from the command line", 0.0, 0.0, True)


@CPU_ONLY
def test_saved_activations_via_prepare_model(capsys):
    parser = make_parser("test", kernels_default=DEFAULT_KERNELS)
    cfg = parse_config(parser, "finetune_optimized", ["--model", "llama-tiny", "--recompute-norms", "--checkpoint-layers",
                                                      "1", "--offload-layers", "0"])
    model = models.prepare_model(cfg)[0]
    saved = saved_activations.saved_activations_of(layers(model))
    assert saved is not None and saved.norms_recomputed and saved.offload is not None
    assert [layer.offload_saved for layer in layers(model)] == [True, False]
    out = capsys.readouterr()
    line = [x for x in (out.out + out.err).splitlines() if x.startswith("Saved activations")]
    assert line and "recomputed" in line[0] and "1 of 2" in line[0], line
    record(f"prepare_model: {line[0][:90]}", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# The tiled MLP: testkit's rule against float64
# ------------------------------------------------------------------------------------------------
@CPU_ONLY
@pytest.mark.parametrize("chunk", [1, 5, 7, 16])
def test_tiled_mlp_matches_the_plain_model(chunk):
    plain = tiny()
    ref, want = run(float64_copy(plain)), run(plain)
    model = tiny()
    assert tiled_mlp.apply_tiled_mlp(layers(model), chunk) == LAYERS
    calls = count_calls([layer.mlp.gate_proj for layer in layers(model)])
    got = run(model)
    n = math.ceil(TOKENS / chunk)
    assert calls == [2 * n] * LAYERS, f"gate_proj calls per layer {calls}, not {n} chunks in forward + {n} in backward"
    close(f"tiled MLP, chunks of {chunk} ({n} chunks of {TOKENS} tokens)", got, want, ref)


@CPU_ONLY
def test_one_chunk_is_the_mlp_itself():
    want = run(tiny())
    model = tiny()
    tiled_mlp.apply_tiled_mlp(layers(model), TOKENS)
    same(f"tiled MLP, one chunk of {TOKENS} tokens: the untouched MLP", run(model), want)


@CPU_ONLY
def test_tiled_mlp_in_bf16():
    plain = tiny(dtype=torch.bfloat16)
    ref, want = run(float64_copy(plain)), run(plain)
    model = tiny(dtype=torch.bfloat16)
    tiled_mlp.apply_tiled_mlp(layers(model), 7)
    close("tiled MLP in bf16, chunks of 7 (weight gradients summed in fp32)", run(model), want, ref, torch.bfloat16)


@CPU_ONLY
def test_tiled_mlp_gradient_hooks_fire_once():
    """--optimizer-in-backward steps each parameter in its post-accumulate hook: the tiled MLP must
    hand autograd each weight's gradient once, whole, not once per chunk."""
    model = tiny()
    tiled_mlp.apply_tiled_mlp(layers(model), 5)
    fired = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.__setitem__(name, fired.get(name, 0) + 1))
    loss, grads = run(model)
    assert set(fired) == {n for n, g in grads.items() if g is not None} and set(fired.values()) == {1}, fired
    record(f"tiled MLP: each of {len(fired)} gradient hooks fired once", 0.0, 0.0, True)


@CPU_ONLY
def test_all_options_together():
    """Checkpointing and offloading on top of the tiled MLP change no arithmetic: bitwise the tiled model."""
    plain = tiny()
    ref, want = run(float64_copy(plain)), run(plain)
    tiled = tiny()
    tiled_mlp.apply_tiled_mlp(layers(tiled), 7)
    tiled_result = run(tiled)
    model = tiny()
    activations.apply_checkpointing(layers(model), "every:2", offload=True)
    tiled_mlp.apply_tiled_mlp(layers(model), 7)
    got = run(model)
    same("every:2 + offload + tiled MLP (7): bitwise the tiled MLP alone", got, tiled_result)
    close("every:2 + offload + tiled MLP (7) against float64", got, want, ref)


# ------------------------------------------------------------------------------------------------
# With the kernels, LoRA and FP8
# ------------------------------------------------------------------------------------------------
def swiglu_patched(seed: int = 0):
    import swiglu_kernel

    model = tiny(seed)
    assert swiglu_kernel.patch_model(model) == LAYERS
    return model


@CPU_ONLY
def test_with_the_swiglu_kernel():
    import swiglu_kernel

    plain = tiny()
    ref = run(float64_copy(plain))
    want = run(swiglu_patched())
    model = swiglu_patched()
    activations.apply_checkpointing(layers(model), "all", offload=True)
    same("swiglu kernel + checkpointing + offload: bitwise the patched model", run(model), want)
    model = swiglu_patched()
    tiled_mlp.apply_tiled_mlp(layers(model), 7)
    assert layers(model)[0].mlp.untiled_forward.__func__ is swiglu_kernel.swiglu_mlp_forward
    close("swiglu kernel + tiled MLP (7)", run(model), want, ref)


def lora_model(fused: bool = False, seed: int = 0):
    """peft's adapters (r 4) on all seven projections, B random (peft starts it at 0, which would give
    A no gradient at all)."""
    from playbook.model.lora import apply_lora

    model = swiglu_patched(seed) if fused else tiny(seed)
    model = apply_lora(model, r=4)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    if fused:
        import lora_kernel

        lora_kernel.patch_model(model)
    return model


@CPU_ONLY
@pytest.mark.parametrize("fused", [False, True], ids=["peft", "fused"])
def test_with_lora(fused):
    """LoRA freezes the embeddings, so no layer input requires a gradient; the adapters of checkpointed
    and tiled layers must still get theirs, and the frozen weights none."""
    plain = lora_model(fused)
    ref_model = lora_model(False)  # the float64 reference runs peft's own forward (the kernels take no float64)
    ref, want = run(float64_copy(ref_model)), run(plain)
    model = lora_model(fused)
    activations.apply_checkpointing(layers(model), "all", offload=True)
    same(f"LoRA ({'fused' if fused else 'peft'}) + checkpointing + offload: bitwise", run(model), want)
    model = lora_model(fused)
    activations.apply_checkpointing(layers(model), "1,2")
    tiled_mlp.apply_tiled_mlp(layers(model), 5)
    got = run(model)
    adapters = [n for n, g in got[1].items() if "lora_" in n]
    assert adapters and all(got[1][n] is not None and got[1][n].abs().sum() > 0 for n in adapters)
    assert all(g is None for n, g in got[1].items() if "lora_" not in n)
    close(f"LoRA ({'fused' if fused else 'peft'}) + 1,2 + tiled MLP (5): {len(adapters)} adapter gradients",
          got, want, ref)


@CPU_ONLY
def test_with_fp8_projections():
    """FP8 scales the weight-gradient matmul's inputs per column over the tokens: per chunk, the tiled
    MLP quantizes with other scales, so it must be as close to float64 as the untiled FP8 model (x2)."""
    import fp8_linear_kernel

    plain = tiny()
    ref = run(float64_copy(plain))

    def fp8(seed=0):
        model = tiny(seed)
        assert fp8_linear_kernel.patch_model(model) == fp8_linear_kernel.expected_patches(model.config)
        return model

    want = run(fp8())
    model = fp8()
    activations.apply_checkpointing(layers(model), "every:2", offload=True)
    same("FP8 + every:2 + offload: bitwise the FP8 model", run(model), want)
    model = fp8()
    tiled_mlp.apply_tiled_mlp(layers(model), 7)
    close("FP8 + tiled MLP (7), against the untiled FP8 model's error", run(model), want, ref)


@CPU_ONLY
def test_prepare_model_applies_the_options():
    """The command line through models.prepare_model (the default kernels, LoRA): the flags reach the
    layers, and a training step runs."""
    from playbook.run import training

    parser = make_parser("test", kernels_default=DEFAULT_KERNELS)
    cfg = parse_config(parser, "finetune_optimized", ["--model", "llama-tiny", "--lora-r", "4", "--checkpoint-layers",
                                                      "every:2", "--offload-activations", "--mlp-chunk-tokens", "40",
                                                      "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--timing-warmup-steps", "0"])
    model = models.prepare_model(cfg)[0]
    stack = layers(model)
    assert [layer.gradient_checkpointing for layer in stack] == [i % 2 == 0 for i in range(len(stack))]
    assert activations.offload_of(stack) is not None
    assert all(layer.mlp.tiled_chunk_tokens == 40 and layer.mlp.forward.__func__ is tiled_mlp._tiled_forward
               for layer in stack)
    optimizer = make_optimizer(model, cfg.training, cfg.run)
    data = make_run_data(cfg, model)
    losses = [training.training_step(model, optimizer, [data.batch(i, DEVICE)])[0].item() for i in range(2)]
    assert all(math.isfinite(v) for v in losses), losses
    record(f"prepare_model: every:2 + offload + tiled MLP (40 of 64 tokens) + LoRA; losses {losses[0]:.3f}, "
           f"{losses[1]:.3f}", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# GPU: the memory actually drops
# ------------------------------------------------------------------------------------------------
def _peak_above_start(step) -> int:
    """Bytes allocated at the peak of step() above what was allocated before it."""
    torch.cuda.synchronize()
    gc.collect()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@GPU
@pytest.mark.big_gpu_memory
def test_gpu_tiled_mlp_lowers_the_peak():
    """LLaMA 3.1 8B's MLP (4096 -> 14336 -> 4096, bf16, weights trained) on 32,768 tokens, forward and
    backward: untiled it keeps gate, up, act(gate) and their product (4 x 0.94 GB) and makes their
    gradients; in chunks of 4,096 tokens one chunk's exist at a time (and fp32 weight-gradient sums,
    0.7 GB). The peak must drop by more than two [32768, 14336] intermediates."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    tokens, chunk = 32768, 4096
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, hidden_act="silu")
    torch.manual_seed(0)
    mlp = LlamaMLP(config).to("cuda", torch.bfloat16)
    x = torch.randn(1, tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, tokens, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        mlp(x).backward(dy)

    untiled = _peak_above_start(step)
    want = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]
    tiled_mlp.apply_tiled_mlp([types.SimpleNamespace(mlp=mlp)], chunk)  # a stand-in decoder layer
    tiled = _peak_above_start(step)
    got = [p.grad for p in mlp.parameters()] + [x.grad]
    inter = activations.mlp_intermediate_bytes(tokens, 14336)
    # bf16 gradients of a 32,768-token sum: the tiled one rounds each chunk's sum to bf16 first
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * w.float().abs().max().item())
    record(f"GPU tiled MLP: peak {untiled / 1e9:.2f} -> {tiled / 1e9:.2f} GB (one intermediate {inter / 1e9:.2f} GB)",
           tiled / 1e9, (untiled - 2 * inter) / 1e9, passed=untiled - tiled > 2 * inter)


@GPU
@pytest.mark.big_gpu_memory
def test_gpu_offload_lowers_the_peak():
    """12 decoder layers of the 8B's shape (bf16, frozen; the input requires a gradient) on 16,384
    tokens, every layer checkpointed: without offload the GPU holds 11 layer inputs (128 MiB each; the
    first is the caller's) at the start of backward, with offload about 2 (the layer being recomputed
    and the one fetched ahead), so the peak must drop by more than 6 of them."""
    from transformers import LlamaConfig, LlamaModel

    tokens, n_layers = 16384, 12
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=n_layers, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128, use_cache=False)
    config._attn_implementation = "sdpa"
    peaks = {}
    for offload in (False, True):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaModel(config).to(torch.bfloat16).train()
        model.requires_grad_(False)
        activations.apply_checkpointing(model.layers, "all", offload=offload)
        x = torch.randn(1, tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step():
            out = model(inputs_embeds=x).last_hidden_state
            out.float().square().mean().backward()

        step()  # the first step pins the host buffers
        peaks[offload] = _peak_above_start(step)
        if offload:
            pool = activations.offload_of(model.layers)
            assert pool.allocations == n_layers, pool.allocations
        del model, x
        gc.collect()
        torch.cuda.empty_cache()
    layer_input = activations.layer_input_bytes(tokens, 4096)
    record(f"GPU offload, {n_layers} layers at {tokens:,} tokens: peak {peaks[False] / 1e9:.2f} -> "
           f"{peaks[True] / 1e9:.2f} GB (layer input {layer_input / 2**20:.0f} MiB)", peaks[True] / 1e9,
           (peaks[False] - n_layers // 2 * layer_input) / 1e9, passed=peaks[False] - peaks[True] > n_layers // 2 * layer_input)


@GPU
@pytest.mark.big_gpu_memory
def test_gpu_offload_is_bitwise_the_checkpoint():
    """The tiny model on the GPU (fp32, eager attention: deterministic kernels): copies on the side
    stream, pinned buffers and events change nothing in the result."""
    want = None
    for offload in (False, True):
        model = tiny()
        activations.apply_checkpointing(layers(model), "all", offload=offload)
        results = [run(model) for _ in range(2)]  # the second step reuses the pinned buffers
        if want is None:
            want = results
        else:
            for got, w in zip(results, want):
                same("GPU: offloaded = checkpointed, bitwise", got, w)


@GPU
@pytest.mark.big_gpu_memory
def test_gpu_saved_activations_lower_the_peak_bitwise():
    """8 decoder layers of the 8B's shape (bf16, trained weights, the default kernels) on 8,192 tokens, the
    8B's batch: --recompute-norms must lower the peak by more than 3 of the 8 layers' norm output pairs
    (2 x [8192, 4096] bf16 each), --offload-layers first:6 by more than 3 layers' worth of what a layer
    saves, and both leave the loss and the gradients bitwise unchanged (side stream, pinned buffers).
    Attention is the eager one here: SDPA's fused backward adds into dq in no fixed order, so two runs of
    the same model differ in the last bits of q_proj's gradient whatever the hooks do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from playbook.model.registry import apply_kernels

    tokens, n_layers = 8192, 8
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=n_layers, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=1024, use_cache=False)
    config._attn_implementation = "eager"  # deterministic (see above)
    ids = torch.randint(0, 1024, (4, tokens // 4), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    peaks, results = {}, {}
    for name, recompute, offload in (("plain", False, None), ("norms", True, None), ("offload", False, "first:6")):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).to(torch.bfloat16).train()
        apply_kernels(model, [k for k in DEFAULT_KERNELS if k not in ("adamw", "lora")], verbose=False)
        if recompute or offload:
            saved_activations.apply_saved_activations(model.model.layers, recompute, offload)

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss

        step()  # the first step pins the host buffers
        peaks[name] = _peak_above_start(step)
        results[name] = loss_and_grads(model, ids, ids)
        # kept on the host: 3.5 GB of gradients per model, which the GPU need not hold beside the next model
        results[name] = (results[name][0].cpu(), {k: v.cpu() for k, v in results[name][1].items()})
        del model
        gc.collect()
        torch.cuda.empty_cache()
    norm_pair = 2 * activations.layer_input_bytes(tokens, 4096)
    same("GPU: norms recomputed, bitwise", results["norms"], results["plain"])
    same("GPU: first:6 offloaded, bitwise", results["offload"], results["plain"])
    per_layer = (peaks["plain"] - peaks["norms"]) / n_layers  # not used as a bound: reported
    record(f"GPU norms: peak {peaks['plain'] / 1e9:.2f} -> {peaks['norms'] / 1e9:.2f} GB ({per_layer / 1e6:.0f} MB a "
           f"layer; a norm pair {norm_pair / 1e6:.0f} MB)", peaks["norms"] / 1e9, (peaks["plain"] - 3 * norm_pair) / 1e9,
           passed=peaks["plain"] - peaks["norms"] > 3 * norm_pair)
    saved_layer = 26 * activations.layer_input_bytes(tokens, 4096) // 2  # ~13 N H of the ~27 N H a layer saves
    record(f"GPU offload first:6: peak {peaks['plain'] / 1e9:.2f} -> {peaks['offload'] / 1e9:.2f} GB",
           peaks["offload"] / 1e9, (peaks["plain"] - 3 * saved_layer) / 1e9,
           passed=peaks["plain"] - peaks["offload"] > 3 * saved_layer)


@GPU
def test_gpu_pinned_buffers_are_exact_and_pinned():
    """The offload's host buffers: pinned (so copies are asynchronous DMA), exactly the size asked for (not
    rounded up to a power of two as PyTorch's pinned-memory allocator does), and copies through them exact."""
    numel = 3 * 2**20 + 5
    buf = host_offload._pinned(numel, torch.bfloat16)
    assert buf.is_pinned() and buf.numel() == numel and buf.untyped_storage().nbytes() == 2 * numel
    src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    buf.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    same_bits = torch.equal(back, src)
    record(f"GPU pinned buffer of {numel:,} bf16 values: pinned, {buf.untyped_storage().nbytes():,} bytes, round trip "
           f"exact {same_bits}", 0.0, 0.0, passed=same_bits)


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "Memory options: test report"))
