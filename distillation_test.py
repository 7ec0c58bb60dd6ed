"""Tests of the distillation losses: kl_div against F.kl_div, jsd and linear_jsd against float64, the
KL ends of the generalised JSD, ignored tokens, and distill.py's two modes agreeing.

    $ python distillation_test.py  # a readable report: every check, its error and tolerance
    $ pytest distillation_test.py  # the same tests under pytest

Every numeric check compares three computations on the same inputs: ours, plain PyTorch in the same
dtype (F.kl_div; `jsd_ref` / `linear_jsd_ref`, the way distillation code writes the JSD), and a
float64 truth. For the JSD the truth is written here from the definition (M = beta P + (1 - beta) Q,
0 log 0 = 0), independently of the kernel file's reference. Tolerances follow testkit/__init__.py's rule (at
most 2x PyTorch's own error, plus one ulp of the output scale) unless a test explains otherwise.
Vocabularies are odd (131, 257) so the block tails are masked; the student's logits are the
teacher's plus noise, so the divergences are small, as in distillation, where cancellation bites.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import math
import re
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import distillation_kernel
from distillation_kernel import (jsd, jsd_ideal_bytes, jsd_ref, kl_div, linear_jsd, linear_jsd_flops,
                                 linear_jsd_ideal_bytes, linear_jsd_ref)
from core.kernel_utils import DEVICE
from testkit import close_to_reference, exactly, expect_error, random_like_grad, record, run_as_script


# The scale of a JSD loss check: the loss sums V products per token (p * (log p - log m) and the
# like), whose size, ~1 per token, exceeds the small divergence they add up to; rounding follows the
# terms (testkit's `scale`), so a loss of 0.005 is held to fp32 ulps of 1, not of 0.005.
TERMS = 1.0


def _pair(n, v, dtype, seed=0, spread=2.0, noise=0.7):
    """Teacher and student log-probabilities [n, v]: the student's logits are the teacher's plus noise."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.randn(n, v, generator=g, dtype=torch.float64) * spread
    zs = z + torch.randn(n, v, generator=g, dtype=torch.float64) * noise
    return (F.log_softmax(zs, -1).to(DEVICE, dtype), F.log_softmax(z, -1).to(DEVICE, dtype))


