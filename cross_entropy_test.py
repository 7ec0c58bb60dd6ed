"""Tests of the fused cross-entropy: loss and gradient against float64, edge cases, bad input.

    $ python cross_entropy_test.py  # a readable report: every check, its error and tolerance
    $ pytest cross_entropy_test.py  # the same tests under pytest

Without a GPU the kernels run in Triton's interpreter at small sizes; with one, the same tests also
run LLaMA 3.1 8B's vocabulary (128256) over thousands of tokens compiled, past the int32 offset
limit, inside a CUDA graph and with host syncs turned into errors. Tolerances follow the rule in
testkit/__init__.py: at most 2x PyTorch's own error against float64, plus one ulp of the output scale.
The options (class weights, label smoothing, z-loss, softcap) are checked the same way against
PyTorch's own `weight` and `label_smoothing` and a spelled-out cap and z-loss; the extras (z-loss,
token accuracy, predicted tokens) against PyTorch exactly where they can be exact. The drop-in
module, TritonCrossEntropyLoss, against torch.nn.CrossEntropyLoss built with the same arguments:
every reduction, ignore_index, label smoothing, class weights, [B, T, V] and non-contiguous input.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cross_entropy_kernel
from cross_entropy_kernel import (TritonCrossEntropyLoss, cross_entropy, cross_entropy_forward, cross_entropy_ref,
                                  ideal_bytes, scale_gradient_, z_loss_ref)
from core.kernel_utils import DEVICE
from testkit import ULP, close_to_reference, expect_error, exactly, record, run_as_script

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ON_GPU = DEVICE.type == "cuda"


def _logits(n, v, dtype, seed=0, spread=4.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(n, v, generator=g) * spread).to(device=DEVICE, dtype=dtype)


def _targets(n, v, seed=0, ignore=()):
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    t = torch.randint(0, v, (n,), generator=g)
    for i in ignore:
        t[i] = -100
    return t.to(DEVICE)


def _upstream(loss, seed=2):
    """Random non-uniform upstream gradient: 3.0 for a reduced loss, a random weight per row else."""
    if loss.dim() == 0:
        return torch.tensor(3.0, device=loss.device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(loss.shape, generator=g) * 2 - 0.5).to(loss.device)


def _run(fn, logits, targets, reduction, ignore_index, inplace=False):
    x = logits.detach().clone().requires_grad_()
    inp = x * 1 if inplace else x  # in place: give the kernel a buffer of its own to overwrite
    if fn is not cross_entropy:  # PyTorch reads [B, T, V] as classes along dim 1: flatten for it
        inp, targets = inp.reshape(-1, inp.shape[-1]), targets.reshape(-1)
    loss = fn(inp, targets, ignore_index=ignore_index, reduction=reduction,
              **({"inplace_grad": True} if inplace else {}))
    (loss.float() * _upstream(loss)).sum().backward()
    return loss.detach(), x.grad


def _check(tag, logits, targets, reduction="mean", ignore_index=-100, inplace=False):
    dtype, V = logits.dtype, logits.shape[-1]
    ours = _run(cross_entropy, logits, targets, reduction, ignore_index, inplace)
    same = _run(F.cross_entropy, logits, targets, reduction, ignore_index)  # PyTorch in this dtype
    ref = _run(F.cross_entropy, logits.double(), targets, reduction, ignore_index)  # float64 truth
    assert ours[0].dtype == torch.float32, "the loss is fp32 whatever the logits dtype"
    assert ours[0].shape == (targets.shape if reduction == "none" else ()), "one loss per target, or one"
    ours = (ours[0].reshape(same[0].shape), ours[1])
    # The loss is computed in fp32 from low-precision inputs: PyTorch's bf16 loss is rounded to
    # bf16, ours is not, so compare at fp32 precision (a sum over V terms: n = V).
    close_to_reference(f"{tag} loss", ours[0], same[0], ref[0], torch.float32, n=V)
    close_to_reference(f"{tag} grad", ours[1], same[1], ref[1], dtype, n=V)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 1000, 32001])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_reference(vocab, reduction, dtype):
    n = 9
    _check(f"V={vocab} {reduction}", _logits(n, vocab, dtype), _targets(n, vocab, ignore=(2, 5)), reduction)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradient_in_place(reduction, dtype):
    logits, targets = _logits(11, 777, dtype, seed=3), _targets(11, 777, seed=3, ignore=(0,))
    _check(f"in place {reduction}", logits, targets, reduction, inplace=True)
    # and bit-identical to the out-of-place gradient
    a = _run(cross_entropy, logits, targets, reduction, -100, inplace=True)
    b = _run(cross_entropy, logits, targets, reduction, -100, inplace=False)
    exactly("in-place grad == out-of-place grad", a[1], b[1])


def test_in_place_writes_into_the_logits_buffer():
    logits, targets = _logits(6, 300, torch.bfloat16), _targets(6, 300)
    x = logits.clone().requires_grad_()
    inp = x * 1
    seen = []
    inp.register_hook(lambda g: seen.append(g.data_ptr()))
    cross_entropy(inp, targets, inplace_grad=True).backward()
    assert seen == [inp.data_ptr()], "the gradient must live in the logits' own memory"
    record("gradient buffer is the logits buffer", 0.0, 0.0, True)


@pytest.mark.parametrize("before", ["exp", "log_softmax"])
def test_in_place_refuses_to_corrupt_saved_logits(before):
    """exp and log_softmax save their output for backward; overwriting it in place must fail loudly."""
    op = torch.exp if before == "exp" else (lambda t: F.log_softmax(t, dim=-1))
    logits, targets = _logits(4, 50, torch.float32), _targets(4, 50)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(op(x), targets, inplace_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    x2 = logits.clone().requires_grad_()
    cross_entropy(op(x2), targets, inplace_grad=False).backward()  # out of place is fine
    xr = logits.double().requires_grad_()
    F.cross_entropy(op(xr), targets).backward()
    close_to_reference(f"{before} -> loss out of place: grad", x2.grad, xr.grad.float(), xr.grad, torch.float32, n=50)
    record(f"{before} -> in-place loss: backward raises", 0.0, 0.0, True)


def test_in_place_refuses_a_leaf_that_requires_grad():
    x = _logits(4, 30, torch.float32).requires_grad_()
    message = expect_error(RuntimeError, lambda: cross_entropy(x, _targets(4, 30), inplace_grad=True))
    assert "leaf" in message


def test_ignore_index_rows_are_exactly_zero():
    logits = _logits(8, 129, torch.bfloat16)
    for ignore_index in (-100, 7):
        targets = _targets(8, 129, seed=4)
        targets[[1, 6]] = ignore_index
        x = logits.clone().requires_grad_()
        loss = cross_entropy(x * 1, targets, ignore_index=ignore_index, reduction="none", inplace_grad=True)
        (loss * _upstream(loss)).sum().backward()
        exactly(f"ignore_index={ignore_index}: loss rows 0", loss[[1, 6]], torch.zeros(2, device=DEVICE))
        exactly(f"ignore_index={ignore_index}: grad rows 0", x.grad[[1, 6]], torch.zeros(2, 129, device=DEVICE, dtype=x.dtype))
        _check(f"ignore_index={ignore_index}", logits, targets, "mean", ignore_index)


def test_all_rows_ignored():
    """Documented choice: mean over zero rows is 0.0 (PyTorch: NaN), gradient 0, still in the graph."""
    logits = _logits(5, 64, torch.bfloat16)
    targets = torch.full((5,), -100, device=DEVICE)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets)
    assert loss.requires_grad and loss.grad_fn is not None, "must stay attached (FSDP/DDP would hang)"
    loss.backward()
    exactly("all ignored: mean loss is 0", loss, torch.tensor(0.0, device=DEVICE))
    exactly("all ignored: gradient is 0", x.grad, torch.zeros_like(x))
    assert torch.isnan(F.cross_entropy(logits.float(), targets)), "PyTorch's NaN is what we deviate from"


def test_targets_at_the_vocabulary_edges():
    logits = _logits(6, 1001, torch.bfloat16, seed=5)
    targets = torch.tensor([0, 1000, 0, 1000, 500, 999], device=DEVICE)
    _check("targets 0 and V-1", logits, targets, "none")


def test_out_of_range_targets_give_nan_rows():
    logits = _logits(5, 100, torch.float32, seed=6)
    targets = torch.tensor([3, 100, -1, 7, 10**9], device=DEVICE)  # rows 1, 2, 4 are invalid
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets, reduction="none")
    loss.sum().backward()
    bad = torch.tensor([False, True, True, False, True], device=DEVICE)
    exactly("loss is NaN exactly on invalid rows", torch.isnan(loss), bad)
    exactly("grad is NaN exactly on invalid rows", torch.isnan(x.grad).all(1), bad)
    assert torch.isfinite(x.grad[~bad]).all()
    assert torch.isnan(cross_entropy(logits, targets)), "a reduced loss with a bad target is NaN"


def test_empty_batch():
    x = _logits(0, 50, torch.bfloat16).requires_grad_()
    t = torch.zeros(0, dtype=torch.long, device=DEVICE)
    for reduction, expected in (("mean", torch.tensor(0.0)), ("sum", torch.tensor(0.0)), ("none", torch.zeros(0))):
        loss = cross_entropy(x, t, reduction=reduction)
        loss.sum().backward()
        exactly(f"empty batch, {reduction}", loss, expected.to(DEVICE))
    assert x.grad.shape == (0, 50)


def test_non_contiguous_logits():
    big = _logits(10, 2 * 300, torch.float32, seed=7)
    targets = _targets(5, 300, seed=7, ignore=(1,))
    _check("row-strided view", big[::2, :300], targets, "sum")  # row stride 1200, no copy
    _check("column slice (copied)", big[:5, ::2], targets, "mean")
    _check("transposed (copied)", _logits(300, 5, torch.bfloat16).t(), targets, "none")


def test_nan_and_inf_logits_stay_in_their_row():
    logits = _logits(4, 64, torch.float32, seed=8)
    logits[1, 10] = float("nan")
    logits[2, :32] = float("-inf")  # masked classes are harmless
    targets = torch.tensor([3, 4, 40, 5], device=DEVICE)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets, reduction="none")
    loss.sum().backward()
    exactly("NaN logit: only its row is NaN", torch.isnan(loss), torch.tensor([False, True, False, False], device=DEVICE))
    ref = cross_entropy_ref(logits[[0, 2, 3]].double(), targets[[0, 2, 3]], reduction="none")
    close_to_reference("-inf classes: loss", loss[[0, 2, 3]], ref, ref, torch.float32, n=64, factor=0)


def test_extreme_and_confident_logits():
    """Shifted logits (+-1000) and confident rows, where the true-class gradient p - 1 cancels."""
    base = _logits(6, 500, torch.float32, seed=9)
    targets = _targets(6, 500, seed=9)
    _check("logits + 1000", base + 1000, targets, "mean")
    _check("logits - 1000", base - 1000, targets, "mean")
    confident = base.clone()
    confident[torch.arange(6), targets] += 40.0  # p(target) ~ 1 - 1e-15
    _check("confident predictions", confident, targets, "none")
    _check("confident predictions, bf16", confident.bfloat16(), targets, "none")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_and_sequence_dims(dtype):
    """Logits [B, T, V] with targets [B, T]; reduction="none" returns [B, T]."""
    B, T, V = 2, 5, 257
    logits = _logits(B * T, V, dtype, seed=10).view(B, T, V)
    labels = _targets(B * T, V, seed=10, ignore=(0, 7)).view(B, T)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, labels, reduction="none")
    assert loss.shape == (B, T)
    xr = logits.double().requires_grad_()
    ref = F.cross_entropy(xr.view(-1, V), labels.view(-1), reduction="none").view(B, T)
    w = _upstream(ref.float())
    (loss * w).sum().backward()
    (ref * w.double()).sum().backward()
    xt = logits.clone().requires_grad_()
    same = F.cross_entropy(xt.view(-1, V), labels.view(-1), reduction="none").view(B, T)
    (same.float() * w).sum().backward()
    close_to_reference("[B, T, V] loss", loss, same, ref, torch.float32, n=V)
    close_to_reference("[B, T, V] grad", x.grad, xt.grad, xr.grad, dtype, n=V)


def _strided_targets(kind, n, v, seed=20):
    """Targets that are views with a non-unit stride, as a batch produces them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "column of [N, 2]":  # stride 2
        pairs = torch.randint(0, v, (n, 2), generator=g).to(DEVICE)
        pairs[3, 1] = -100
        return pairs[:, 1]
    if kind == "expanded constant":  # stride 0
        return torch.full((1,), v // 3, device=DEVICE).expand(n)
    if kind == "row of a transposed [T, B]":  # stride B = 3
        labels = torch.randint(0, v, (n, 3), generator=g).to(DEVICE)
        return labels.t()[1]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["column of [N, 2]", "expanded constant", "row of a transposed [T, B]"])
