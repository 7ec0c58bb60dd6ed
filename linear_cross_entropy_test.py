"""Tests of the fused linear cross-entropy: loss, dx and dW against float64, chunking, edge cases.

    $ python linear_cross_entropy_test.py  # a readable report: every check, its error and tolerance
    $ pytest linear_cross_entropy_test.py  # the same tests under pytest

Every numeric check compares three computations of cross_entropy(x @ W.T, targets): ours, Hugging
Face's way in the same dtype (full logits, upcast to fp32), and float64. Tolerances follow the rule
in testkit/__init__.py (at most 2x PyTorch's own error, plus one ulp of the output scale) unless a test
explains otherwise. Small chunks force the multi-chunk path at sizes the interpreter can run.
The lm_head's bias (and its gradient) and the cross-entropy's options are checked the same way;
their own arithmetic is tested in cross_entropy_test.py, here that they reach every chunk. The
drop-in module, TritonLinearCrossEntropyLoss, is checked against torch.nn.CrossEntropyLoss with
the same arguments on the full logits.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import re
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linear_cross_entropy_kernel
from cross_entropy_kernel import z_loss_ref
from cross_entropy_test import model_close, model_error, model_step, tiny_gemma2, tiny_llama
from core.kernel_utils import DEVICE
from linear_cross_entropy_kernel import (TritonLinearCrossEntropyLoss, causal_lm_forward, chunk_tokens, flops,
                                         ideal_bytes, linear_cross_entropy, linear_cross_entropy_ref)
from testkit import ULP, close_to_reference, exactly, expect_error, record, run_as_script

ON_GPU = DEVICE.type == "cuda"


def _inputs(n, h, v, dtype, seed=0, ignore=()):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(n, h, generator=g)).to(device=DEVICE, dtype=dtype)
    w = (torch.randn(v, h, generator=g) * h**-0.5 * 3).to(device=DEVICE, dtype=dtype)  # logits ~ N(0, 3)
    t = torch.randint(0, v, (n,), generator=g)
    for i in ignore:
        t[i] = -100
    return x, w, t.to(DEVICE)


def _upstream(loss, seed=2):
    """3.0 for a reduced loss; a random weight per row for reduction='none'."""
    if loss.dim() == 0:
        return torch.tensor(3.0, device=loss.device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(loss.shape, generator=g) * 2 - 0.5).to(loss.device)


def _run(fn, x, w, t, reduction="mean", **kw):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w, t, reduction=reduction, **kw)
    (loss.float() * _upstream(loss)).sum().backward()
    return loss.detach(), x.grad, w.grad


def _check(tag, x, w, t, reduction="mean", **kw):
    dtype, n, v = x.dtype, x.reshape(-1, x.shape[-1]).shape[0], w.shape[0]
    ours = _run(linear_cross_entropy, x, w, t, reduction, **kw)
    same = _run(linear_cross_entropy_ref, x, w, t, reduction)  # HF's way, in this dtype
    ref = _run(linear_cross_entropy_ref, x.double(), w.double(), t, reduction)  # float64 truth
    assert ours[0].dtype == torch.float32, "the loss is fp32 whatever the input dtype"
    close_to_reference(f"{tag} loss", ours[0], same[0], ref[0], torch.float32, n=v)
    close_to_reference(f"{tag} dx", ours[1], same[1], ref[1], dtype, n=v)
    close_to_reference(f"{tag} dW", ours[2], same[2], ref[2], dtype, n=n)
    return ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_matches_reference(chunk, reduction, dtype):
    """chunk=None: all 50 tokens in one chunk; 16: four chunks, the last one short (2 tokens)."""
    x, w, t = _inputs(50, 32, 131, dtype, ignore=(3, 17, 40))
    _check(f"{reduction} chunk={chunk}", x, w, t, reduction, chunk=chunk)


def test_chunking_does_not_change_loss_or_dx():
    """Each token's loss and dx depend on its own row only: the same bits whatever the chunk size."""
    x, w, t = _inputs(40, 16, 200, torch.bfloat16, seed=1, ignore=(5,))
    one = _run(linear_cross_entropy, x, w, t, "none")
    many = _run(linear_cross_entropy, x, w, t, "none", chunk=7)
    exactly("per-token loss, 1 chunk vs 6", many[0], one[0])
    exactly("dx, 1 chunk vs 6", many[1], one[1])


def test_fp32_accumulation_beats_rounding_per_chunk():
    """dW summed over 16 chunks: an fp32 accumulator must stay at one-matmul accuracy; rounding the
    running sum to bf16 after every chunk must be measurably worse (else the fp32 path is not on)."""
    chunks, chunk = 16, 2
    x, w, t = _inputs(chunks * chunk, 16, 48, torch.bfloat16, seed=2)
    ref = _run(linear_cross_entropy_ref, x.double(), w.double(), t, "sum")
    same = _run(linear_cross_entropy_ref, x, w, t, "sum")
    acc32 = _run(linear_cross_entropy, x, w, t, "sum", chunk=chunk)
    acc16 = _run(linear_cross_entropy, x, w, t, "sum", chunk=chunk, accumulate_fp32=False)
    close_to_reference(f"dW, {chunks} chunks, fp32 accumulator", acc32[2], same[2], ref[2], torch.bfloat16,
                       n=chunks * chunk)
    err32 = (acc32[2].double() - ref[2]).abs().max().item()
    err16 = (acc16[2].double() - ref[2]).abs().max().item()
    # bf16 running sum: each of the 16 additions may round by half an ulp of the sum, so its error
    # may grow to 16 x 0.5 ulp; it stays far below that in practice but above the fp32 path.
    bound = chunks * 0.5 * ULP[torch.bfloat16] * ref[2].abs().max().item()
    record(f"dW, bf16 running sum: within {chunks} half-ulps", err16, bound, err16 <= bound)
    record("dW error: fp32 accumulator < bf16 running sum", err32, err16, err32 < err16)