def _labels(n, ignore=(), seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = torch.randint(0, 50, (n,), generator=g)
    t[list(ignore)] = -100
    return t.to(DEVICE)


def _kl(a_logp, b_logp):
    """KL(A || B) per row, float64: sum A (log A - log B), a term is 0 where A == 0. The difference is
    zeroed *before* the product so that autograd never multiplies 0 by an infinite difference."""
    a = a_logp.exp()
    return (a * torch.where(a == 0, 0.0, a_logp - b_logp)).sum(-1)


def jsd_definition(x, y, beta, labels=None, ignore_index=-100):
    """The generalised JSD from its definition, in float64. x: the student's log Q, y: the teacher's log P."""
    x, y = x.double().reshape(-1, x.shape[-1]), y.double().reshape(-1, y.shape[-1])
    if beta == 0:
        per_token = _kl(y, x)  # KL(P || Q)
    elif beta == 1:
        per_token = _kl(x, y)  # KL(Q || P)
    else:
        log_m = torch.log(beta * y.exp() + (1 - beta) * x.exp())
        per_token = beta * _kl(y, log_m) + (1 - beta) * _kl(x, log_m)
    counted = torch.ones_like(per_token) if labels is None else (labels.reshape(-1) != ignore_index).double()
    return (per_token * counted).sum() / counted.sum().clamp(min=1)


def _grad_of(fn, x, *args, upstream=3.0, **kw):
    """(loss, d(upstream * loss)/dx) with x as a fresh leaf; upstream 3.0: the loss is not the last op."""
    xg = x.detach().clone().requires_grad_()
    loss = fn(xg, *args, **kw)
    (loss * upstream).backward()
    return loss.detach(), xg.grad


# ---------------------------------------------------------------------------- kl_div
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
def test_kl_div_matches_pytorch(reduction, log_target, dtype):
    """[3, 5, 131]: 'batchmean' divides by 3, 'mean' by every element; gradients for both inputs,
    through a random upstream gradient (per element for 'none', 3.0 otherwise)."""
    x, _ = _pair(15, 131, dtype, seed=2)
    t_logp = _pair(15, 131, torch.float64, seed=3)[1]
    x = x.view(3, 5, 131)
    t = (t_logp if log_target else t_logp.exp()).to(dtype).view(3, 5, 131)

    def run(fn, a, b):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(a, b, reduction=reduction, log_target=log_target)
        up = random_like_grad(out, seed=4).to(out.dtype) if reduction == "none" else torch.tensor(3.0, device=DEVICE)
        (out * up).sum().backward()
        return out.detach(), a.grad, b.grad

    ours, same, ref = run(kl_div, x, t), run(F.kl_div, x, t), run(F.kl_div, x.double(), t.double())
    tag = f"{reduction}, log_target={log_target}"
    # The 'none' losses come back in the inputs' dtype, as F.kl_div returns them; reductions in fp32.
    close_to_reference(f"{tag}: loss", ours[0], same[0], ref[0], dtype if reduction == "none" else torch.float32,
                       n=1 if reduction == "none" else x.numel())
    close_to_reference(f"{tag}: d input", ours[1], same[1], ref[1], dtype)
    close_to_reference(f"{tag}: d target", ours[2], same[2], ref[2], dtype)


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
def test_kl_div_module_is_a_drop_in_for_torch(reduction, log_target):
    """TritonKLDivLoss(reduction, log_target) against torch.nn.KLDivLoss built with the same
    arguments, on a non-contiguous [5, 3, 131] view: loss and the gradient of both inputs."""
    from distillation_kernel import TritonKLDivLoss

    x, _ = _pair(15, 131, torch.float32, seed=7)
    t_logp = _pair(15, 131, torch.float64, seed=8)[1]
    x = x.view(3, 5, 131).transpose(0, 1)  # non-contiguous
    t = (t_logp if log_target else t_logp.exp()).float().view(3, 5, 131).transpose(0, 1)

    def run(module, a, b):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = module(a, b)
        up = random_like_grad(out, seed=9).to(out.dtype) if reduction == "none" else torch.tensor(3.0, device=DEVICE)
        (out * up).sum().backward()
        return out.detach(), a.grad, b.grad

    ours = run(TritonKLDivLoss(reduction=reduction, log_target=log_target), x, t)
    same = run(torch.nn.KLDivLoss(reduction=reduction, log_target=log_target), x, t)
    ref = run(torch.nn.KLDivLoss(reduction=reduction, log_target=log_target), x.double(), t.double())
    tag = f"TritonKLDivLoss({reduction!r}, log_target={log_target})"
    # fp32 inputs: the rule's fp32 terms (twice torch's own error, one ulp, sqrt(n) rounding of the sums)
    close_to_reference(f"{tag}: loss", ours[0], same[0], ref[0], torch.float32, n=1 if reduction == "none" else x.numel())
    close_to_reference(f"{tag}: d input", ours[1], same[1], ref[1], torch.float32)
    close_to_reference(f"{tag}: d target", ours[2], same[2], ref[2], torch.float32)
    assert "size_average" in expect_error(ValueError, TritonKLDivLoss, True)
    assert "reduction" in expect_error(ValueError, lambda: TritonKLDivLoss(reduction="avg"))


def test_jsd_module_matches_the_function():
    from distillation_kernel import TritonJSDLoss

    x, y = _pair(12, 97, torch.float32, seed=10)
    labels = torch.tensor([1, -100, 3, 4, -100, 6, 7, 8, 9, 10, 11, 12], device=DEVICE)
    module = TritonJSDLoss(beta=0.3)
    exactly("TritonJSDLoss == jsd", module(x, y, labels), jsd(x, y, beta=0.3, shift_labels=labels))
    assert "beta=0.3" in repr(module)


def test_kl_div_nan_exactly_where_pytorch_has_it():
    """F.kl_div's own conventions at the edges: a zero target gives 0, except against an input of
    -inf (0 * -inf is NaN); a log-target of -inf gives NaN; the target's gradient at 0 is NaN. Ours is
    a drop-in: the same values, NaN in the same places, for the loss and both gradients."""
    for log_target, x, t in ((False, [-1.0, -2.0, -math.inf, -0.5], [0.0, 0.5, 0.0, 0.5]),
                             (True, [-1.0, -2.0, -3.0, -0.5], [-math.inf, -0.7, -0.7, -1.2])):
        outs = []
        for fn in (kl_div, F.kl_div):
            xi = torch.tensor([x], device=DEVICE, requires_grad=True)
            ti = torch.tensor([t], device=DEVICE, requires_grad=True)
            out = fn(xi, ti, reduction="none", log_target=log_target)
            out.sum().backward()
            outs.append((out.detach(), xi.grad, ti.grad))
        for what, o, r in zip(("loss", "d input", "d target"), *outs):
            close_to_reference(f"log_target={log_target}: {what}, NaN where PyTorch's", o, r, r, torch.float32)


def test_kl_div_matches_jsd_forward_kl():
    """kl_div(student, teacher, log_target=True) per token = jsd(beta=0) per token: both are KL(P || Q)."""
    x, y = _pair(9, 257, torch.float32, seed=5)
    ours = kl_div(x, y, reduction="batchmean", log_target=True)
    ref = jsd_definition(x, y, 0.0)
    close_to_reference("batchmean KL(P || Q) = jsd(beta=0)", ours, jsd(x, y, beta=0.0), ref, torch.float32, n=257)


# ---------------------------------------------------------------------------- jsd on log-probabilities
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
def test_jsd_matches_reference(beta, dtype):
    """12 tokens, 3 ignored, vocabulary 131; the loss and the student's gradient."""
    x, y = _pair(12, 131, dtype, seed=6)
    labels = _labels(12, ignore=(0, 5, 11))
    ours = _grad_of(jsd, x, y, beta, shift_labels=labels)
    same = _grad_of(jsd_ref, x, y, beta, shift_labels=labels)  # plain PyTorch, fp32 math on these inputs
    ref = _grad_of(jsd_definition, x.double(), y, beta, labels)
    assert ours[0].dtype == torch.float32, "the loss is fp32 whatever the inputs' dtype"
    close_to_reference(f"beta={beta}: loss", ours[0], same[0], ref[0], torch.float32, n=131, scale=TERMS)
    close_to_reference(f"beta={beta}: d student", ours[1], same[1], ref[1], dtype)
    # jsd_ref (the baseline of distill.py and of the benchmark) in float64 against the definition:
    # float64 both ways, so only rounding at 1e-16 of the terms may separate them.
    err = abs(jsd_ref(x.double(), y.double(), beta, shift_labels=labels).item() - ref[0].item())
    record(f"beta={beta}: jsd_ref in float64 = the definition", err, 1e-12, err <= 1e-12)


def test_beta_ends_are_the_two_kl_divergences():
    """beta=0 is KL(teacher || student), beta=1 is KL(student || teacher), PyTorch's own KL; and the
    mixture approaches them: JSD_b / b -> KL(P || Q) as b -> 0, JSD_b / (1 - b) -> KL(Q || P) as b -> 1,
    with a first-order error (10x smaller at 1e-4 than at 1e-3), so the ends continue the mixture
    rather than swap its roles. Finally the symmetry jsd(x, y, b) = jsd(y, x, 1 - b)."""
    x, y = _pair(10, 131, torch.float32, seed=7, noise=1.5)
    forward_kl = F.kl_div(x.double(), y.double(), reduction="batchmean", log_target=True)  # KL(P || Q)
    reverse_kl = F.kl_div(y.double(), x.double(), reduction="batchmean", log_target=True)  # KL(Q || P)
    close_to_reference("beta=0: KL(P || Q) (F.kl_div)", jsd(x, y, 0.0), forward_kl.float(), forward_kl,
                       torch.float32, n=131)
    close_to_reference("beta=1: KL(Q || P) (F.kl_div)", jsd(x, y, 1.0), reverse_kl.float(), reverse_kl,
                       torch.float32, n=131)
    for end, kl, scale_of in ((0.0, forward_kl, lambda b: b), (1.0, reverse_kl, lambda b: 1 - b)):
        errs = []
        for eps in (1e-3, 1e-4):
            b = eps if end == 0.0 else 1 - eps
            errs.append(abs(jsd(x, y, b).item() / scale_of(b) - kl.item()))
        record(f"JSD_b / {'b' if end == 0 else '(1 - b)'} -> beta={end:g}: error shrinks 10x", errs[1], errs[0] / 5,
               errs[1] <= errs[0] / 5)
    for b in (0.0, 0.3, 0.5):
        close_to_reference(f"jsd(x, y, {b}) = jsd(y, x, {1 - b})", jsd(x, y, b), jsd(y, x, 1 - b),
                           jsd_definition(x, y, b), torch.float32, n=131)


def test_ignored_and_all_ignored_tokens():
    """Ignored rows: no loss, a gradient row of exact zeros (stored, not left uninitialised). A custom
    ignore_index. All ignored: 0.0, attached to the graph, zero gradient."""
    x, y = _pair(8, 131, torch.bfloat16, seed=8)
    labels = _labels(8, ignore=(1, 6))
    xg = x.clone().requires_grad_()
    jsd(xg, y, shift_labels=labels).backward()
    exactly("ignored rows: gradient 0", xg.grad[[1, 6]], torch.zeros(2, 131, dtype=torch.bfloat16, device=DEVICE))
    keep = labels != -100
    close_to_reference("loss = mean over the counted rows only", jsd(x, y, shift_labels=labels), jsd(x[keep], y[keep]),
                       jsd_definition(x[keep], y[keep], 0.5), torch.float32, n=131, scale=TERMS)
    custom = torch.where(labels == -100, 7, labels)
    close_to_reference("ignore_index=7", jsd(x, y, ignore_index=7, shift_labels=custom), jsd(x, y, shift_labels=labels),
                       jsd_definition(x, y, 0.5, labels), torch.float32, n=131, scale=TERMS)
    xg = x.clone().requires_grad_()
    loss = jsd(xg, y, shift_labels=torch.full_like(labels, -100))
    assert loss.requires_grad, "an all-ignored loss stays attached to the graph"
    loss.backward()
    exactly("all ignored: loss 0", loss, torch.tensor(0.0, device=DEVICE))
    exactly("all ignored: gradient 0", xg.grad, torch.zeros_like(x))


def test_strided_and_batched_labels():
    """[B, T, V] log-probabilities with labels[:, 1:] of a [B, T + 1] batch (not contiguous)."""
    B, T, V = 2, 5, 131
    x, y = _pair(B * T, V, torch.float32, seed=9)
    g = torch.Generator(device="cpu").manual_seed(9)
    batch_labels = torch.randint(0, V, (B, T + 1), generator=g).to(DEVICE)
    batch_labels[1, 3] = -100
    shift = batch_labels[:, 1:]
    assert not shift.is_contiguous()
    ours = _grad_of(jsd, x.view(B, T, V), y.view(B, T, V), 0.5, shift_labels=shift)
    ref = _grad_of(jsd_definition, x.double().view(B, T, V), y.view(B, T, V), 0.5, shift)
    same = _grad_of(jsd_ref, x.view(B, T, V), y.view(B, T, V), 0.5, shift_labels=shift)
    close_to_reference("[B, T, V], labels[:, 1:]: loss", ours[0], same[0], ref[0], torch.float32, n=V, scale=TERMS)
    close_to_reference("[B, T, V], labels[:, 1:]: d student", ours[1], same[1], ref[1], torch.float32)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_masked_vocabulary_stays_finite(beta):
    """The teacher gives -inf log-probability to part of the vocabulary: those terms are 0 (0 log 0),
    where F.kl_div-based code (jsd_ref) returns NaN or inf. At beta=1 the student gives those entries
    probability too, so the reverse KL is infinite, as it should be; mask the student's as well there."""
    x, y = _pair(6, 131, torch.float32, seed=10)
    masked = torch.zeros(131, dtype=torch.bool, device=DEVICE)
    masked[100:] = True
    y = F.log_softmax(y.masked_fill(masked, -math.inf), -1)
    if beta == 1.0:
        x = F.log_softmax(x.masked_fill(masked, -math.inf), -1)
    ours = _grad_of(jsd, x, y, beta)
    ref = _grad_of(jsd_definition, x.double(), y.double(), beta)
    same = _grad_of(jsd_definition, x, y.double(), beta)  # the definition on fp32 inputs stands in for PyTorch
    assert torch.isfinite(ours[0]) and not torch.isfinite(jsd_ref(x, y, beta)), "finite where F.kl_div's form is not"
    close_to_reference(f"beta={beta}, 31 masked entries: loss", ours[0], same[0].float(), ref[0], torch.float32,
                       n=131, scale=TERMS)
    close_to_reference(f"beta={beta}, 31 masked entries: d student", ours[1], same[1].float(), ref[1], torch.float32)


def test_nan_poisons_only_its_row():
    x, y = _pair(5, 131, torch.float32, seed=11)
    x[2, 40] = float("nan")
    xg = x.clone().requires_grad_()
    loss = jsd(xg, y)
    loss.backward()
    assert torch.isnan(loss), "a NaN input makes the mean NaN"
    nan_rows = torch.isnan(xg.grad).any(-1)
    exactly("NaN only in the gradient row of the NaN input", nan_rows, torch.arange(5, device=DEVICE) == 2)


def test_empty_batch():
    x, y = _pair(0, 131, torch.bfloat16)
    xg = x.clone().requires_grad_()
    loss = jsd(xg, y)
    loss.backward()
    exactly("no tokens: loss 0", loss, torch.tensor(0.0, device=DEVICE))
    assert xg.grad.shape == (0, 131)


# ---------------------------------------------------------------------------- linear_jsd
def _heads(n, hs, ht, v, dtype, seed=12):
    """Student [n, hs] and [v, hs], teacher [n, ht] and [v, ht]: logits ~ N(0, 2.5), related (the
    student's head is a noisy copy of a projection of the teacher's), different hidden sizes."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    xt = torch.randn(n, ht, generator=g)
    wt = torch.randn(v, ht, generator=g) * ht**-0.5 * 2.5
    proj = torch.randn(ht, hs, generator=g) * ht**-0.5
    xs = xt @ proj
    ws = wt @ proj * (ht / hs) ** 0.5 * 0.8 + torch.randn(v, hs, generator=g) * hs**-0.5 * 0.8
    return [t.to(DEVICE, dtype) for t in (xs, ws, xt, wt)]


def _run_linear(fn, xs, ws, xt, wt, **kw):
    xs, ws = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    loss = fn(xs, ws, xt, wt, **kw)
    (loss * 3.0).backward()
    return loss.detach(), xs.grad, ws.grad


@pytest.mark.parametrize("dtype, beta, temperature", [
    (torch.float32, 0.0, 2.0), (torch.float32, 0.5, 2.0), (torch.float32, 1.0, 2.0),
    (torch.float32, 0.3, 0.7), (torch.bfloat16, 0.5, 2.0), (torch.bfloat16, 0.0, 1.0)])
def test_linear_jsd_matches_unfused(dtype, beta, temperature):
    """20 tokens in chunks of 8 (the last one short), student hidden 24, teacher 40, vocabulary 131;
    3 tokens ignored. Against PyTorch's full logits (linear_jsd_ref) in the same dtype and in float64."""
    N, V = 20, 131
    xs, ws, xt, wt = _heads(N, 24, 40, V, dtype)
    labels = _labels(N, ignore=(2, 9, 19))
    kw = dict(shift_labels=labels, beta=beta, temperature=temperature)
    ours = _run_linear(linear_jsd, xs, ws, xt, wt, chunk=8, **kw)
    same = _run_linear(linear_jsd_ref, xs, ws, xt, wt, **kw)
    ref = _run_linear(linear_jsd_ref, *(t.double() for t in (xs, ws, xt, wt)), **kw)
    tag = f"{str(dtype)[6:]}, beta={beta}, T={temperature}"
    close_to_reference(f"{tag}: loss", ours[0], same[0], ref[0], torch.float32, n=V, scale=TERMS)
    close_to_reference(f"{tag}: dx", ours[1], same[1], ref[1], dtype, n=V)
    close_to_reference(f"{tag}: dW", ours[2], same[2], ref[2], dtype, n=N)


def test_linear_jsd_is_the_composition():
    """linear_jsd = jsd(log_softmax(x_s W_s^T / T), log_softmax(x_t W_t^T / T)): the fused op against
    this file's own jsd kernel on the materialised log-probabilities, loss and both gradients."""
    xs, ws, xt, wt = _heads(14, 16, 32, 257, torch.float32, seed=13)
    labels = _labels(14, ignore=(3,))
    T = 1.5

    def composed(a, b, c, d, **kw):
        x = F.log_softmax((a @ b.t()) / T, -1)
        y = F.log_softmax((c @ d.t()) / T, -1)
        return jsd(x, y, beta=0.4, shift_labels=labels)

    ours = _run_linear(linear_jsd, xs, ws, xt, wt, shift_labels=labels, beta=0.4, temperature=T, chunk=5)
    comp = _run_linear(composed, xs, ws, xt, wt)
    ref = _run_linear(linear_jsd_ref, *(t.double() for t in (xs, ws, xt, wt)), shift_labels=labels, beta=0.4,
                      temperature=T)
    for i, what in enumerate(("loss", "dx", "dW")):
        close_to_reference(f"fused vs composed: {what}", ours[i], comp[i], ref[i], torch.float32,
                           n=257 if what != "dW" else 14, scale=TERMS if what == "loss" else None)


def test_linear_jsd_frozen_head_and_no_teacher_gradient():
    """A frozen student head (adapters train beside it): only dx, no .grad on the weight. A teacher
    tensor that requires grad is refused with a clear error instead of silently getting none."""
    xs, ws, xt, wt = _heads(10, 16, 24, 131, torch.float32, seed=14)
    xg = xs.clone().requires_grad_()
    linear_jsd(xg, ws, xt, wt, chunk=4).backward()
    xr = xs.double().requires_grad_()
    linear_jsd_ref(xr, ws.double(), xt.double(), wt.double()).backward()
    xsame = xs.clone().requires_grad_()
    linear_jsd_ref(xsame, ws, xt, wt).backward()
    close_to_reference("frozen head: dx", xg.grad, xsame.grad, xr.grad, torch.float32, n=131)
    message = expect_error(ValueError, linear_jsd, xs, ws, xt, wt.clone().requires_grad_())
    assert "no_grad" in message
    x, y = _pair(3, 10, torch.float32)
    expect_error(ValueError, jsd, x, y.requires_grad_())
    with torch.no_grad():  # evaluation: a teacher that requires grad is harmless without autograd
        linear_jsd(xs, ws, xt, wt.clone().requires_grad_())


def test_linear_jsd_all_ignored_and_empty():
    xs, ws, xt, wt = _heads(6, 8, 12, 50, torch.float32, seed=15)
    xg, wg = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    loss = linear_jsd(xg, wg, xt, wt, shift_labels=torch.full((6,), -100, device=DEVICE), chunk=4)
    assert loss.requires_grad, "an all-ignored loss stays attached to the graph"
    loss.backward()
    exactly("all ignored: loss 0", loss, torch.tensor(0.0, device=DEVICE))
    exactly("all ignored: dx 0", xg.grad, torch.zeros_like(xs))
    exactly("all ignored: dW 0", wg.grad, torch.zeros_like(ws))
    xg, wg = xs[:0].clone().requires_grad_(), ws.clone().requires_grad_()
    linear_jsd(xg, wg, xt[:0], wt).backward()
    exactly("no tokens: dW 0", wg.grad, torch.zeros_like(ws))


def test_linear_jsd_under_autocast():
    """fp32 weights under bf16 autocast: both heads run in bf16 (same bits as bf16 inputs), the
    student's gradients come back in fp32."""
    xs, ws, xt, wt = _heads(8, 16, 24, 131, torch.float32, seed=16)
    xg, wg = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = linear_jsd(xg, wg, xt, wt, temperature=2.0, chunk=4)
    loss.backward()
    assert xg.grad.dtype == torch.float32 and wg.grad.dtype == torch.float32, "gradients in the inputs' dtype"
    in_bf16 = linear_jsd(*(t.bfloat16() for t in (xs, ws, xt, wt)), temperature=2.0, chunk=4)
    exactly("autocast computes both heads in bf16", loss.detach(), in_bf16)


# ---------------------------------------------------------------------------- errors
def _bad_linear(kind):
    xs, ws, xt, wt = (torch.randn(4, 8), torch.randn(10, 8), torch.randn(4, 6), torch.randn(10, 6))
    return {"hidden mismatch": (xs, ws, xt, torch.randn(10, 5)), "token mismatch": (xs, ws, xt[:3], wt),
            "vocab mismatch": (xs, ws, xt, wt[:9]), "1-D input": (xs[0], ws, xt[0], wt)}[kind]


@pytest.mark.parametrize("kind", ["hidden mismatch", "token mismatch", "vocab mismatch", "1-D input"])
def test_linear_jsd_bad_shapes(kind):
    expect_error(ValueError, linear_jsd, *(t.to(DEVICE) for t in _bad_linear(kind)))


def test_bad_options_and_dtypes():
    x, y = _pair(4, 10, torch.float32)
    xs, ws, xt, wt = _heads(4, 8, 6, 10, torch.float32)
    for beta in (-0.1, 1.5, float("nan")):
        expect_error(ValueError, jsd, x, y, beta)
    expect_error(ValueError, lambda: linear_jsd(xs, ws, xt, wt, beta=2.0))
    for temperature in (0.0, -1.0, float("inf")):
        expect_error(ValueError, lambda: linear_jsd(xs, ws, xt, wt, temperature=temperature))
    expect_error(ValueError, lambda: linear_jsd(xs, ws, xt, wt, chunk=0))
    expect_error(ValueError, jsd, x, y[:, :9])
    expect_error(ValueError, lambda: jsd(x, y, shift_labels=torch.zeros(5, dtype=torch.long, device=DEVICE)))
    expect_error(TypeError, lambda: jsd(x, y, shift_labels=torch.zeros(4, device=DEVICE)))
    expect_error(TypeError, jsd, x.long(), y)
    expect_error(TypeError, linear_jsd, xs, ws.bfloat16(), xt, wt)
    expect_error(ValueError, kl_div, x, y[:2])
    expect_error(ValueError, lambda: kl_div(x, y, reduction="avg"))


# ---------------------------------------------------------------------------- custom ops, compile
def test_opcheck_every_op():
    """torch.library.opcheck: schema, fake tensors (placeholders included), registered autograd, and
    AOT dispatch with dynamic shapes (the backward formulas traced where inputs require grad)."""
    x, y = _pair(6, 37, torch.float32, seed=17)
    labels = _labels(6, ignore=(2,))
    xs, ws, xt, wt = _heads(7, 8, 12, 30, torch.float32, seed=18)
    rg = lambda t: t.clone().requires_grad_()  # noqa: E731
    ops = torch.ops.playbook
    cases = [
        ("kl_div, none, grads for both", ops.kl_div.default, (rg(x), rg(y.exp()), False, True)),
        ("kl_div, sum, log_target", ops.kl_div.default, (rg(x), y, True, False)),
        ("kl_div_bwd", ops.kl_div_bwd.default, (random_like_grad(x), x, y.exp(), False, True, True, True)),
        ("jsd, labels, beta 0.5", ops.jsd.default, (rg(x), y, labels, 0.5, -100, True)),
        ("jsd, no labels, beta 0, bf16, loss only", ops.jsd.default,
         (x.bfloat16(), y.bfloat16(), None, 0.0, -100, False)),
        ("linear_jsd, 3 chunks, dx and dW", ops.linear_jsd.default,
         (rg(xs), rg(ws), xt, wt, labels[:1].expand(7), 0.5, 2.0, -100, True, True, True, 3)),
        ("linear_jsd, loss only", ops.linear_jsd.default,
         (xs, ws, xt, wt, None, 1.0, 1.0, -100, False, False, True, None)),
    ]
    for name, op, args in cases:
        result = torch.library.opcheck(op, args)
        passed = all(v == "SUCCESS" for v in result.values())
        record(f"opcheck {name}", 0.0, 0.0, passed, note="" if passed else str(result))


def test_torch_compile_fullgraph_matches_eager():
    """One graph around the opaque ops (aot_eager: Dynamo, fake tensors and the forward/backward
    partition, without inductor's C++ build): the same losses and gradients as eager, bit for bit."""
    x, y = _pair(6, 37, torch.float32, seed=19)
    xs, ws, xt, wt = _heads(6, 8, 12, 37, torch.float32, seed=19)
    labels = _labels(6, ignore=(4,))

    def losses(a, b):
        return (jsd(torch.tanh(a) + x, y, 0.3, shift_labels=labels) * 2
                + linear_jsd(torch.tanh(b), ws, xt, wt, labels, 0.5, 2.0, chunk=4)
                + kl_div(a, y.exp(), "batchmean"))

    results = []
    torch._dynamo.reset()
    for fn in (losses, torch.compile(losses, fullgraph=True, backend="aot_eager")):
        a, b = x.clone().requires_grad_(), xs.clone().requires_grad_()
        loss = fn(a, b)
        loss.backward()
        results.append((loss.detach(), a.grad, b.grad))
    for what, eager, comp in zip(("loss", "d jsd/kl_div input", "d linear_jsd input"), *results):
        exactly(f"compiled == eager: {what}", comp, eager)


@pytest.mark.parametrize("which", ["jsd", "linear_jsd", "kl_div"])
def test_second_order_gradients_raise(which):
    x, y = _pair(4, 20, torch.float32, seed=20)
    xs, ws, xt, wt = _heads(4, 8, 8, 20, torch.float32, seed=20)
    leaf = (xs if which == "linear_jsd" else x).clone().requires_grad_()
    loss = {"jsd": lambda: jsd(leaf, y), "linear_jsd": lambda: linear_jsd(leaf, ws, xt, wt),
            "kl_div": lambda: kl_div(leaf, y.exp())}[which]()
    with pytest.raises(RuntimeError, match="second|no second derivative"):
        (g,) = torch.autograd.grad(loss, leaf, create_graph=True)
        (g * g).sum().backward()
    record(f"{which}: create_graph=True gives a clear error", 0.0, 0.0, True)


def test_backward_twice_is_refused():
    """The gradient is a buffer computed in the forward pass: a second backward would reuse a
    rescaled buffer, so it raises instead."""
    x, y = _pair(4, 20, torch.float32, seed=21)
    loss = jsd(x.clone().requires_grad_(), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward once|inplace operation"):
        loss.backward()
    record("jsd: second backward raises", 0.0, 0.0, True)


# ---------------------------------------------------------------------------- the docstring's counts
class _CountBytes(TorchDispatchMode):
    """Bytes every aten op reads and writes (a broadcast tensor counts what it stores), and the peak of
    live tensors with at least `big` elements."""

    def __init__(self, big):
        super().__init__()
        self.moved, self.big, self.live, self.peak = 0, big, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func == torch.ops.aten.detach.default:
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.moved += sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in tensors)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.big:
                self.live[t.untyped_storage().data_ptr()] = (weakref.ref(t), t.untyped_storage().nbytes())
        self.live = {k: v for k, v in self.live.items() if v[0]() is not None}
        self.peak = max(self.peak, sum(v[1] for v in self.live.values()))
        return out


def test_docstring_counts():
    """The module docstring's numbers: ideal bytes and flops at LLaMA 3.1 8B -> 3.2 1B shapes, and the
    unfused jsd_ref's traffic and peak, counted op by op here (bf16 log-probabilities, beta = 0.5)."""
    doc = distillation_kernel.__doc__
    n, v, hs, ht = 16384, 128256, 2048, 4096

    def number(pattern):
        return int(re.search(pattern, doc).group(1).replace(",", ""))

    for label, backward in (("forward \\(the loss\\):", False), ("forward \\+ backward:", True)):
        counted = number(label + r"\s+16384 \* 128256 \* \d \+ 16384 \* \(8 \+ 4\) = ([\d,]+) B")
        exactly(f"jsd {label.replace(chr(92), '')} {counted:,} B", torch.tensor(jsd_ideal_bytes(n, v, torch.bfloat16,
                                                                                              backward)),
                torch.tensor(counted))
    exactly("linear_jsd forward bytes", torch.tensor(linear_jsd_ideal_bytes(n, hs, ht, v, torch.bfloat16)),
            torch.tensor(number(r"forward:\s+\(16384.*= ([\d,]+) B")))
    exactly("linear_jsd forward + backward bytes", torch.tensor(linear_jsd_ideal_bytes(n, hs, ht, v, torch.bfloat16,
                                                                                       backward=True)),
            torch.tensor(number(r"forward \+ backward:\s+\.\.\..*= ([\d,]+) B")))
    exactly("linear_jsd flops", torch.tensor(linear_jsd_flops(n, hs, ht, v)), torch.tensor(number(r"= ([\d,]+) flops")))
    N, V = 64, 4096  # large enough that the per-row and per-token scalars are noise
    x, y = _pair(N, V, torch.bfloat16, seed=22)
    xg = x.clone().requires_grad_()
    with _CountBytes(N * V) as c:
        loss = jsd_ref(xg, y, 0.5, shift_labels=_labels(N))
        forward = c.moved
        loss.backward()
    per_elt = (forward / (N * V), (c.moved - forward) / (N * V), c.peak / (N * V * 4))
    claimed = [float(v) for v in re.search(r"gives (\d+) bytes per element\s+forward and (\d+) more in backward at "
                                           r"beta = 0.5, and (\d+) N x V fp32", doc).groups()]
    names = ("forward B/element", "backward B/element", "peak fp32 N x V tensors")
    for what, got, want in zip(names, per_elt, claimed):
        record(f"unfused jsd_ref: {what} = {want:g}", abs(got - want), 0.5, abs(got - want) <= 0.5)
    xs, ws, xt, wt = _heads(N, 16, 24, V, torch.bfloat16, seed=23)
    xs.requires_grad_(), ws.requires_grad_()
    with _CountBytes(N * V) as c:
        linear_jsd_ref(xs, ws, xt, wt, _labels(N), 0.5, 2.0).backward()
    want = float(re.search(r"(\d+) bytes per\s+token and vocabulary entry are alive at the peak", doc).group(1))
    got = c.peak / (N * V)
    record(f"unfused linear_jsd_ref: peak B/element = {want:g}", abs(got - want), 0.5, abs(got - want) <= 0.5)


# ---------------------------------------------------------------------------- benchmark entries
def test_benchmark_entries_check_then_measure():
    """benchmark_kernels.py's jsd and linear_jsd entries (run only when named, so `--smoke` of all
    kernels does not reach them): each implementation passes its float64 check before it is timed,
    and every row's bytes and flops are distillation_kernel's own counts."""
    import benchmark_kernels as bk

    for name in ("jsd", "linear_jsd"):
        spec = bk.SPECS[name]
        rows = bk._measure_impls(spec, spec.smoke[0], torch.bfloat16, spec.impls())
        impls = {r["impl"].split(" +")[0] for r in rows}
        assert {"ours", "eager", "torch.compile"} <= impls, impls
        ideal_bytes = getattr(distillation_kernel, f"{name}_ideal_bytes")
        for r in rows:
            for phase, backward in (("fwd", False), ("fwdbwd", True)):
                assert r[f"{phase}_bytes"] == ideal_bytes(**r["shape"], dtype=torch.bfloat16, backward=backward)
                flops = linear_jsd_flops(**r["shape"], backward=backward) if name == "linear_jsd" else None
                assert r[f"{phase}_flops"] == flops
        record(f"benchmark {name}: {len(rows)} implementations checked and measured", 0.0, 0.0, True)


# ---------------------------------------------------------------------------- distill.py
def test_distill_modes_agree_on_the_first_step():
    """distill.py in this process, fp32, both modes, 2 steps on 1 x 16 tokens: the baseline (full
    logits, F.cross_entropy, jsd_ref) and the fused mode (linear_cross_entropy, linear_jsd) must give
    the same first-step losses, and the run writes its JSON."""
    from playbook.store.files import RESULTS_DIR
    import distill

    tag = "test_distill_llama-tiny"
    try:
        # the tiny presets named: on a GPU the defaults would be the 8B teacher and the 1B student
        payload = distill.main(["--teacher", "llama-tiny", "--student", "llama-tiny-student",
                                "--steps", "2", "--timing-warmup-steps", "1", "--batch-size", "1", "--seq-len", "16",
                                "--dtype", "float32", "--beta", "0.3", "--temperature", "2", "--alpha", "0.4",
                                "--tag", tag, "--overwrite"])
        assert (RESULTS_DIR / f"{tag}.json").is_file()
    finally:
        (RESULTS_DIR / f"{tag}.json").unlink(missing_ok=True)
    base, fused = payload["modes"]["baseline"], payload["modes"]["fused"]
    # fp32 throughout; the modes differ in summation order and in the heads' matmuls being split in
    # chunks: a few fp32 ulps (2^-23 = 1.2e-7 relative) per term, grown at most ~sqrt(512) by the sums
    # over the vocabulary. 1e-5 of the cross-entropy's size (the scale of the terms of both sums: the
    # per-token entropy) allows ~80 ulps; a wrong shift, mask, temperature, beta or alpha is O(1).
    scale = abs(base["ce"][0])
    for key in ("losses", "ce", "jsd"):
        err = abs(fused[key][0] - base[key][0])
        record(f"distill.py step 1 {key}: fused vs baseline", err, 1e-5 * scale, err <= 1e-5 * scale)
    assert base["jsd"][0] > 1e-4, "the student must differ from the teacher, or the JSD check is vacuous"


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Distillation losses: test report"))