def test_strided_targets(kind):
    """The kernel reads target i at Targets + i * stride: a stride of 2, 0 or B must not matter."""
    n, v = 12, 300
    targets = _strided_targets(kind, n, v)
    assert targets.stride(0) != 1, "the test must give the kernel a non-contiguous targets tensor"
    _check(f"targets: {kind}", _logits(n, v, torch.float32, seed=21), targets, "none")
    _check(f"targets: {kind}, in place, mean", _logits(n, v, torch.bfloat16, seed=22), targets, "mean", inplace=True)


def test_shifted_labels_of_a_batch():
    """B > 1 batch, HF style: logits [B, T, V], targets labels[:, 1:] (a strided [B, T] view)."""
    B, T, V = 3, 6, 200
    g = torch.Generator(device="cpu").manual_seed(23)
    labels = torch.randint(0, V, (B, T + 1), generator=g).to(DEVICE)
    labels[1, 2] = -100
    targets = labels[:, 1:]
    assert not targets.is_contiguous()
    logits = _logits(B * T, V, torch.bfloat16, seed=23).view(B, T, V)
    _check("labels[:, 1:] of a [B, T+1] batch", logits, targets, "mean", inplace=True)
    _check("labels[:, 1:] of a [B, T+1] batch, none", logits, targets, "none")


def test_in_place_on_expanded_logits_uses_a_new_buffer():
    """Rows that share memory (expand, stride 0) cannot each hold their own gradient row: the
    documented fallback is a new gradient buffer, and the shared row stays intact."""
    n, v = 6, 90
    row0 = _logits(1, v, torch.float32, seed=24)
    targets = _targets(n, v, seed=24)
    leaf = row0.clone().requires_grad_()
    row = leaf * 1
    logits = row.expand(n, v)  # stride 0 along rows
    loss = cross_entropy(logits, targets, inplace_grad=True)
    exactly("expanded logits: shared row left intact", row.detach(), row0)
    loss.backward()
    ref_leaf = row0.double().requires_grad_()
    F.cross_entropy(ref_leaf.expand(n, v), targets).backward()
    same_leaf = row0.clone().requires_grad_()
    F.cross_entropy(same_leaf.expand(n, v), targets).backward()
    close_to_reference("expanded logits: gradient summed over rows", leaf.grad, same_leaf.grad, ref_leaf.grad,
                       torch.float32, n=v * n)
    with pytest.raises(ValueError, match="share memory"):  # the low-level launcher refuses instead
        cross_entropy_forward(logits.detach(), targets, -100, "mean", True, True)