def test_accumulate_in_weight_dtype_matches_reference_for_few_chunks():
    """accumulate_fp32=False with 2 chunks: one extra rounding of the sum (one more ulp)."""
    x, w, t = _inputs(64, 32, 256, torch.bfloat16, seed=3, ignore=(0, 1))
    ours = _run(linear_cross_entropy, x, w, t, "mean", chunk=32, accumulate_fp32=False)
    same = _run(linear_cross_entropy_ref, x, w, t, "mean")
    ref = _run(linear_cross_entropy_ref, x.double(), w.double(), t, "mean")
    close_to_reference("dW, bf16 running sum over 2 chunks", ours[2], same[2], ref[2], torch.bfloat16, n=64)


def test_tied_embeddings():
    """The lm_head weight is the input embedding: both uses' gradients must add up."""
    V, H, B, T = 120, 24, 2, 9
    g = torch.Generator(device="cpu").manual_seed(4)
    table = (torch.randn(V, H, generator=g) * 0.5).to(DEVICE)
    ids = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    labels = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    labels[0, 0] = -100

    def model(emb_weight, fused):
        h = torch.tanh(F.embedding(ids, emb_weight) * 2)  # a stand-in for the decoder
        if fused:
            return linear_cross_entropy(h, emb_weight, labels, chunk=5)
        return F.cross_entropy((h @ emb_weight.t()).reshape(-1, V), labels.reshape(-1))

    grads = {}
    for tag, weight, fused in (("ours", table.clone(), True), ("torch", table.clone(), False),
                               ("ref", table.double(), False)):
        weight.requires_grad_()
        model(weight, fused).backward()
        grads[tag] = weight.grad
    close_to_reference("tied embedding gradient (lookup + head)", grads["ours"], grads["torch"], grads["ref"],
                       torch.float32, n=B * T)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("which", ["x", "weight"])
def test_only_one_input_needs_grad(which, reduction):
    """A frozen lm_head (adapters) or frozen hidden states: only the needed gradient is computed
    (reduction="none" computes it in backward, from the per-token upstream gradients)."""
    x, w, t = _inputs(30, 16, 100, torch.float32, seed=5, ignore=(2,))
    xg, wg = x.clone().requires_grad_(which == "x"), w.clone().requires_grad_(which == "weight")
    loss = linear_cross_entropy(xg, wg, t, reduction=reduction, chunk=8)
    (loss * _upstream(loss)).sum().backward()
    xr, wr = x.double().requires_grad_(which == "x"), w.double().requires_grad_(which == "weight")
    ref_loss = linear_cross_entropy_ref(xr, wr, t, reduction=reduction)
    (ref_loss * _upstream(loss).double()).sum().backward()
    ours, ref = (xg.grad, xr.grad) if which == "x" else (wg.grad, wr.grad)
    other = wg.grad if which == "x" else xg.grad
    assert other is None, "the input that does not need a gradient must not get one"
    close_to_reference(f"only {which} needs grad, {reduction}", ours, ref.float(), ref, torch.float32, n=100)


def test_ignored_all_ignored_and_out_of_range_targets():
    x, w, t = _inputs(12, 16, 90, torch.float32, seed=6)
    t_all = torch.full_like(t, -100)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(xg, wg, t_all, chunk=5)
    assert loss.requires_grad, "an all-ignored loss stays attached to the graph"
    loss.backward()
    exactly("all ignored: mean loss is 0", loss, torch.tensor(0.0, device=DEVICE))
    exactly("all ignored: dx is 0", xg.grad, torch.zeros_like(x))
    exactly("all ignored: dW is 0", wg.grad, torch.zeros_like(w))
    bad = t.clone()
    bad[[1, 7]] = torch.tensor([90, -1], device=DEVICE)  # V and -1 are out of range
    rows = linear_cross_entropy(x, w, bad, reduction="none", chunk=5)
    expected = torch.zeros(12, dtype=torch.bool, device=DEVICE)
    expected[[1, 7]] = True
    exactly("out-of-range targets: NaN exactly on their rows", torch.isnan(rows), expected)
    assert torch.isnan(linear_cross_entropy(x, w, bad)), "a reduced loss with a bad target is NaN"


def test_empty_batch():
    x, w, _ = _inputs(0, 16, 50, torch.bfloat16)
    t = torch.zeros(0, dtype=torch.long, device=DEVICE)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(xg, wg, t)
    loss.backward()
    exactly("empty batch: loss 0", loss, torch.tensor(0.0, device=DEVICE))
    exactly("empty batch: dW 0", wg.grad, torch.zeros_like(w))
    assert xg.grad.shape == (0, 16)


