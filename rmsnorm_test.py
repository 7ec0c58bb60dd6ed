"""Tests of the fused RMSNorm: forward, dx and dW against float64, edge cases, and bad input.

    $ python rmsnorm_test.py        # a readable report: every check, its error and tolerance
    $ pytest rmsnorm_test.py        # the same tests under pytest

Without a GPU the kernels run in Triton's interpreter at small sizes; with one, the same tests also
run the LLaMA 3.1 8B shape (4096 tokens x hidden 4096) compiled. Tolerances follow the rule in
testkit.py: at most 2x PyTorch's own error against float64, plus one ulp of the output scale.
"""

import pytest
import torch

from kernel_utils import DEVICE
from rmsnorm_kernel import MAX_HIDDEN, TritonRMSNorm, rmsnorm, rmsnorm_ref
from testkit import close_to_reference, expect_error, exactly, random_like_grad, record, run_as_script

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ON_GPU = DEVICE.type == "cuda"


def _inputs(shape, dtype, seed=0, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # Non-zero mean and a spread of magnitudes: a plain randn would hide an eps or mean bug less
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device=device, dtype=dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(device=device, dtype=dtype)  # never all ones
    return x, w


def _check_all(tag, x, w, eps=1e-6, seed=1, dy=None, grad_x=True, grad_w=True):
    """Forward, dx and dW of ours vs float64 reference vs PyTorch in the same dtype."""
    dtype = x.dtype
    if dy is None:
        dy = random_like_grad(x.new_empty(x.shape[:-1] + (w.shape[0],)), seed=seed)

    def run(fn, cast):
        xi = cast(x.detach()).clone().requires_grad_(grad_x)
        wi = cast(w.detach()).clone().requires_grad_(grad_w)
        y = fn(xi, wi, eps)
        y.backward(cast(dy))
        return y, xi.grad, wi.grad

    ours = run(rmsnorm, lambda t: t)
    torch_same = run(rmsnorm_ref, lambda t: t)
    ref = run(rmsnorm_ref, lambda t: t.double())

    assert ours[0].dtype == dtype and ours[0].shape == x.shape
    H, rows = x.shape[-1], x.numel() // max(x.shape[-1], 1)
    # dx = rstd * (dy * w - x_hat * mean(dy * w * x_hat)) can cancel to ~0 (always, for H = 1):
    # measure its error against the size of the terms, rstd * |dy * w|, not against the result.
    xd = x.detach().double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1) + eps).max().item() if x.numel() else 0.0
    dx_scale = rstd * (dy.double().abs().max().item() if dy.numel() else 0.0) * w.double().abs().max().item()
    checks = [("y", H, None), ("dx", H, dx_scale), ("dW", rows, None)]
    for (what, n, scale), o, t, r in zip(checks, ours, torch_same, ref):
        if r is None:
            assert o is None, f"{what} should not have been computed"
            continue
        close_to_reference(f"{tag} {what}", o, t, r, dtype, n=n, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 1), (19, 123), (2, 3, 4097), (2, 2, 3, 64), (1000,)])
def test_matches_reference(shape, dtype):
    x, w = _inputs(shape, dtype)
    _check_all(f"{list(shape)}", x, w)