def test_gradient_accumulation_matches_full_batch():
    """Sum over micro-batches / total tokens == mean over the full batch (HF num_items_in_batch)."""
    logits, targets = _logits(12, 90, torch.float32, seed=11), _targets(12, 90, seed=11, ignore=(0, 1, 2, 9))
    full = cross_entropy(logits, targets)
    n_items = (targets != -100).sum()
    parts = sum(cross_entropy(logits[i:i + 4], targets[i:i + 4], reduction="sum") for i in range(0, 12, 4))
    ref = cross_entropy_ref(logits.double(), targets)
    close_to_reference("micro-batch sum / n_items vs full mean", parts / n_items, full, ref, torch.float32, n=90)



@pytest.mark.parametrize("inplace", [False, True])
def test_second_order_gradients_raise(inplace):
    """create_graph=True would give a gradient PyTorch cannot differentiate: refuse it clearly
    instead of returning second derivatives of zero."""
    logits, targets = _logits(5, 40, torch.float32, seed=25), _targets(5, 40, seed=25)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x * 1, targets, inplace_grad=inplace)
    with pytest.raises(RuntimeError, match="no second derivative"):
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        (g * g).sum().backward()
    record(f"create_graph=True, inplace={inplace}: clear error", 0.0, 0.0, True)


def test_backward_twice_is_refused():
    x = _logits(3, 20, torch.float32).requires_grad_()
    loss = cross_entropy(x * 1, _targets(3, 20), inplace_grad=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward once"):
        loss.backward()
    record("second backward raises a clear error", 0.0, 0.0, True)


def test_no_grad_forward_still_computes_the_loss():
    logits, targets = _logits(7, 100, torch.bfloat16), _targets(7, 100)
    x = logits.clone().requires_grad_()
    with torch.no_grad():  # evaluation of a model whose logits require grad: nothing may be overwritten
        loss = cross_entropy(x, targets, inplace_grad=True)
    exactly("no_grad + inplace_grad: logits left intact", x, logits)
    ref = cross_entropy_ref(logits.double(), targets)
    close_to_reference("loss under no_grad", loss, ref, ref, torch.float32, n=100, factor=0)


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda: (torch.randn(4, 8), torch.zeros(4)), TypeError, id="float targets"),
        pytest.param(lambda: (torch.randn(4, 8), torch.zeros(5, dtype=torch.long)), ValueError, id="N mismatch"),
        pytest.param(lambda: (torch.randn(2, 4, 8), torch.zeros(8, dtype=torch.long)), ValueError,
                     id="3-D logits, flat targets"),
        pytest.param(lambda: (torch.randn(8), torch.zeros((), dtype=torch.long)), ValueError, id="1-D logits"),
        pytest.param(lambda: (torch.randn(2, 2, 4, 8), torch.zeros(2, 2, 4, dtype=torch.long)), ValueError,
                     id="4-D logits"),
        pytest.param(lambda: (torch.randn(4, 0), torch.zeros(4, dtype=torch.long)), ValueError, id="empty vocabulary"),
        pytest.param(lambda: (torch.randint(0, 3, (4, 8)), torch.zeros(4, dtype=torch.long)), TypeError, id="int logits"),
    ],
)
def test_bad_input_gives_clear_error(make, error):
    logits, targets = make()
    expect_error(error, cross_entropy, logits.to(DEVICE), targets.to(DEVICE))


def test_bad_reduction_gives_clear_error():
    expect_error(ValueError, lambda: cross_entropy(_logits(3, 5, torch.float32), _targets(3, 5), reduction="avg"))


# ---------------------------------------------------------------------------- options
# Class weights, label smoothing, the z-loss and the logit cap change the loss and its gradient;
# each is checked against PyTorch (F.cross_entropy's own `weight` and `label_smoothing`, the cap
# and the z-loss spelled out in cross_entropy_ref) in the logits' dtype and in float64. Most checks
# use V = 257, one block of 512 columns with its tail masked, as the default launch runs it. The
# tests that take the `small_blocks` fixture shrink the block to 512 columns (256 for the options
# that keep more per-lane state), so that V = 1000 takes 2 (4) blocks, the last one partial: the
# loop, its prefetch and the tail masks then run as they do for LLaMA's 128256 columns.
@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(cross_entropy_kernel, "BLOCK_V", 512)


def _class_weights(v, seed=30):
    """Class weights in [0.25, 1.75): far from uniform, so a missing or misplaced weight shows."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(v, generator=g) * 1.5 + 0.25).to(DEVICE)


def _options(name, v):
    """The option sets under test. The z-loss coefficient is 1e-2, 100x PaLM's 1e-4, so that its
    term (~1.5 at lse ~ 12) and its gradient 2 * 0.01 * lse * p are large enough to be checked."""
    return {
        "label smoothing": dict(label_smoothing=0.1),
        "class weights": dict(weight=_class_weights(v)),
        "class weights + label smoothing": dict(weight=_class_weights(v), label_smoothing=0.2),
        "z-loss": dict(lse_square_scale=1e-2),
        "softcap": dict(softcap=5.0),  # logits of spread 4: |x / cap| up to ~3, deep in tanh's bend
        "all options": dict(weight=_class_weights(v), label_smoothing=0.1, lse_square_scale=1e-2, softcap=5.0),
    }[name]


OPTION_SETS = ["label smoothing", "class weights", "class weights + label smoothing", "z-loss", "softcap",
               "all options"]


def _run_loss(loss_fn, logits, inplace=False):
    """loss_fn(logits) and its gradient for a random non-uniform upstream gradient."""
    x = logits.detach().clone().requires_grad_()
    loss = loss_fn(x * 1 if inplace else x)
    (loss.float() * _upstream(loss)).sum().backward()
    return loss.detach(), x.grad


def _check_options(tag, logits, targets, reduction="mean", ignore_index=-100, inplace=False, **options):
    """Ours against PyTorch in the logits' dtype and in float64, with the same options."""
    V = logits.shape[-1]
    ours = _run_loss(lambda x: cross_entropy(x, targets, ignore_index, reduction, inplace, **options), logits, inplace)
    same = _run_loss(lambda x: cross_entropy_ref(x, targets, ignore_index, reduction, dtype=x.dtype, **options), logits)
    ref = _run_loss(lambda x: cross_entropy_ref(x, targets, ignore_index, reduction, dtype=torch.float64, **options),
                    logits.double())
    assert ours[0].dtype == torch.float32 and ours[0].shape == ref[0].shape
    # as in _check: the loss at fp32 precision, the gradient at the logits' (sums over V terms)
    close_to_reference(f"{tag} loss", ours[0], same[0], ref[0], torch.float32, n=V)
    close_to_reference(f"{tag} grad", ours[1], same[1], ref[1], logits.dtype, n=V)
    return ours


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", OPTION_SETS)
def test_options_match_pytorch(option, dtype, reduction):
    """Each option alone and all together, with ignored rows, V = 257 (one block, tail masked)."""
    n, v = 9, 257
    logits, targets = _logits(n, v, dtype, seed=31), _targets(n, v, seed=31, ignore=(2, 6))
    _check_options(f"{option}, {reduction}", logits, targets, reduction, **_options(option, v))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_options_across_blocks(reduction, small_blocks):
    """Every option at once, V = 1000 in 4 blocks: the smoothing sums and the cap's tail mask
    carried across blocks (the argmax's are in the accuracy tests below)."""
    n, v = 8, 1000
    logits, targets = _logits(n, v, torch.bfloat16, seed=32), _targets(n, v, seed=32, ignore=(4,))
    _check_options(f"all options, V=1000 in 4 blocks, {reduction}", logits, targets, reduction,
                   **_options("all options", v))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options_with_the_gradient_in_place(reduction, small_blocks):
    """In place, sweep 2 rereads each raw logit (the cap needs it) before overwriting it, and the
    target's fix-up uses the logit read before the sweep: the same bits as out of place."""
    n, v = 8, 1000
    logits, targets = _logits(n, v, torch.bfloat16, seed=33), _targets(n, v, seed=33, ignore=(0,))
    options = _options("all options", v)
    a = _check_options(f"all options in place, {reduction}", logits, targets, reduction, inplace=True, **options)
    b = _run_loss(lambda x: cross_entropy(x, targets, reduction=reduction, **options), logits)
    exactly(f"all options: in-place grad == out-of-place grad, {reduction}", a[1], b[1])


