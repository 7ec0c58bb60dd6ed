"""Tests of the fused linear cross-entropy: loss, dx and dW against float64, chunking, edge cases.

    $ python linear_cross_entropy_test.py  # a readable report: every check, its error and tolerance
    $ pytest linear_cross_entropy_test.py  # the same tests under pytest

Every numeric check compares three computations of cross_entropy(x @ W.T, targets): ours, Hugging
Face's way in the same dtype (full logits, upcast to fp32), and float64. Tolerances follow the rule
in testkit.py (at most 2x PyTorch's own error, plus one ulp of the output scale) unless a test
explains otherwise. Small chunks force the multi-chunk path at sizes the interpreter can run.
"""

import pytest
import torch
import torch.nn.functional as F

from kernel_utils import DEVICE
from linear_cross_entropy_kernel import (
    TritonLinearCrossEntropyLoss,
    chunk_tokens,
    linear_cross_entropy,
    linear_cross_entropy_ref,
)
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
    dtype, (n, h), v = x.dtype, x.shape, w.shape[0]
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
    x, w, t = _inputs(50, 32, 300, dtype, ignore=(3, 17, 40))
    _check(f"{reduction} chunk={chunk}", x, w, t, reduction, chunk=chunk)


def test_chunking_does_not_change_loss_or_dx():
    """Each token's loss and dx depend on its own row only: the same bits whatever the chunk size."""
    x, w, t = _inputs(40, 16, 200, torch.bfloat16, seed=1, ignore=(5,))
    one = _run(linear_cross_entropy, x, w, t, "none")
    many = _run(linear_cross_entropy, x, w, t, "none", chunk=7)
    exactly("per-token loss, 1 chunk vs 6", many[0], one[0])
    exactly("dx, 1 chunk vs 6", many[1], one[1])


def test_fp32_accumulation_beats_rounding_per_chunk():
    """dW summed over 32 chunks: an fp32 accumulator must stay at one-matmul accuracy; rounding the
    running sum to bf16 after every chunk must be measurably worse (else the fp32 path is not on)."""
    x, w, t = _inputs(512, 16, 64, torch.bfloat16, seed=2)
    ref = _run(linear_cross_entropy_ref, x.double(), w.double(), t, "sum")
    same = _run(linear_cross_entropy_ref, x, w, t, "sum")
    acc32 = _run(linear_cross_entropy, x, w, t, "sum", chunk=16)
    acc16 = _run(linear_cross_entropy, x, w, t, "sum", chunk=16, accumulate_fp32=False)
    close_to_reference("dW, 32 chunks, fp32 accumulator", acc32[2], same[2], ref[2], torch.bfloat16, n=512)
    err32 = (acc32[2].double() - ref[2]).abs().max().item()
    err16 = (acc16[2].double() - ref[2]).abs().max().item()
    # bf16 running sum: each of the 32 additions may round by half an ulp of the sum, so its error
    # may grow to 32 x 0.5 ulp; it stays far below that in practice but above the fp32 path.
    bound = 32 * 0.5 * ULP[torch.bfloat16] * ref[2].abs().max().item()
    record("dW, bf16 running sum: within 32 half-ulps", err16, bound, err16 <= bound)
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


@pytest.mark.parametrize("which", ["x", "weight"])
def test_only_one_input_needs_grad(which):
    """A frozen lm_head (adapters) or frozen hidden states: only the needed gradient is computed."""
    x, w, t = _inputs(30, 16, 100, torch.float32, seed=5, ignore=(2,))
    xg, wg = x.clone().requires_grad_(which == "x"), w.clone().requires_grad_(which == "weight")
    linear_cross_entropy(xg, wg, t, chunk=8).backward()
    xr, wr = x.double().requires_grad_(which == "x"), w.double().requires_grad_(which == "weight")
    linear_cross_entropy_ref(xr, wr, t).backward()
    ours, ref = (xg.grad, xr.grad) if which == "x" else (wg.grad, wr.grad)
    other = wg.grad if which == "x" else xg.grad
    assert other is None, "the input that does not need a gradient must not get one"
    close_to_reference(f"only {which} needs grad", ours, ref.float(), ref, torch.float32, n=100)


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


def test_module_with_batch_and_sequence_dims():
    B, T, H, V = 2, 7, 16, 130
    x, w, t = _inputs(B * T, H, V, torch.float32, seed=7, ignore=(0,))
    loss = TritonLinearCrossEntropyLoss(reduction="none", chunk=4)(x.view(B, T, H), w, t.view(B, T))
    assert loss.shape == (B * T,), "reduction='none' returns one loss per token, flattened"
    ref = linear_cross_entropy_ref(x.double(), w.double(), t, reduction="none")
    close_to_reference("[B, T, H] inputs, per-token loss", loss, ref.float(), ref, torch.float32, n=V)


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
    record("chunk sizes from the 512 MiB budget", 0.0, 0.0, True)


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


# ---------------------------------------------------------------------------- GPU-only, full size
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