def test_under_autocast():
    """fp32 weights under bf16 autocast: the head runs in bf16 like nn.Linear would, gradients
    come back in fp32, and the result matches Hugging Face's way under the same autocast."""
    x, w, t = _inputs(40, 32, 200, torch.float32, seed=10, ignore=(4,))
    device_type = DEVICE.type
    outs = []
    for fn in (lambda a, b: linear_cross_entropy(a, b, t, chunk=16), lambda a, b: linear_cross_entropy_ref(a, b, t)):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = fn(xg, wg)
        loss.backward()
        outs.append((loss.detach().float(), xg.grad, wg.grad))
    assert outs[0][1].dtype == torch.float32 and outs[0][2].dtype == torch.float32, "gradients in the weights' dtype"
    in_bf16 = linear_cross_entropy(x.bfloat16(), w.bfloat16(), t, chunk=16)
    exactly("autocast computes the head in bf16 (same bits as bf16 inputs)", outs[0][0], in_bf16.detach())
    ref = _run(linear_cross_entropy_ref, x.bfloat16().double(), w.bfloat16().double(), t, "mean")
    # The truth here is float64 on the bf16-rounded inputs (what autocast computes with); the upstream
    # gradient of _run is 3.0, so its gradients are scaled by 1/3 to compare with a plain backward.
    close_to_reference("autocast loss", outs[0][0], outs[1][0], ref[0], torch.float32, n=200)
    close_to_reference("autocast dx", outs[0][1], outs[1][1], ref[1] / 3, torch.bfloat16, n=200)
    close_to_reference("autocast dW", outs[0][2], outs[1][2], ref[2] / 3, torch.bfloat16, n=40)


def test_meta_device_gives_shapes():
    """A patched model built on the meta device (to count its sizes before loading weights) runs its loss:
    there is no autocast on the meta device, so the autocast check must not ask for it, and the
    operators' fake functions give the loss's and the gradients' shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=176, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert linear_cross_entropy_kernel.patch_model(model) == 1
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert (loss.device.type, loss.shape, model.lm_head.weight.grad.shape) == ("meta", (), (512, 64))


def test_batch_and_sequence_dims():
    B, T, H, V = 2, 7, 16, 130
    x, w, t = _inputs(B * T, H, V, torch.float32, seed=7, ignore=(0,))
    loss = linear_cross_entropy(x.view(B, T, H), w, t.view(B, T), reduction="none", chunk=4)
    assert loss.shape == (B * T,), "reduction='none' returns one loss per token, flattened"
    ref = linear_cross_entropy_ref(x.double(), w.double(), t, reduction="none")
    close_to_reference("[B, T, H] inputs, per-token loss", loss, ref.float(), ref, torch.float32, n=V)


@pytest.mark.parametrize("kind, reduction", [("column of [N, 2]", "none"), ("expanded constant", "mean"),
                                             ("labels[:, 1:] of a batch", "mean")])
def test_strided_targets(kind, reduction):
    """Each chunk's kernel reads its targets with their stride: 2, 0, or a [B, T] slice."""
    B, T, H, V = 3, 10, 16, 61
    g = torch.Generator(device="cpu").manual_seed(11)
    if kind == "column of [N, 2]":
        targets = torch.randint(0, V, (B * T, 2), generator=g).to(DEVICE)[:, 1]
    elif kind == "expanded constant":
        targets = torch.full((1,), V - 1, device=DEVICE).expand(B * T)
    else:
        labels = torch.randint(0, V, (B, T + 1), generator=g).to(DEVICE)
        labels[1, 4] = -100
        targets = labels[:, 1:]
    assert not targets.is_contiguous()
    x, w, _ = _inputs(B * T, H, V, torch.float32, seed=11)
    x = x.view(B, T, H) if targets.dim() == 2 else x
    _check(f"targets: {kind}, {reduction}, chunks of 8", x, w, targets, reduction, chunk=8)


def test_frozen_weight_costs_no_grad_weight_work(monkeypatch):
    """A frozen lm_head (LoRA trains adapters beside it): no dW, no fp32 accumulator, no .grad.
    Every allocation of the pass is watched; the same run with a trainable weight must show the
    [V, H] fp32 accumulator, which proves the watch would see it."""
    x, w, t = _inputs(32, 16, 96, torch.bfloat16, seed=12, ignore=(5,))
    seen = []
    for name in ("empty", "zeros", "empty_like", "zeros_like"):
        original = getattr(torch, name)

        def watched(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            seen.append((tuple(out.shape), out.dtype))
            return out

        monkeypatch.setattr(torch, name, watched)
    for weight_trains in (True, False):
        seen.clear()
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_(weight_trains)
        linear_cross_entropy(xg, wg, t, chunk=8).backward()  # 4 chunks: the accumulator is needed
        weight_sized = [s for s in seen if s[0] == tuple(w.shape)]
        if weight_trains:
            assert (tuple(w.shape), torch.float32) in weight_sized, "the watch must see the fp32 accumulator"
            continue
        assert wg.grad is None, "a frozen weight must get no gradient"
        record("frozen weight: [V, H] buffers allocated", len(weight_sized), 0, not weight_sized)
    monkeypatch.undo()
    xr = x.double().requires_grad_()
    linear_cross_entropy_ref(xr, w.double(), t).backward()
    xs = x.clone().requires_grad_()
    linear_cross_entropy_ref(xs, w, t).backward()
    close_to_reference("frozen weight: dx", xg.grad, xs.grad, xr.grad, torch.bfloat16, n=96)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_order_gradients_raise(reduction):
    x, w, t = _inputs(10, 8, 40, torch.float32, seed=13)
    xg = x.clone().requires_grad_()
    loss = linear_cross_entropy(xg, w, t, reduction=reduction, chunk=4).sum()
    with pytest.raises(RuntimeError, match="no second derivative"):
        (g,) = torch.autograd.grad(loss, xg, create_graph=True)
        (g * g).sum().backward()
    record(f"create_graph=True, {reduction}: clear error", 0.0, 0.0, True)


def test_backward_twice_is_refused():
    x, w, t = _inputs(6, 8, 20, torch.float32)
    loss = linear_cross_entropy(x.requires_grad_(), w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward once"):
        loss.backward()
    record("second backward raises a clear error", 0.0, 0.0, True)


def test_no_grad_forward_still_computes_the_loss():
    x, w, t = _inputs(20, 16, 100, torch.bfloat16, seed=8)
    with torch.no_grad():  # inputs that require grad, under no_grad (evaluation): loss only
        loss = linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), t, chunk=6)
    assert loss.grad_fn is None
    ref = linear_cross_entropy_ref(x.double(), w.double(), t)
    same = linear_cross_entropy_ref(x, w, t)
    close_to_reference("loss under no_grad", loss, same, ref, torch.float32, n=100)