def test_weights_and_smoothing_with_an_ignore_index_inside_the_vocabulary():
    """ignore_index = 7 is a real class: its rows are skipped and left out of the weighted mean's
    divisor, and class 7 still takes part in every other row's softmax and smoothing."""
    n, v = 10, 257
    targets = _targets(n, v, seed=34)
    targets[[1, 5, 6]] = 7
    logits = _logits(n, v, torch.float32, seed=34)
    for reduction in ("mean", "sum"):
        _check_options(f"ignore_index=7, weights + smoothing, {reduction}", logits, targets, reduction, ignore_index=7,
                       weight=_class_weights(v), label_smoothing=0.3)


def test_all_rows_ignored_with_every_option():
    """Every option on, every row ignored: loss, z-loss and accuracy 0, gradient 0, no prediction
    (-1), and the loss still attached to the graph (PyTorch's weighted mean would be 0 / 0 = NaN)."""
    n, v = 5, 64
    x = _logits(n, v, torch.bfloat16).requires_grad_()
    targets = torch.full((n,), -100, device=DEVICE)
    out = cross_entropy(x, targets, return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
                        **_options("all options", v))
    assert out.loss.requires_grad and out.loss.grad_fn is not None, "must stay attached (FSDP/DDP would hang)"
    out.loss.backward()
    zero = torch.tensor(0.0, device=DEVICE)
    exactly("all ignored, all options: loss 0", out.loss, zero)
    exactly("all ignored, all options: z-loss 0", out.z_loss, zero)
    exactly("all ignored, all options: accuracy 0", out.token_accuracy, zero)
    exactly("all ignored, all options: predicted tokens -1", out.predicted_tokens, torch.full_like(targets, -1))
    exactly("all ignored, all options: gradient 0", x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss_is_returned_alone_and_included_in_the_loss(reduction):
    """return_z_loss gives lse_square_scale * lse^2 reduced like the loss (mean over non-ignored
    rows); asking for it changes nothing else, and it carries no gradient."""
    n, v, scale = 10, 257, 1e-2
    logits, targets = _logits(n, v, torch.float32, seed=35), _targets(n, v, seed=35, ignore=(3, 4))
    x = logits.clone().requires_grad_()
    out = cross_entropy(x, targets, reduction=reduction, lse_square_scale=scale, return_z_loss=True)
    plain = cross_entropy(logits, targets, reduction=reduction, lse_square_scale=scale)
    assert out.token_accuracy is None and out.predicted_tokens is None, "only what was asked for"
    assert not out.z_loss.requires_grad, "the z-loss is returned for logging; the loss already holds it"
    exactly(f"{reduction}: the loss is the same with and without return_z_loss", out.loss, plain)
    ref = z_loss_ref(logits.double(), targets, -100, reduction, scale)
    same = z_loss_ref(logits, targets, -100, reduction, scale)
    # a logsumexp over V terms in fp32, squared: the testkit rule with n = V
    close_to_reference(f"{reduction}: z-loss alone", out.z_loss, same, ref, torch.float32, n=v)
    off = cross_entropy(logits, targets, reduction=reduction, return_z_loss=True)
    exactly(f"{reduction}: lse_square_scale=0 returns a z-loss of 0", off.z_loss, torch.zeros_like(off.loss))


def test_softcap_on_saturated_logits():
    """Logits of spread 100 under a cap of 10: most are deep in tanh's flat tails, where the
    gradient factor 1 - tanh^2 is tiny and would cancel to nothing if computed by subtraction."""
    n, v = 8, 257
    logits, targets = _logits(n, v, torch.float32, seed=36, spread=100.0), _targets(n, v, seed=36, ignore=(1,))
    _check_options("softcap=10 on logits of spread 100", logits, targets, "none", softcap=10.0)
    _check_options("softcap=10 on logits of spread 100, all options", logits, targets, "mean",
                   **{**_options("all options", v), "softcap": 10.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_accuracy_and_predicted_tokens(dtype, small_blocks):
    """Predicted tokens are torch.argmax of the logits, exactly (bf16 logits tie often: the first
    index wins, as in torch); -1 on ignored rows; [B, T] in, [B, T] out. The accuracy is their
    share of correct non-ignored tokens, and asking for them leaves the loss bit for bit alone."""
    B, T, v = 2, 6, 1000
    logits = _logits(B * T, v, dtype, seed=37).view(B, T, v)
    labels = _targets(B * T, v, seed=37, ignore=(0, 9)).view(B, T)
    best = logits.float().argmax(-1)
    labels[1, :3] = best[1, :3]  # some tokens right, so the accuracy is neither 0 nor 1
    expected = torch.where(labels == -100, -1, best)
    scored = labels != -100
    accuracy = ((best == labels) & scored).sum() / scored.sum()
    for options in ({}, _options("all options", v)):
        tag = "all options" if options else "no options"
        out = cross_entropy(logits, labels, return_token_accuracy=True, return_predicted_tokens=True, **options)
        exactly(f"{dtype}, {tag}: predicted tokens == torch.argmax", out.predicted_tokens, expected)
        exactly(f"{dtype}, {tag}: token accuracy", out.token_accuracy, accuracy)
    exactly(f"{dtype}: the loss is unchanged by the extras", out.loss, cross_entropy(logits, labels, **options))


def test_argmax_ties_go_to_the_first_index(small_blocks):
    """Lanes keep their first maximum and the lanes are then searched for the smallest column:
    ties across blocks, across lanes and within a lane all resolve to the first index."""
    v = 1000  # blocks of 256 columns here (argmax keeps per-lane state)
    logits = _logits(3, v, torch.float32, seed=38)
    logits[0, [700, 300, 45]] = 50.0  # three blocks, three lanes: 45 first
    logits[1, [259, 3, 999]] = 50.0  # 3 and 259 share a lane (259 = 256 + 3): 3 first
    logits[2] = 1.0  # a constant row: 0
    targets = torch.tensor([45, 259, 5], device=DEVICE)
    out = cross_entropy(logits, targets, return_predicted_tokens=True, return_token_accuracy=True)
    exactly("ties: the first index, as torch.argmax", out.predicted_tokens, logits.argmax(-1))
    exactly("ties: predicted [45, 3, 0]", out.predicted_tokens, torch.tensor([45, 3, 0], device=DEVICE))
    exactly("ties: accuracy 1 of 3", out.token_accuracy, torch.tensor(1 / 3, device=DEVICE))


@pytest.mark.parametrize(
    "options, words",
    [
        pytest.param(dict(label_smoothing=-0.1), "label_smoothing", id="label_smoothing < 0"),
        pytest.param(dict(label_smoothing=1.5), "label_smoothing", id="label_smoothing > 1"),
        pytest.param(dict(label_smoothing=float("nan")), "label_smoothing", id="label_smoothing NaN"),
        pytest.param(dict(weight=torch.ones(31)), "shape", id="weight of the wrong length"),
        pytest.param(dict(weight=torch.ones(1, 30)), "shape", id="weight 2-D"),
        pytest.param(dict(weight=torch.ones(30, dtype=torch.long)), "floating", id="integer weight"),
        pytest.param(dict(weight=torch.ones(30, device="meta")), "meta", id="weight on another device"),
        pytest.param(dict(softcap=0.0), "softcap", id="softcap 0"),
        pytest.param(dict(softcap=-30.0), "softcap", id="softcap < 0"),
        pytest.param(dict(softcap=float("inf")), "softcap", id="softcap inf"),
        pytest.param(dict(lse_square_scale=-1e-4), "lse_square_scale", id="lse_square_scale < 0"),
    ],
)
def test_bad_options_give_clear_errors(options, words):
    options = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
               for k, v in options.items()}
    message = expect_error(ValueError, lambda: cross_entropy(_logits(4, 30, torch.float32), _targets(4, 30), **options))
    assert words in message


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_scale_gradient_is_the_product_in_every_layout(monkeypatch, dtype):
    """scale_gradient_ (the backward's `grad * grad_output`) is the fp32 product rounded once: in place
    and into another tensor, with one factor or one per row, on contiguous and strided rows; a factor of
    exactly 1 in place leaves the tensor as it was. One factor over contiguous rows is launched as fewer,
    longer rows (the lm_head's [512, 64] gradient: 2 programs, not 512), with the same bits as the
    launch of one program per row (the same factor given per row).

    Against PyTorch's `(grad.float() * grad_output).to(dtype)`, the fp32 product rounded to nearest-even:
    bitwise on a GPU, and in float32 everywhere. In Triton's interpreter a bf16 result is within one ulp
    of the fp32 product instead: its fp32 -> bf16 conversion does not round to nearest-even as a GPU and
    PyTorch do (adamw_kernel.py, `_round_like_a_gpu`). The strided rows are made on the device (a copy to
    the GPU would make them contiguous)."""
    spy = _LaunchSpy(cross_entropy_kernel._scale_rows)
    monkeypatch.setattr(cross_entropy_kernel, "_scale_rows", spy)
    gen = torch.Generator().manual_seed(5)
    cases = [((512, 64), "one", True, 2), ((512, 64), "one", False, 2), ((7, 30), "one", True, 7),
             ((512, 64), "rows", True, 512), ((64, 512), "one, strided", True, 64), ((3, 5), "rows", False, 3)]
    bitwise = dtype == torch.float32 or DEVICE.type == "cuda"
    for shape, factor, in_place, programs in cases:
        base = torch.randn(shape, generator=gen).to(dtype)
        grad = base.clone().to(DEVICE)
        if factor == "one, strided":  # the same values in rows that are parts of longer ones
            grad = torch.zeros(shape[0], shape[1] + 88, dtype=dtype, device=DEVICE)[:, :shape[1]]
            grad.copy_(base)
            assert not grad.is_contiguous()
        go = (torch.rand(shape[0], generator=gen) + 0.5) if factor == "rows" else torch.tensor(0.37)
        want = base.float() * (go.view(-1, 1) if factor == "rows" else go)
        out = None if in_place else torch.full_like(base, float("nan")).to(DEVICE)
        got = scale_gradient_(grad, go.to(DEVICE), out).cpu()
        where = f"{factor} x {shape}, {'in place' if in_place else 'into out'}"
        if bitwise:
            exactly(f"{where}: the fp32 product rounded to nearest-even", got, want.to(dtype))
        else:
            err = ((got.float() - want) / (want.abs() * ULP[dtype])).abs().max().item()  # in ulps of each value
            record(f"{where}: ulps from the fp32 product", err, 1.0, err <= 1.0)
        assert spy.grids[-1] == (programs,), (shape, factor, spy.grids[-1])
        if factor == "one" and in_place:
            per_row = scale_gradient_(base.clone().to(DEVICE), go.expand(shape[0]).contiguous().to(DEVICE))
            assert spy.grids[-1] == (shape[0],)
            exactly(f"one factor x {shape}: longer rows == a program per row", got, per_row)
    untouched = torch.randn(512, 64, generator=gen).to(dtype).to(DEVICE)
    before = untouched.clone()
    scale_gradient_(untouched, torch.tensor(1.0, device=DEVICE))
    exactly("a factor of 1 in place: unchanged", untouched, before)


def test_meta_tensors_give_shapes():
    """Logits and targets on the meta device have no data to launch on: the operators' fake functions
    give the loss's and the gradient's shapes."""
    logits = torch.randn(2, 3, 30, device="meta", requires_grad=True)
    loss = cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long, device="meta"))
    loss.backward()
    assert (loss.device.type, loss.shape, logits.grad.shape) == ("meta", (), logits.shape)