@pytest.mark.skipif(not ON_GPU, reason="full LLaMA shape needs a GPU (the interpreter is slow)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_llama_shape(dtype):
    x, w = _inputs((4, 1024, 4096), dtype)  # 4096 tokens x hidden 4096, as in LLaMA 3.1 8B
    _check_all("4096 tokens x 4096", x, w, eps=1e-5)


def test_largest_hidden():
    x, w = _inputs((64 if ON_GPU else 3, MAX_HIDDEN), torch.bfloat16)  # few rows: the interpreter is slow
    _check_all(f"64 x {MAX_HIDDEN}", x, w)


def test_non_contiguous_inputs():
    base, w = _inputs((24, 2 * 96), torch.bfloat16, seed=3)
    _check_all("column slice (copied)", base[:, ::2], w[:96])
    rows, w2 = _inputs((16, 4, 80), torch.float32, seed=4)
    _check_all("every other row (strided view)", rows[::2], w2)
    t, w3 = _inputs((48, 32), torch.float32, seed=5)
    _check_all("transposed", t.t(), w3[:1].expand(48).contiguous())


def test_stride0_upstream_gradient():
    x, w = _inputs((8, 64), torch.float32)
    g = torch.randn(64, device=DEVICE)
    _check_all("stride-0 dy, as (y * g).sum() gives", x, w, dy=g.expand(8, 64))


def test_empty_batch():
    x, w = _inputs((0, 3, 64), torch.bfloat16)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rmsnorm(xs, ws)
    y.sum().backward()
    assert y.shape == (0, 3, 64) and xs.grad.shape == x.shape
    exactly("empty batch: dW is zero", ws.grad, torch.zeros_like(w))


def test_weight_gradient_is_deterministic():
    x, w = _inputs((97, 200), torch.bfloat16, seed=7)
    dy = random_like_grad(x)
    grads = []
    for _ in range(2):
        ws = w.clone().requires_grad_()
        rmsnorm(x, ws).backward(dy)
        grads.append(ws.grad)
    exactly("dW bitwise equal over two runs", grads[0], grads[1])


def test_frozen_weight_and_frozen_input():
    x, w = _inputs((9, 48), torch.bfloat16)
    _check_all("frozen weight", x, w, grad_w=False)
    _check_all("frozen input", x, w, grad_x=False)


def test_matches_hugging_face_module():
    """Same numerics as transformers' LlamaRMSNorm in bf16, and the swap shares the weight.

    On a GPU the kernel rounds like PyTorch (to nearest even), so outputs are bit-identical except
    where the fp32 sums of squares, added in another order, tip x * rstd across a rounding tie:
    about 1 element in 10^4. At most 1% may differ (rounding before or after the weight multiply,
    the bug this guards against, changes about half of them). Triton's *interpreter* truncates
    fp32 -> bf16 instead, so on a CPU only the 2-ulp bound below is checked.
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(256, eps=1e-5).to(device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(256) + 0.5)
    ours = TritonRMSNorm.from_llama_rmsnorm(hf)
    assert ours.weight is hf.weight, "from_llama_rmsnorm must share, not copy, the Parameter"
    assert ours.variance_epsilon == 1e-5
    x, _ = _inputs((64, 7, 256), torch.bfloat16)
    y_hf, y = hf(x), ours(x)
    # One flip of x_hat's rounding (1 ulp), carried by w (< 1.5), then y's own rounding: <= 2 ulps.
    err = (y.double() - y_hf.double()).abs().max().item()
    tol = 2 * 2.0**-7 * y_hf.double().abs().max().item()
    record("same output as LlamaRMSNorm (bf16), max difference", err, tol, err <= tol)
    if ON_GPU:
        differ = (y != y_hf).float().mean().item()
        record("fraction of bf16 outputs not bit-identical to HF", differ, 0.01, differ <= 0.01)


def test_module_constructor():
    m = TritonRMSNorm(32, eps=1e-5).to(DEVICE)
    x, _ = _inputs((3, 32), torch.float32)
    close_to_reference("TritonRMSNorm(32) with unit weight", m(x), rmsnorm_ref(x, m.weight),
                       rmsnorm_ref(x.double(), m.weight.double(), 1e-5), torch.float32)


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(7)), ValueError, id="hidden mismatch"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(2, 4)), ValueError, id="2-D weight"),
        pytest.param(lambda: (torch.randint(0, 5, (4, 8)), torch.randn(8)), TypeError, id="integer input"),
        pytest.param(lambda: (torch.randn(2, MAX_HIDDEN + 1), torch.randn(MAX_HIDDEN + 1)), ValueError,
                     id="hidden too large"),
    ],
)
def test_bad_input_gives_clear_error(make, error):
    x, w = make()
    expect_error(error, rmsnorm, x.to(DEVICE), w.to(DEVICE))


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fused RMSNorm: test report"))