def test_chunk_size_from_memory_budget():
    assert chunk_tokens(16384, 128256, torch.bfloat16) == 2048, "512 MiB of bf16 logits = 2048 LLaMA tokens"
    assert chunk_tokens(100, 128256, torch.bfloat16) == 100, "never more than the tokens there are"
    assert chunk_tokens(16384, 128256, torch.float32) == 1024
    acc = 128256 * 4096 * 4  # LLaMA 3.1 8B's fp32 weight-gradient accumulator, 2.1 GB
    assert chunk_tokens(8192, 128256, torch.bfloat16, accumulator_bytes=acc) == 8192, \
        "4 x 2048 tokens: 2.1 GB of logits fit in the buffer + the accumulator chunking would need: one chunk"
    assert chunk_tokens(16384, 128256, torch.bfloat16, accumulator_bytes=acc) == 2048, "4.2 GB do not: chunks"
    record("chunk sizes from the 512 MiB budget (+ the accumulator one chunk saves)", 0.0, 0.0, True)


def test_one_chunk_when_it_saves_the_accumulator(monkeypatch):
    """With a trainable weight, a batch whose logits fit in buffer + fp32 accumulator runs as one chunk
    (no accumulator); with a frozen weight (no accumulator to save) it keeps the buffer budget."""
    import linear_cross_entropy_kernel as lce
    seen = []
    real = lce.chunk_tokens
    monkeypatch.setattr(lce, "chunk_tokens", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    # budget: 4 tokens of V = 100 bf16 logits (800 B); the fp32 accumulator is V x H x 4 = 6400 B
    monkeypatch.setattr(lce, "CHUNK_BYTES", 800)
    monkeypatch.setattr(lce, "CHUNK_MULTIPLE", 1)
    x, w, t = _inputs(20, 16, 100, torch.float32, seed=9)
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    linear_cross_entropy(xb, wb, t).backward()  # 20 x 100 x 2 B = 4000 <= 800 + 6400: one chunk
    wb.requires_grad_(False)
    linear_cross_entropy(xb, wb, t).backward()  # frozen weight: 4 tokens per 800 B chunk
    exactly("chunk sizes: trainable weight, frozen weight", torch.tensor(seen), torch.tensor([20, 4]))


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4)), TypeError, id="float targets"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(10, 6), torch.zeros(4, dtype=torch.long)),
                     ValueError, id="hidden size mismatch"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long)),
                     ValueError, id="token count mismatch"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(10, 8).bfloat16(), torch.zeros(4, dtype=torch.long)),
                     TypeError, id="dtype mismatch"),
        pytest.param(lambda: (torch.randn(8), torch.randn(10, 8), torch.zeros(1, dtype=torch.long)),
                     ValueError, id="1-D x"),
    ],
)
def test_bad_input_gives_clear_error(make, error):
    x, w, t = make()
    expect_error(error, linear_cross_entropy, x.to(DEVICE), w.to(DEVICE), t.to(DEVICE))


def test_bad_options_give_clear_errors():
    x, w, t = _inputs(4, 8, 10, torch.float32)
    expect_error(ValueError, lambda: linear_cross_entropy(x, w, t, chunk=0))
    expect_error(ValueError, lambda: linear_cross_entropy(x, w, t, reduction="avg"))


# ---------------------------------------------------------------------------- options
# The lm_head's bias and the cross-entropy's options (class weights `ce_weight`, label smoothing,
# z-loss, softcap), checked as above: loss, dx, dW and dbias against Hugging Face's way in the
# same dtype (F.linear with the bias, fp32 cross-entropy) and against float64.
def _bias(v, dtype, seed=40):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(v, generator=g).to(device=DEVICE, dtype=dtype)