# ---------------------------------------------------------------------------- drop-in module
# TritonCrossEntropyLoss against torch.nn.CrossEntropyLoss built with the same arguments, on the
# same inputs: PyTorch's module in the input's dtype ("same") and in float64 ("ref"), loss and
# gradient (under a random upstream gradient), with the testkit rule. The loss is fp32 from
# low-precision inputs while PyTorch's bf16 loss is rounded to bf16, so the loss is compared at
# fp32 precision (a sum over V terms: n = V), the gradient at the input's. PyTorch's bf16 module
# needs bf16 class weights: the weights are rounded to bf16 first, so that all three computations
# use the very same values (the kernel reads them as fp32, which holds bf16 values exactly).
MODULE_OPTIONS = ["plain", "ignore_index=3", "label_smoothing", "weight", "weight + label_smoothing"]


def _module_options(name, v):
    weight = (_class_weights(v, seed=50) * 3).bfloat16().float()  # random positive, about 0.3 to 5
    return {"plain": {}, "ignore_index=3": dict(ignore_index=3), "label_smoothing": dict(label_smoothing=0.1),
            "weight": dict(weight=weight), "weight + label_smoothing": dict(weight=weight, label_smoothing=0.1)}[name]


def _module_targets(shape, v, ignore_index=-100, seed=51):
    """Random targets of `shape` with rows 2 and 5 (of the flattened targets) set to ignore_index."""
    t = _targets(math.prod(shape), v, seed=seed)
    t[[2, 5]] = ignore_index
    return t.view(shape)


def _module_run(loss_fn, base, targets, view, torch_layout):
    """Loss and d loss / d base of loss_fn(view(base), targets); `torch_layout` flattens [B, T, V] to
    [N, V] (PyTorch's module reads classes in dimension 1 of a 3-D input)."""
    x = base.detach().clone().requires_grad_()
    inp, t = view(x), targets
    if torch_layout and inp.dim() == 3:
        inp, t = inp.reshape(-1, inp.shape[-1]), t.reshape(-1)
    loss = loss_fn(inp, t)
    if torch_layout and loss.dim():
        loss = loss.view(targets.shape)
    (loss.float() * _upstream(loss)).sum().backward()
    return loss.detach(), x.grad


def _torch_module(dtype, weight=None, **kwargs):
    return nn.CrossEntropyLoss(weight=None if weight is None else weight.to(dtype), **kwargs)


def _module_check(tag, base, targets, view=lambda x: x, **kwargs):
    """ours vs PyTorch's nn.CrossEntropyLoss(**kwargs) in base's dtype and in float64."""
    dtype, V = base.dtype, base.shape[-1]
    ours = _module_run(TritonCrossEntropyLoss(**kwargs), base, targets, view, False)
    same = _module_run(_torch_module(dtype, **kwargs), base, targets, view, True)
    ref = _module_run(_torch_module(torch.float64, **kwargs), base.double(), targets, view, True)
    assert ours[0].shape == ref[0].shape, f"{tag}: loss shape {tuple(ours[0].shape)} != {tuple(ref[0].shape)}"
    # the rule of this file: loss at fp32 precision over V terms, gradient at the input's precision
    close_to_reference(f"{tag}: loss", ours[0], same[0], ref[0], torch.float32, n=V)
    close_to_reference(f"{tag}: grad", ours[1], same[1], ref[1], dtype, n=V)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", MODULE_OPTIONS)