def _ce_weight(v, seed=41):
    """Class weights in [0.25, 1.75): far from uniform, so a missing or misplaced weight shows."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(v, generator=g) * 1.5 + 0.25).to(DEVICE)


def _options(name, v):
    """The option sets under test. Each option's own arithmetic is the cross-entropy kernel's,
    tested there; here it must reach every chunk's kernel, with the whole batch's divisors. The
    z-loss coefficient is 1e-2, large enough to check; the logits are ~N(0, 3), which a cap of 4
    bends strongly."""
    return {
        "bias": dict(),
        "bias and all options": dict(ce_weight=_ce_weight(v), label_smoothing=0.1, lse_square_scale=1e-2, softcap=4.0),
    }[name]


def _run_with_bias(fn, x, w, b, t, reduction="mean", **kw):
    x, w, b = (a.detach().clone().requires_grad_() for a in (x, w, b))
    loss = fn(x, w, t, reduction=reduction, bias=b, **kw)
    (loss.float() * _upstream(loss)).sum().backward()
    return loss.detach(), x.grad, w.grad, b.grad


def _check_with_bias(tag, x, w, b, t, reduction="mean", chunk=None, **options):
    n, v = x.shape[0], w.shape[0]
    ours = _run_with_bias(linear_cross_entropy, x, w, b, t, reduction, chunk=chunk, **options)
    same = _run_with_bias(linear_cross_entropy_ref, x, w, b, t, reduction, **options)  # HF's way, in this dtype
    ref = _run_with_bias(linear_cross_entropy_ref, x.double(), w.double(), b.double(), t, reduction, **options)
    close_to_reference(f"{tag} loss", ours[0], same[0], ref[0], torch.float32, n=v)
    close_to_reference(f"{tag} dx", ours[1], same[1], ref[1], x.dtype, n=v)
    close_to_reference(f"{tag} dW", ours[2], same[2], ref[2], x.dtype, n=n)
    close_to_reference(f"{tag} dbias", ours[3], same[3], ref[3], x.dtype, n=n)  # a column sum over n tokens


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", ["bias", "bias and all options"])
def test_bias_and_options_match_reference(option, dtype, reduction):
    """24 tokens in chunks of 10 (the last one short), V = 257, three ignored tokens."""
    v = 257
    x, w, t = _inputs(24, 16, v, dtype, seed=42, ignore=(3, 17, 22))
    _check_with_bias(f"{option}, {reduction}", x, w, _bias(v, dtype), t, reduction, chunk=10, **_options(option, v))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_only_the_bias_needs_grad(reduction):
    """x and W frozen, the bias trained: only dbias is computed (for reduction="none" in backward,
    from the per-token upstream gradients)."""
    v = 100
    x, w, t = _inputs(30, 16, v, torch.float32, seed=43, ignore=(2,))
    b = _bias(v, torch.float32)
    bg = b.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, t, reduction=reduction, chunk=8, bias=bg, label_smoothing=0.1)
    (loss * _upstream(loss)).sum().backward()
    br = b.double().requires_grad_()
    ref = linear_cross_entropy_ref(x.double(), w.double(), t, reduction=reduction, bias=br, label_smoothing=0.1)
    (ref * _upstream(loss).double()).sum().backward()
    close_to_reference(f"only the bias needs grad, {reduction}", bg.grad, br.grad.float(), br.grad, torch.float32, n=30)


def test_all_ignored_with_bias_and_options():
    """Every token ignored: loss, z-loss and accuracy 0, dx, dW and dbias 0, no prediction (-1)."""
    v = 90
    x, w, t = _inputs(12, 16, v, torch.float32, seed=44)
    t = torch.full_like(t, -100)
    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), _bias(v, torch.float32).requires_grad_()
    out = linear_cross_entropy(xg, wg, t, chunk=5, bias=bg, return_z_loss=True, return_token_accuracy=True,
                               return_predicted_tokens=True, **_options("bias and all options", v))
    assert out.loss.requires_grad, "an all-ignored loss stays attached to the graph"
    out.loss.backward()
    zero = torch.tensor(0.0, device=DEVICE)
    for name, got in (("loss", out.loss), ("z-loss", out.z_loss), ("accuracy", out.token_accuracy)):
        exactly(f"all ignored, all options: {name} 0", got, zero)
    exactly("all ignored, all options: predicted tokens -1", out.predicted_tokens, torch.full_like(t, -1))
    for name, grad in (("dx", xg.grad), ("dW", wg.grad), ("dbias", bg.grad)):
        exactly(f"all ignored, all options: {name} 0", grad, torch.zeros_like(grad))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_extras_across_chunks(reduction):
    """Predicted tokens are torch.argmax of x @ W.T + b, token by token across 4 chunks (-1 on
    ignored tokens); the accuracy is their share of correct non-ignored tokens; the z-loss is
    lse_square_scale * lse^2 reduced like the loss; asking for them changes nothing else."""
    v, scale = 200, 1e-2
    x, w, t = _inputs(30, 16, v, torch.float32, seed=45, ignore=(0, 11))
    b = _bias(v, torch.float32)
    logits = F.linear(x, w, b)
    best = logits.argmax(-1)  # fp32, random: no two logits of a row within rounding of each other
    t[20:26] = best[20:26]  # some tokens right, so the accuracy is neither 0 nor 1
    scored = t != -100
    xg = x.clone().requires_grad_()
    out = linear_cross_entropy(xg, w, t, reduction=reduction, chunk=8, bias=b, lse_square_scale=scale,
                               return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)
    exactly(f"{reduction}: predicted tokens == torch.argmax", out.predicted_tokens, torch.where(scored, best, -1))
    exactly(f"{reduction}: token accuracy", out.token_accuracy, ((best == t) & scored).sum() / scored.sum())
    ref = z_loss_ref(logits.double(), t, -100, reduction, scale)
    same = z_loss_ref(logits, t, -100, reduction, scale)
    close_to_reference(f"{reduction}: z-loss alone", out.z_loss, same, ref, torch.float32, n=v)  # as in the CE tests
    plain = linear_cross_entropy(x, w, t, reduction=reduction, chunk=8, bias=b, lse_square_scale=scale)
    exactly(f"{reduction}: the loss is unchanged by the extras", out.loss, plain)
    assert not (out.z_loss.requires_grad or out.token_accuracy.requires_grad), "the extras carry no gradient"
    out.loss.sum().backward()  # and the loss still does


@pytest.mark.parametrize(
    "make, error, words",
    [
        pytest.param(lambda v: dict(bias=torch.zeros(v + 1)), ValueError, "bias", id="bias of the wrong length"),
        pytest.param(lambda v: dict(bias=torch.zeros(v, dtype=torch.bfloat16)), TypeError, "bias",
                     id="bias dtype mismatch"),
        pytest.param(lambda v: dict(ce_weight=torch.ones(v - 1)), ValueError, "ce_weight", id="ce_weight wrong length"),
        pytest.param(lambda v: dict(label_smoothing=1.5), ValueError, "label_smoothing", id="label_smoothing > 1"),
        pytest.param(lambda v: dict(softcap=-1.0), ValueError, "softcap", id="softcap < 0"),
    ],
)
def test_bad_bias_and_options_give_clear_errors(make, error, words):
    x, w, t = _inputs(4, 8, 10, torch.float32)
    options = {k: (a.to(DEVICE) if isinstance(a, torch.Tensor) else a) for k, a in make(10).items()}
    message = expect_error(error, lambda: linear_cross_entropy(x, w, t, **options))
    assert words in message


# ---------------------------------------------------------------------------- drop-in module
# TritonLinearCrossEntropyLoss(hidden, W, targets, bias) against torch.nn.CrossEntropyLoss with the
# same arguments on F.linear(hidden, W, bias): the logits in the input's dtype upcast to fp32
# (Hugging Face's way, "same") and everything in float64 ("ref"). Loss, dx, dW and dbias, under a
# random upstream gradient, with the testkit rule as in _check_with_bias.
def _module_run(loss_fn, x, w, b, t):
    x, w, b = (a.detach().clone().requires_grad_() for a in (x, w, b))
    loss = loss_fn(x, w, t, b)
    (loss.float() * _upstream(loss)).sum().backward()
    return loss.detach(), x.grad, w.grad, b.grad


def _torch_head_loss(dtype, ce_weight=None, z_loss=None, chunk=None, **kwargs):
    """PyTorch's module on the full logits in `dtype` (fp32 for low-precision inputs, as HF upcasts)."""
    module = nn.CrossEntropyLoss(weight=None if ce_weight is None else ce_weight.to(dtype), **kwargs)

    def loss_fn(x, w, t, b):
        logits = F.linear(x, w, b).to(dtype)
        loss = module(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))
        return loss.view(t.shape) if loss.dim() else loss
    return loss_fn


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", ["plain", "ignore_index=3, weight + label_smoothing"])
def test_module_matches_torch_cross_entropy_loss(option, dtype, reduction):
    """hidden [B, T, H] = [2, 12, 16] with targets [2, 12], a biased head of V = 257, chunks of 10
    tokens (the last one short); two ignored tokens."""
    B, T, v = 2, 12, 257
    kwargs = dict(reduction=reduction, chunk=10)
    if option != "plain":
        kwargs.update(ignore_index=3, ce_weight=_ce_weight(v), label_smoothing=0.1)
    x, w, t = _inputs(B * T, 16, v, dtype, seed=60)
    t[[2, 17]] = kwargs.get("ignore_index", -100)
    x, t, b = x.view(B, T, 16), t.view(B, T), _bias(v, dtype)
    ours = _module_run(TritonLinearCrossEntropyLoss(**kwargs), x, w, b, t)
    same = _module_run(_torch_head_loss(torch.float32, **kwargs), x, w, b, t)
    ref = _module_run(_torch_head_loss(torch.float64, **kwargs), x.double(), w.double(), b.double(), t)
    assert ours[0].shape == ref[0].shape, "reduction='none' gives the targets' shape [B, T]"
    tag = f"module {option}, {reduction}, {dtype}"
    close_to_reference(f"{tag}: loss", ours[0], same[0], ref[0], torch.float32, n=v)  # fp32 loss, a sum over V
    close_to_reference(f"{tag}: dx", ours[1], same[1], ref[1], dtype, n=v)  # sums over V classes
    close_to_reference(f"{tag}: dW", ours[2], same[2], ref[2], dtype, n=B * T)  # sums over the tokens
    close_to_reference(f"{tag}: dbias", ours[3], same[3], ref[3], dtype, n=B * T)


def test_module_z_loss_softcap_and_arguments():
    """The options PyTorch's module lacks (z_loss, softcap) against linear_cross_entropy_ref in
    float64 (loss only: their gradients are the function's, tested above); the class weights are
    a buffer; bad arguments are refused at construction."""
    v = 100
    x, w, t = _inputs(20, 16, v, torch.float32, seed=61, ignore=(4,))
    loss_fn = TritonLinearCrossEntropyLoss(ce_weight=_ce_weight(v), z_loss=1e-2, softcap=4.0, chunk=8)
    options = dict(ce_weight=_ce_weight(v), lse_square_scale=1e-2, softcap=4.0)
    ref = linear_cross_entropy_ref(x.double(), w.double(), t, **options)
    same = linear_cross_entropy_ref(x, w, t, **options)
    close_to_reference("module z_loss + softcap: loss", loss_fn(x, w, t), same, ref, torch.float32, n=v)
    assert list(loss_fn.state_dict()) == ["ce_weight"], "the class weights are a buffer"
    for bad, words in ((dict(reduction="avg"), "reduction"), (dict(chunk=0), "chunk"),
                       (dict(label_smoothing=2.0), "label_smoothing"), (dict(ce_weight=torch.ones(2, 2)), "1-D")):
        assert words in expect_error(ValueError, lambda: TritonLinearCrossEntropyLoss(**bad))