def test_module_matches_torch_cross_entropy_loss(option, dtype, reduction):
    """[N, V] = [12, 257] (one block, its tail masked), two ignored rows, every argument set."""
    n, v = 12, 257
    kwargs = {**_module_options(option, v), "reduction": reduction}
    targets = _module_targets((n,), v, kwargs.get("ignore_index", -100))
    _module_check(f"module {option}, {reduction}, {dtype}", _logits(n, v, dtype, seed=52), targets, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_batch_and_sequence_layout(dtype, reduction):
    """[B, T, V] logits with [B, T] targets (Hugging Face's layout), weights and smoothing on; the
    "none" losses come back as [B, T]."""
    B, T, v = 2, 5, 257
    kwargs = {**_module_options("weight + label_smoothing", v), "reduction": reduction}
    _module_check(f"module [B, T, V], {reduction}, {dtype}", _logits(B * T, v, dtype, seed=53).view(B, T, v),
                  _module_targets((B, T), v), **kwargs)


NON_CONTIGUOUS = {
    # [N, V] read from a [V, N] tensor: the classes are strided, so the rows are copied once
    "transposed [V, N]": (lambda n, v: (v, n), lambda x: x.t()),
    # every other row of a wider tensor, its first V columns: unit class stride, read in place
    "rows and columns sliced": (lambda n, v: (2 * n, v + 7), lambda x: x[::2, :-7]),
    # [B, T, V] as a transposed view of a [T, B, V] tensor (time-major activations)
    "[T, B, V] transposed to [B, T, V]": (lambda n, v: (n // 2, 2, v), lambda x: x.transpose(0, 1)),
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(NON_CONTIGUOUS))
def test_module_non_contiguous_input(layout, dtype, reduction):
    """Views the module reads without the caller calling .contiguous(); the gradient reaches the
    base tensor through the view, as PyTorch's does."""
    n, v = 12, 257
    base_shape, view = NON_CONTIGUOUS[layout]
    base = _logits(1, math.prod(base_shape(n, v)), dtype, seed=54).reshape(base_shape(n, v))
    targets = _module_targets(view(base).shape[:-1], v)
    kwargs = {**_module_options("weight + label_smoothing", v), "reduction": reduction}
    _module_check(f"module, {layout}, {reduction}, {dtype}", base, targets, view, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_all_rows_ignored(reduction):
    """Every row ignored (a custom ignore_index, weights and smoothing on): "sum" and "none" equal
    PyTorch's exactly (zeros); "mean" is 0.0 where PyTorch gives NaN (0 / 0), a documented
    difference, and the gradient is exactly 0 with the loss still attached to the graph."""
    n, v = 6, 257
    kwargs = {**_module_options("weight + label_smoothing", v), "ignore_index": 11, "reduction": reduction}
    targets = torch.full((n,), 11, device=DEVICE)
    x = _logits(n, v, torch.float32, seed=55).requires_grad_()
    loss = TritonCrossEntropyLoss(**kwargs)(x, targets)
    assert loss.grad_fn is not None, "must stay attached (FSDP/DDP would hang)"
    (loss * _upstream(loss)).sum().backward()
    expected = _torch_module(torch.float64, **kwargs)(x.detach().double(), targets)
    if reduction == "mean":
        assert torch.isnan(expected), "PyTorch's mean over no rows is NaN"
        expected = torch.zeros(())
    exactly(f"module, all rows ignored, {reduction}: loss", loss, expected.float())
    exactly(f"module, all rows ignored, {reduction}: grad", x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_z_loss_and_softcap(dtype, reduction):
    """The options PyTorch's module lacks, against cross_entropy_ref (PyTorch's loss on capped
    logits plus the z-loss spelled out) in the input's dtype and in float64."""
    n, v = 12, 257
    options = dict(weight=_module_options("weight", v)["weight"], label_smoothing=0.1)
    targets = _module_targets((n,), v)
    loss_fn = TritonCrossEntropyLoss(reduction=reduction, z_loss=1e-2, softcap=5.0, **options)
    ref_options = dict(reduction=reduction, lse_square_scale=1e-2, softcap=5.0, **options)
    runs = [_module_run(loss_fn, _logits(n, v, dtype, seed=56), targets, lambda x: x, False)]
    for ref_dtype in (dtype, torch.float64):
        runs.append(_module_run(lambda x, t: cross_entropy_ref(x, t, dtype=ref_dtype, **ref_options),
                                _logits(n, v, dtype, seed=56).to(ref_dtype), targets, lambda x: x, False))
    (ours, same, ref) = runs
    # the loss at fp32 precision (cross_entropy_ref in bf16 rounds to bf16), the gradient at the input's
    close_to_reference(f"module z_loss + softcap, {reduction}, {dtype}: loss", ours[0], same[0], ref[0],
                       torch.float32, n=v)
    close_to_reference(f"module z_loss + softcap, {reduction}, {dtype}: grad", ours[1], same[1], ref[1], dtype, n=v)


def test_module_single_sample_and_state():
    """Input [V] with a 0-d target, as PyTorch's module takes one sample; the class weights are a
    buffer, in the state dict under PyTorch's name, and the repr lists the arguments set."""
    v = 257
    kwargs = dict(weight=_module_options("weight", v)["weight"], label_smoothing=0.1, reduction="none")
    _module_check("module, one sample [V]", _logits(1, v, torch.float32, seed=57)[0], torch.tensor(9, device=DEVICE),
                  **kwargs)
    ours, theirs = TritonCrossEntropyLoss(**kwargs), nn.CrossEntropyLoss(**kwargs)
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"weight"}
    assert "label_smoothing=0.1" in repr(ours)
    record("module: weight buffer as in torch's state dict", 0.0, 0.0, True)


@pytest.mark.parametrize(
    "make, error, words",
    [
        pytest.param(lambda: (torch.randn(2, 30, 4), torch.zeros(2, 4, dtype=torch.long)), ValueError, "transpose",
                     id="classes in dimension 1 [B, V, T]"),
        pytest.param(lambda: (torch.randn(2, 2, 3, 30), torch.zeros(2, 2, 3, dtype=torch.long)), ValueError,
                     "classes last", id="4-D input"),
        pytest.param(lambda: (torch.randn(4, 30), torch.zeros(5, dtype=torch.long)), ValueError, "classes last",
                     id="N mismatch"),
        pytest.param(lambda: (torch.randn(4, 30), torch.rand(4, 30)), TypeError, "probabilit",
                     id="class-probability targets"),
        pytest.param(lambda: (torch.randn(4, 31), torch.zeros(4, dtype=torch.long)), ValueError, "shape",
                     id="weight of the wrong length"),
    ],
)
def test_module_bad_input_gives_clear_errors(make, error, words):
    logits, targets = make()
    loss_fn = TritonCrossEntropyLoss(weight=torch.ones(30, device=DEVICE))
    message = expect_error(error, loss_fn, logits.to(DEVICE), targets.to(DEVICE))
    assert words in message, message


@pytest.mark.parametrize(
    "kwargs, words",
    [
        pytest.param(dict(reduction="avg"), "reduction", id="bad reduction"),
        pytest.param(dict(label_smoothing=1.5), "label_smoothing", id="label_smoothing > 1"),
        pytest.param(dict(weight=torch.ones(2, 3)), "1-D", id="2-D weight"),
        pytest.param(dict(z_loss=-1.0), "lse_square_scale", id="negative z_loss"),
        pytest.param(dict(softcap=0.0), "softcap", id="softcap 0"),
    ],
)
def test_module_bad_arguments_are_refused_at_construction(kwargs, words):
    message = expect_error(ValueError, lambda: TritonCrossEntropyLoss(**kwargs))
    assert words in message, message


# ---------------------------------------------------------------------------- custom ops, compile
def test_opcheck_every_op():
    """torch.library.opcheck: schema (mutation declared), fake tensors, AOT dispatch, autograd
    registration (the ops carry none: autograd lives in CrossEntropyFunction, so the inputs here
    do not require grad), for each op on small random inputs."""
    logits, targets = _logits(7, 45, torch.float32, seed=26), _targets(7, 45, seed=26, ignore=(2,))
    ops = torch.ops.playbook
    cases = [
        ("cross_entropy_loss, mean", ops.cross_entropy_loss.default, (logits, targets, -100, "mean")),
        ("cross_entropy_fwd, none", ops.cross_entropy_fwd.default, (logits, targets, -100, "none")),
        ("cross_entropy_fwd, sum", ops.cross_entropy_fwd.default, (logits.bfloat16(), targets, -100, "sum")),
        ("cross_entropy_fwd_inplace, mean", ops.cross_entropy_fwd_inplace.default, (logits.clone(), targets, -100, "mean")),
        ("cross_entropy_scale_grad_inplace", ops.cross_entropy_scale_grad_inplace.default,
         (logits.clone(), _upstream(torch.empty(7, device=DEVICE)))),
        ("cross_entropy_scale_grad", ops.cross_entropy_scale_grad.default, (logits, torch.tensor(3.0, device=DEVICE))),
    ]
    for name, op, args in cases:
        result = torch.library.opcheck(op, args)
        passed = all(v == "SUCCESS" for v in result.values())
        record(f"opcheck {name}", 0.0, 0.0, passed, note="" if passed else str(result))


def _all_variants(x, targets, weights):
    """Every reduction, in place and not, each on its own copy of x; one weighted sum of losses."""
    total = []
    for i, (reduction, inplace) in enumerate((r, p) for r in ("mean", "sum", "none") for p in (False, True)):
        loss = cross_entropy(x * 1, targets, reduction=reduction, inplace_grad=inplace)
        total.append((loss * weights[i]).sum() if reduction == "none" else loss * weights[i].sum())
    return torch.stack(total)


def test_torch_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) of the functional API: one graph, the same losses and gradient."""
    n, v = 6, 37
    logits, targets = _logits(n, v, torch.float32, seed=27), _targets(n, v, seed=27, ignore=(1,))
    weights = [_upstream(torch.empty(n, device=DEVICE), seed=s) for s in range(6)]
    results = []
    for fn in (_all_variants, torch.compile(_all_variants, fullgraph=True)):
        x = logits.clone().requires_grad_()
        losses = fn(x, targets, weights)
        losses.sum().backward()
        results.append((losses.detach(), x.grad))
    (eager_loss, eager_grad), (comp_loss, comp_grad) = results
    # The custom ops run the same kernels; only the small reductions around them (sums of
    # weighted per-row losses, the sum of six gradients) may be reordered by inductor: the
    # rounding of an fp32 sum over n terms, which the testkit rule allows (torch_impl = ref).
    close_to_reference("compiled losses (3 reductions x in place or not)", comp_loss, eager_loss, eager_loss,
                       torch.float32, n=n)
    close_to_reference("compiled gradient", comp_grad, eager_grad, eager_grad, torch.float32, n=6 * n)


def test_opcheck_with_options():
    """The same checks with the option arguments in use and the extras asked for (their fake
    shapes, the int64 predictions), for the three forward ops."""
    n, v = 7, 45
    logits, targets = _logits(n, v, torch.float32, seed=39), _targets(n, v, seed=39, ignore=(2,))
    options = (_class_weights(v), 0.1, 1e-2, 5.0)
    ops = torch.ops.playbook
    cases = [
        ("cross_entropy_loss, mean, all options and extras", ops.cross_entropy_loss.default,
         (logits, targets, -100, "mean", *options, True, True)),
        ("cross_entropy_fwd, none, all options and extras", ops.cross_entropy_fwd.default,
         (logits, targets, -100, "none", *options, True, True)),
        ("cross_entropy_fwd_inplace, sum, bf16, softcap and predictions", ops.cross_entropy_fwd_inplace.default,
         (logits.bfloat16(), targets, -100, "sum", None, 0.0, 0.0, 30.0, False, True)),
    ]
    for name, op, args in cases:
        result = torch.library.opcheck(op, args)
        passed = all(v == "SUCCESS" for v in result.values())
        record(f"opcheck {name}", 0.0, 0.0, passed, note="" if passed else str(result))


def test_torch_compile_with_options_and_extras():
    """fullgraph capture of a loss with every option that returns a CrossEntropyOutput: one graph,
    the same loss, extras and gradient as eager. backend="aot_eager" runs Dynamo, the fake
    implementations and the forward/backward partition (where a wrong fake shape or a
    differentiable extra would fail) without inductor's C++ build; the ops are opaque to inductor
    anyway, and test_torch_compile_fullgraph_matches_eager compiles its code around them."""
    n, v = 6, 37
    logits, targets = _logits(n, v, torch.float32, seed=40), _targets(n, v, seed=40, ignore=(1,))
    options = _options("all options", v)

    def loss_and_extras(x):
        out = cross_entropy(x * 1, targets, inplace_grad=True, return_z_loss=True, return_token_accuracy=True,
                            return_predicted_tokens=True, **options)
        return out.loss * 3, out.z_loss, out.token_accuracy, out.predicted_tokens

    results = []
    for fn in (loss_and_extras, torch.compile(loss_and_extras, fullgraph=True, backend="aot_eager")):
        x = logits.clone().requires_grad_()
        loss, *extras = fn(x)
        loss.backward()
        results.append((loss.detach(), *extras, x.grad))
    # the same kernels on the same inputs, and aot_eager runs the same ATen ops around them
    for i, name in enumerate(("loss", "z-loss", "token accuracy", "predicted tokens", "gradient")):
        exactly(f"compiled with options: {name}", results[1][i], results[0][i])


# ---------------------------------------------------------------------------- Hugging Face model
def tiny_llama(seed: int = 0):
    """A 2-layer LLaMA (vocab 512, hidden 64, 4 heads, 2 KV heads), fp32, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=176, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(DEVICE)


def model_step(model, call=None, seed: int = 1, **kwargs):
    """One forward + backward of `call` (default: the model) on a fixed B=2 x T=16 batch with a
    few ignored labels. Returns (loss, the outputs, {parameter name: gradient})."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    model.zero_grad(set_to_none=True)
    out = (model if call is None else call)(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out, grads


def model_error(ours, expected) -> float:
    """The largest relative difference between two runs of model_step: the loss, and each
    parameter gradient relative to its largest entry."""
    loss_a, _, grads_a = ours
    loss_b, _, grads_b = expected
    assert grads_a.keys() == grads_b.keys(), "different parameters got gradients"
    return max([abs(loss_a.item() - loss_b.item()) / abs(loss_b.item())] +
               [((grads_a[k] - grads_b[k]).abs().max() / grads_b[k].abs().max().clamp(min=1e-30)).item()
                for k in grads_a])


def model_close(tag, ours, expected, rel=1e-5):
    """Loss and every parameter gradient of two runs of the same fp32 model, relative to the largest."""
    err = model_error(ours, expected)
    record(f"{tag}: loss and all gradients (relative)", err, rel, err <= rel)


def test_patch_model_matches_hugging_face_and_torch_compile():
    """patch_model replaces the loss (1 replacement, as expected_patches says); the patched model
    gives Hugging Face's loss and gradients; torch.compile(patched model) gives the eager ones."""
    model = tiny_llama()
    reference = model_step(model)  # Hugging Face's own loss (fp32 logits, PyTorch cross-entropy)
    count = cross_entropy_kernel.patch_model(model)
    assert count == 1 == cross_entropy_kernel.expected_patches(model.config)
    eager = model_step(model)
    # In place, outputs.logits now hold the gradient softmax - onehot (over the token count): its
    # rows sum to 0, up to fp32 rounding of 512 terms below 1 (~1e-7); real logits' rows sum to O(1).
    row_sums = eager[1].logits.sum(-1).abs().max().item()
    record("outputs.logits hold the gradient: |row sums|", row_sums, 1e-5, row_sums <= 1e-5)
    # fp32 throughout: the fused loss sums the softmax in another order than PyTorch and writes its
    # gradient already divided by the token count, so loss and gradients agree to a few fp32 ulps
    # (2^-23 = 1.2e-7; we see ~4e-7 after 2 layers of backward). 1e-5 relative allows ~80 ulps,
    # while a wrong shift, mean or missing gradient term is an O(1) relative error.
    model_close("patched vs Hugging Face (eager)", eager, reference)
    # backend="aot_eager": Dynamo's capture of the whole HF forward, functionalization and the
    # forward/backward partition, where graph-level bugs show (an in-place write in backward that
    # reaches a forward output fails right there), without inductor generating and compiling C++
    # for every op of the model, which takes minutes on a 2-core CI machine. Inductor itself runs
    # the ops in test_torch_compile_fullgraph_matches_eager.
    compiled = model_step(model, torch.compile(model, backend="aot_eager"))
    # The same kernels and the same ATen ops, traced: a few fp32 ulps at most, the same bound.
    model_close("torch.compile(patched model) vs eager", compiled, eager)


def tiny_gemma2(seed: int = 0, softcap: float = 0.25):
    """A 2-layer Gemma 2 (vocab 512, hidden 64), fp32, eager attention, with its final logits
    capped by `softcap` (the real model uses 30.0). Its random logits are ~0.2 in size: a cap of
    0.25 bends them enough that capping twice, or not at all, changes the gradients visibly."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          sliding_window=8, final_logit_softcapping=softcap)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(config).to(DEVICE)


def test_loss_of_a_softcapped_model_caps_once():
    """Gemma 2's forward caps its logits itself (final_logit_softcapping) before it calls
    model.loss_function, so the fused loss must not cap them again: it matches Hugging Face, and a
    loss that capped again would be measurably off."""
    model = tiny_gemma2()
    reference = model_step(model)
    model.loss_function = cross_entropy_kernel.fused_causal_lm_loss()  # what patch_model installs
    # fp32 throughout: a few ulps, as in test_patch_model_matches_hugging_face_and_torch_compile
    model_close("Gemma 2 (logits capped by HF): fused loss vs Hugging Face", model_step(model), reference)
    cap = model.config.final_logit_softcapping

    def capped_twice(logits, labels, vocab_size, **kwargs):
        targets = cross_entropy_kernel.causal_targets(labels).reshape(-1)
        return cross_entropy(logits.reshape(-1, vocab_size), targets, softcap=cap)

    model.loss_function = capped_twice
    off = model_error(model_step(model), reference)
    # the test can tell: capping twice is off by far more than 1e-3 (100x the tolerance above)
    record("Gemma 2: a loss that caps twice is off (relative)", off, 1e-3, off > 1e-3)


def test_patch_model_refuses_unknown_families():
    class NotAModel:
        config = type("Config", (), {"model_type": "gpt2"})()

    expect_error(NotImplementedError, cross_entropy_kernel.patch_model, NotAModel())


def test_ideal_bytes_match_the_docstring():
    """The docstring's hand count for LLaMA 3.1 8B at 16384 tokens, bf16, is what ideal_bytes gives."""
    doc = cross_entropy_kernel.__doc__
    for label, backward in (("forward only (the loss):", False), ("forward + backward:", True)):
        line = next(line for line in doc.splitlines() if line.strip().startswith(label))
        counted = int(re.search(r"= ([\d,]+) B", line).group(1).replace(",", ""))
        computed = ideal_bytes(16384, 128256, torch.bfloat16, backward=backward)
        exactly(f"{label} {computed / 1e9:.3f} GB ({computed:,} B)", torch.tensor(computed), torch.tensor(counted))


# ---------------------------------------------------------------------------- GPU-only, full size
@pytest.mark.big_gpu_memory
@pytest.mark.skipif(not ON_GPU, reason="LLaMA's 128256 vocabulary needs a GPU (the interpreter is slow)")
@pytest.mark.parametrize("inplace", [False, True])
def test_llama_vocabulary(inplace):
    n, V = 4096, 128256
    logits, targets = _logits(n, V, torch.bfloat16, seed=12), _targets(n, V, seed=12, ignore=range(0, n, 7))
    _check(f"{n} tokens x V={V}", logits, targets, "mean", inplace=inplace)


@pytest.mark.big_gpu_memory
@pytest.mark.skipif(not ON_GPU, reason="LLaMA's 128256 vocabulary needs a GPU (the interpreter is slow)")
def test_llama_vocabulary_with_every_option():
    """Every option and extra at LLaMA's vocabulary, compiled, in place (blocks of 8192: the launch
    of the options that keep more per-lane state), then once more with host syncs made errors."""
    n, V = 1024, 128256
    logits, targets = _logits(n, V, torch.bfloat16, seed=14), _targets(n, V, seed=14, ignore=range(0, n, 7))
    options = _options("all options", V)
    _check_options(f"{n} tokens x V={V}, all options", logits, targets, "mean", inplace=True, **options)
    x = logits.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync now raises
    try:
        out = cross_entropy(x * 1, targets, inplace_grad=True, return_z_loss=True, return_token_accuracy=True,
                            return_predicted_tokens=True, **options)
        (out.loss * 3).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    exactly("V=128256: predicted tokens == torch.argmax", out.predicted_tokens,
            torch.where(targets == -100, -1, logits.argmax(-1)))


@pytest.mark.big_gpu_memory
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with ~12 GB free")
def test_offsets_past_int32():
    """N x V > 2^31: row offsets must be int64. Check the rows that live past the 2^31 mark."""
    V = 128256
    n = 2**31 // V + 64  # 16807 rows: the last 64 start beyond element 2^31
    logits = _logits(n, V, torch.bfloat16, seed=13, spread=2.0)
    targets = _targets(n, V, seed=13)
    tail = slice(n - 64, n)
    ref_logits = logits[tail].double().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets[tail], reduction="none")
    ref.sum().backward()
    same = F.cross_entropy(logits[tail].float(), targets[tail], reduction="none")  # PyTorch, fp32
    loss, grad = cross_entropy_forward(logits, targets, -100, "none", True, inplace_grad=True)
    close_to_reference("rows past 2^31 elements: loss", loss[tail], same, ref, torch.float32, n=V)
    same_grad = ref_logits.grad.to(torch.bfloat16)  # the true gradient rounded once to bf16
    close_to_reference("rows past 2^31 elements: grad", grad[tail], same_grad, ref_logits.grad, torch.bfloat16, n=V)


@pytest.mark.skipif(not ON_GPU, reason="host syncs and CUDA graphs exist only on a GPU")
@pytest.mark.parametrize("V", [32000, 65536])
def test_no_host_sync_and_cuda_graph_capture(V):
    logits, targets = _logits(256, V, torch.bfloat16), _targets(256, V, ignore=(3,))
    x = logits.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync now raises
    try:
        loss = cross_entropy(x * 1, targets, inplace_grad=True)
        (loss * 3).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record("forward + backward with sync debug mode 'error'", 0.0, 0.0, True)

    static_logits, static_go = logits.clone(), torch.tensor(2.0, device=DEVICE)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles the kernels) outside the capture
        cross_entropy_forward(static_logits.clone(), targets, -100, "mean", True, False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_loss, g_grad = cross_entropy_forward(static_logits, targets, -100, "mean", True, False)
        scale_gradient_(g_grad, static_go)
    fresh = _logits(256, V, torch.bfloat16, seed=99)
    static_logits.copy_(fresh)
    g_loss.zero_()
    graph.replay()
    xr = fresh.double().requires_grad_()
    ref = F.cross_entropy(xr, targets)
    (2 * ref).backward()
    close_to_reference("CUDA graph replay on new logits: loss", g_loss, ref, ref.detach(), torch.float32, n=V, factor=0)
    close_to_reference("CUDA graph replay on new logits: grad", g_grad, xr.grad.to(torch.bfloat16), xr.grad, torch.bfloat16, n=V)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fused cross-entropy: test report"))