# ---------------------------------------------------------------------------- custom ops, compile
def test_opcheck_every_op():
    """torch.library.opcheck on both ops: schema, fake tensors (placeholders included), AOT
    dispatch (forward and, where inputs require grad, the registered backward), autograd
    registration. The backward op is called from backward only: its inputs need no grad."""
    x, w, t = _inputs(12, 8, 30, torch.float32, seed=14, ignore=(3,))
    row_grads = _upstream(torch.empty(12, device=DEVICE))
    ops = torch.ops.playbook
    cases = [
        ("fwd, mean, dx and dW, 3 chunks", ops.linear_cross_entropy_fwd.default,
         (x, w, t, -100, "mean", True, True, True, 5)),
        ("fwd, none, loss only, bf16", ops.linear_cross_entropy_fwd.default,
         (x.bfloat16(), w.bfloat16(), t, -100, "none", False, False, True, None)),
        ("fwd, mean, x and W require grad, 3 chunks", ops.linear_cross_entropy_fwd.default,
         (x.clone().requires_grad_(), w.clone().requires_grad_(), t, -100, "mean", True, True, True, 5)),
        ("fwd, none, x requires grad (gradient in backward)", ops.linear_cross_entropy_fwd.default,
         (x.clone().requires_grad_(), w, t, -100, "none", True, False, True, 5)),
        ("bwd, dW only", ops.linear_cross_entropy_bwd.default, (x, w, t, row_grads, -100, False, True, True, 5)),
    ]
    for name, op, args in cases:
        result = torch.library.opcheck(op, args)
        passed = all(v == "SUCCESS" for v in result.values())
        record(f"opcheck {name}", 0.0, 0.0, passed, note="" if passed else str(result))


def test_torch_compile_fullgraph_matches_eager():
    """One opaque op: Dynamo never reaches the mixed-dtype matmuls of the chunk loop."""
    x, w, t = _inputs(24, 16, 60, torch.float32, seed=15, ignore=(2,))

    def head_loss(a, b):
        return linear_cross_entropy(torch.tanh(a), b, t, chunk=8) * 3

    results = []
    for fn in (head_loss, torch.compile(head_loss, fullgraph=True)):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xg, wg)
        loss.backward()
        results.append((loss.detach(), xg.grad, wg.grad))
    eager, compiled = results
    # The same op on the same inputs; only tanh and its backward around it are inductor's code,
    # which may differ from eager by an fp32 ulp per element (testkit's rule with torch_impl = ref).
    for i, name in enumerate(("loss", "dx", "dW")):
        close_to_reference(f"compiled {name}", compiled[i], eager[i], eager[i], torch.float32, n=60)


def test_opcheck_with_bias_and_options():
    """Both ops with the bias, every option and the extras: their placeholders and fake shapes."""
    x, w, t = _inputs(8, 8, 20, torch.float32, seed=46, ignore=(3,))
    b, cw = _bias(20, torch.float32), _ce_weight(20)
    row_grads = _upstream(torch.empty(8, device=DEVICE))
    ops = torch.ops.playbook
    cases = [
        ("fwd, mean, dx, dW and dbias, all options and extras, 2 chunks", ops.linear_cross_entropy_fwd.default,
         (x, w, t, -100, "mean", True, True, True, 5, b, True, cw, 0.1, 1e-2, 4.0, True, True)),
        ("fwd, sum, x, W and bias require grad, all options and extras", ops.linear_cross_entropy_fwd.default,
         (*(a.clone().requires_grad_() for a in (x, w)), t, -100, "sum", True, True, True, 5,
          b.clone().requires_grad_(), True, cw, 0.1, 1e-2, 4.0, True, True)),
        ("bwd, dbias only, all options", ops.linear_cross_entropy_bwd.default,
         (x, w, t, row_grads, -100, False, False, True, 5, b, True, cw, 0.1, 1e-2, 4.0)),
    ]
    for name, op, args in cases:
        result = torch.library.opcheck(op, args)
        passed = all(v == "SUCCESS" for v in result.values())
        record(f"opcheck {name}", 0.0, 0.0, passed, note="" if passed else str(result))


# ---------------------------------------------------------------------------- Hugging Face model
def test_patch_model_matches_hugging_face_and_torch_compile():
    """patch_model fuses lm_head with the loss (1 replacement, as expected_patches says): the same
    loss and gradients as Hugging Face, no logits with labels, logits without; torch.compile too."""
    model = tiny_llama()
    reference = model_step(model)
    count = linear_cross_entropy_kernel.patch_model(model)
    assert count == 1 == linear_cross_entropy_kernel.expected_patches(model.config)
    eager = model_step(model)
    assert eager[1].logits is None, "with labels the logits are never built"
    # fp32 throughout; the fused loss sums in another order than PyTorch (and the head's matmul is
    # split in chunks of tokens): a few fp32 ulps (2^-23 = 1.2e-7) that 2 layers of backward
    # amplify. 1e-5 relative allows ~80 ulps, while a wrong shift, mean or missing gradient term
    # is an O(1) relative error.
    model_close("patched vs Hugging Face (eager)", eager, reference)
    with torch.no_grad():
        ids = torch.arange(12, device=DEVICE).view(2, 6)
        logits = model(input_ids=ids).logits
        expected = model.lm_head(model.model(input_ids=ids).last_hidden_state)
    exactly("without labels: the usual logits", logits, expected)
    # aot_eager: Dynamo, functionalization and the forward/backward partition without inductor's
    # C++ compilation of the whole model (see the cross-entropy test of the same name).
    compiled = model_step(model, torch.compile(model, backend="aot_eager"))
    model_close("torch.compile(patched model) vs eager", compiled, eager)


def test_patch_model_on_a_softcapped_model():
    """Gemma 2 caps its logits (final_logit_softcapping) in the forward this patch replaces: the
    fused forward passes the cap to the loss as `softcap` and caps the logits it returns without
    labels, so it matches Hugging Face both ways; without the cap it would be measurably off."""
    model = tiny_gemma2()
    reference = model_step(model)
    ids = torch.arange(12, device=DEVICE).view(2, 6)
    with torch.no_grad():
        hf_logits = model(input_ids=ids).logits
    model.forward = types.MethodType(causal_lm_forward, model)  # what patch_model installs
    # fp32 throughout: a few ulps, as in test_patch_model_matches_hugging_face_and_torch_compile
    model_close("Gemma 2 (softcap 0.25): patched vs Hugging Face", model_step(model), reference)
    with torch.no_grad():
        exactly("Gemma 2 without labels: the capped logits", model(input_ids=ids).logits, hf_logits)
    model.config.final_logit_softcapping = None  # the fused forward now leaves the logits uncapped
    off = model_error(model_step(model), reference)
    # the test can tell: without the cap the gradients are off by far more than 1e-3 (100x the tolerance)
    record("Gemma 2: a fused forward without the cap is off (relative)", off, 1e-3, off > 1e-3)


def test_patch_model_with_a_biased_lm_head():
    """An lm_head with a bias: the fused forward passes it to the loss, and its gradient matches."""
    model = tiny_llama()
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True).to(DEVICE)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight)
        model.lm_head.bias.copy_(_bias(head.out_features, torch.float32) * 0.5)
    reference = model_step(model)
    assert "lm_head.bias" in reference[2], "the bias must get a gradient"
    linear_cross_entropy_kernel.patch_model(model)
    # fp32 throughout: a few ulps, as in test_patch_model_matches_hugging_face_and_torch_compile
    model_close("biased lm_head: patched vs Hugging Face", model_step(model), reference)


def test_patched_forward_passes_the_kv_cache_under_this_transformers_name(capfd):
    """transformers 5.24 renamed the KV cache `past_key_values` -> `cache` and warns at every call that
    passes the old name (5.40 removes it): the fused forward passes neither name unless a cache is
    given, and the cache under the name this version uses; generation with the cache works."""
    import warnings

    model = tiny_llama()
    linear_cross_entropy_kernel.patch_model(model)
    ids = torch.arange(12, device=DEVICE).view(2, 6)
    name = linear_cross_entropy_kernel._cache_name()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model(input_ids=ids, labels=ids)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            cached = model(input_ids=ids[:, -1:], use_cache=True, **{name: getattr(out, name)})
    assert cached.logits.shape == (2, 1, 512)
    assert "deprecated" not in capfd.readouterr().err  # transformers' own log line for the old name


def test_patch_model_refuses_a_wrapped_lm_head():
    model = tiny_llama()

    class Adapter(torch.nn.Module):  # how peft wraps a layer: the frozen layer as `base_layer`
        def __init__(self, base_layer):
            super().__init__()
            self.base_layer = base_layer
            self.weight = base_layer.weight

    model.lm_head = Adapter(model.lm_head)
    expect_error(NotImplementedError, linear_cross_entropy_kernel.patch_model, model)


def test_ideal_bytes_and_flops_match_the_docstring():
    """The docstring's hand counts for LLaMA 3.1 8B's head at 16384 tokens, bf16."""
    doc = linear_cross_entropy_kernel.__doc__
    n, h, v = 16384, 4096, 128256
    for label, backward in (("forward:", False), ("forward + backward:", True)):
        line = next(line for line in doc.splitlines() if line.strip().startswith(label))
        counted = int(re.search(r"= ([\d,]+) B", line).group(1).replace(",", ""))
        computed = ideal_bytes(n, h, v, torch.bfloat16, backward=backward)
        exactly(f"{label} {computed / 1e9:.3f} GB ({computed:,} B)", torch.tensor(computed), torch.tensor(counted))
    exactly(f"forward + backward: 6 N H V = {flops(n, h, v) / 1e12:.1f} TFLOP", torch.tensor(flops(n, h, v)),
            torch.tensor(3 * flops(n, h, v, backward=False)))
    assert "6 N H V = 5.2e13 flops" in doc and abs(flops(n, h, v) - 5.2e13) < 0.05e13


# ---------------------------------------------------------------------------- GPU-only, full size
@pytest.mark.big_gpu_memory
@pytest.mark.skipif(not ON_GPU, reason="LLaMA's 4096 x 128256 head needs a GPU (the interpreter is slow)")
def test_llama_head_without_host_syncs():
    """4096 tokens through LLaMA 3.1 8B's head in 2 chunks, in bf16, with host syncs made errors."""
    n, H, V = 4096, 4096, 128256
    x, w, t = _inputs(n, H, V, torch.bfloat16, seed=9, ignore=range(0, n, 11))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync now raises
    try:
        loss = linear_cross_entropy(xg, wg, t, chunk=2048)
        (loss * 3).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    same = _run(linear_cross_entropy_ref, x, w, t, "mean")  # its upstream gradient is 3.0 as well
    # float64 over the full head is too large; the fp32 computation of HF's way serves as the truth
    ref = _run(linear_cross_entropy_ref, x.float(), w.float(), t, "mean")
    close_to_reference("LLaMA head: loss", loss.detach(), same[0], ref[0], torch.float32, n=V)
    close_to_reference("LLaMA head: dx", xg.grad, same[1], ref[1], torch.bfloat16, n=V)
    close_to_reference("LLaMA head: dW (2 chunks, fp32 accumulator)", wg.grad, same[2], ref[2], torch.bfloat16, n=n)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fused linear cross-entropy: test report"))
