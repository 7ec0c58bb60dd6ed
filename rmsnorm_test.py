"""Tests of the fused RMSNorm: forward, dx and dW against float64, edge cases, and bad input.

    $ python rmsnorm_test.py        # a readable report: every check, its error and tolerance
    $ pytest rmsnorm_test.py        # the same tests under pytest

Without a GPU the kernels run in Triton's interpreter at small sizes; with one, the same tests also
run the LLaMA 3.1 8B shape (4096 tokens x hidden 4096) compiled. Tolerances follow the rule in
testkit/__init__.py: at most 2x PyTorch's own error against float64, plus one ulp of the output scale.
The options (Gemma's weight offset, the "llama", "gemma" and "none" casting modes, the in-place
backward) are checked the same way, and against transformers' LlamaRMSNorm and GemmaRMSNorm.
Then the kernel as a PyTorch operator (opcheck, torch.compile, no double backward), its patch of
Hugging Face models, and its byte count. The patch's contract shared with the other lessons (the count,
patching twice, the Parameters, the patched logits; the docstring's byte counts) is
tests/lesson_contract_test.py's, which calls check_patched below for what is RMSNorm's own.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import functools
import types

import pytest
import torch

import rmsnorm_kernel
from core.kernel_utils import DEVICE
from rmsnorm_kernel import (CASTING_MODES, MAX_HIDDEN, TritonRMSNorm, ideal_bytes, patch_model, rmsnorm,
                            rmsnorm_bwd_in_place_op, rmsnorm_bwd_op, rmsnorm_fwd_op, rmsnorm_ref)
from testkit import close_to_reference, expect_error, exactly, random_like_grad, record, run_as_script

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ON_GPU = DEVICE.type == "cuda"


def _inputs(shape, dtype, seed=0, device=DEVICE, offset=0.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # Non-zero mean and a spread of magnitudes: a plain randn would hide an eps or mean bug less
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device=device, dtype=dtype)
    # never all ones; (offset + w) in [0.5, 1.5], so with Gemma's offset of 1 the weights sit around 0
    w = (torch.rand(shape[-1], generator=g) + 0.5 - offset).to(device=device, dtype=dtype)
    return x, w


def _check_all(tag, x, w, eps=1e-6, seed=1, dy=None, grad_x=True, grad_w=True, **options):
    """Forward, dx and dW of ours vs float64 reference vs PyTorch in the same dtype.

    `options` (offset, casting_mode) go to both the kernel and the reference. Returns our
    (y, dx, dW), computed out of place."""
    dtype = x.dtype
    if dy is None:
        dy = random_like_grad(x.new_empty(x.shape[:-1] + (w.shape[0],)), seed=seed)

    def run(fn, cast):
        xi = cast(x.detach()).clone().requires_grad_(grad_x)
        wi = cast(w.detach()).clone().requires_grad_(grad_w)
        y = fn(xi, wi, eps)
        y.backward(cast(dy))
        return y, xi.grad, wi.grad

    ref_options = {k: v for k, v in options.items() if k != "in_place"}
    ours = run(functools.partial(rmsnorm, **options), lambda t: t)
    torch_same = run(functools.partial(rmsnorm_ref, **ref_options), lambda t: t)
    ref = run(functools.partial(rmsnorm_ref, **ref_options), lambda t: t.double())

    assert ours[0].shape == x.shape
    assert ours[0].dtype == torch_same[0].dtype, f"output dtype {ours[0].dtype}, PyTorch gives {torch_same[0].dtype}"
    H, rows = x.shape[-1], x.numel() // max(x.shape[-1], 1)
    # dx = rstd * (dy * w - x_hat * mean(dy * w * x_hat)) can cancel to ~0 (always, for H = 1):
    # measure its error against the size of the terms, rstd * |dy * w|, not against the result.
    xd = x.detach().double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1) + eps).max().item() if x.numel() else 0.0
    w_max = (w.double() + options.get("offset", 0.0)).abs().max().item()
    dx_scale = rstd * (dy.double().abs().max().item() if dy.numel() else 0.0) * w_max
    checks = [("y", H, None), ("dx", H, dx_scale), ("dW", rows, None)]
    for (what, n, scale), o, t, r in zip(checks, ours, torch_same, ref):
        if r is None:
            assert o is None, f"{what} should not have been computed"
            continue
        close_to_reference(f"{tag} {what}", o, t, r, dtype, n=n, scale=scale)
    return ours


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


def test_upstream_gradient_of_a_sum():
    """`(y * c).sum()` hands backward one value expanded to the whole shape: every stride 0."""
    x, w = _inputs((6, 40), torch.bfloat16, seed=2)
    c = torch.randn((), device=DEVICE).to(torch.bfloat16)  # random, so a dropped dy would show
    dy = c.expand(6, 40)
    assert dy.stride() == (0, 0)
    _check_all("dy with strides (0, 0), as .sum() gives", x, w, dy=dy)


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


# (casting_mode, offset): LLaMA's and Gemma's norms first, then the other combinations
OPTIONS = [("llama", 0.0), ("gemma", 1.0), ("none", 0.0), ("llama", 1.0), ("gemma", 0.0), ("none", 1.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("casting_mode, offset", OPTIONS)
@pytest.mark.parametrize("shape", [(19, 123), (2, 3, 257)])
def test_casting_modes_and_offset(shape, casting_mode, offset, dtype):
    """Each casting mode, with and without an offset, against PyTorch computing the same formula;
    then the in-place backward, which must give bitwise the out-of-place gradients, in dy's memory."""
    x, w = _inputs(shape, dtype, offset=offset)
    tag = f"{casting_mode}, offset {offset:g}, {list(shape)}"
    y, dx, dw = _check_all(tag, x, w, casting_mode=casting_mode, offset=offset)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = rmsnorm(xi, wi, 1e-6, casting_mode=casting_mode, offset=offset, in_place=True)
    dy = random_like_grad(x, seed=1)  # the dy of _check_all
    dx2, dw2 = torch.autograd.grad(y2, (xi, wi), dy)
    assert dx2.data_ptr() == dy.data_ptr(), "in place: dx must be written over dy"
    exactly(f"{tag} in place: dx", dx2, dx)
    exactly(f"{tag} in place: dW", dw2, dw)


def test_in_place_falls_back_when_dy_cannot_hold_dx():
    """An expanded gradient (rows sharing memory) and an fp32 dy for a bf16 x (fp32 weights in
    "llama" mode) cannot hold dx: the backward then writes a new buffer, with the same results."""
    x, w = _inputs((6, 40), torch.bfloat16, seed=2)
    c = torch.randn((), device=DEVICE).to(torch.bfloat16)
    cases = (("stride-0 dy, as (y * c).sum() gives", w, c.expand(6, 40)),
             ("fp32 weight, bf16 x: dy is fp32", w.float(), random_like_grad(x.float(), seed=3)))
    for tag, weight, dy in cases:
        grads = []
        for in_place in (False, True):
            xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
            y = rmsnorm(xi, wi, in_place=in_place)
            grads.append(torch.autograd.grad(y, (xi, wi), dy.clone() if dy.stride(0) else dy))
        assert grads[1][0].data_ptr() != dy.data_ptr()
        exactly(f"{tag}: dx in place == out of place", grads[1][0], grads[0][0])
        exactly(f"{tag}: dW in place == out of place", grads[1][1], grads[0][1])
    assert c.item() == c.expand(1).item(), "the expanded gradient's one value must be untouched"


def test_in_place_is_not_allowed_when_the_gradient_is_shared():
    """Why `residual + norm(h)` must not run in place: autograd hands the sum's gradient, one tensor,
    to both of its inputs; the norm's backward runs first (it is the newer node) and overwrites it,
    and the residual's branch then receives dx instead of dy. This is what `rmsnorm` documents and
    why patch_model keeps Gemma 2's post-attention and post-feed-forward norms out of place."""
    x, w = _inputs((5, 32), torch.float32, seed=4)
    r0 = torch.randn(5, 32, device=DEVICE)
    grads = []
    for in_place in (False, True):
        r_leaf, xi = r0.clone().requires_grad_(), x.clone().requires_grad_()
        residual = r_leaf * 2  # a non-leaf, as the residual stream of a decoder layer is
        out = residual + rmsnorm(xi, w, in_place=in_place)
        out.backward(random_like_grad(out, seed=5))
        grads.append(r_leaf.grad)
    err = (grads[1] - grads[0]).abs().max().item()
    record(f"in place, residual + norm(h): residual's gradient off by {err:.2f}", 0.0, 0.0, err > 0)


def test_matches_hugging_face_gemma_module():
    """GemmaRMSNorm ((1 + w) * x_hat, all in fp32, rounded once) in bf16: `from_module` with
    offset 1 and "gemma" casting shares the weight and computes the same output and gradients."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    hf = GemmaRMSNorm(256, eps=1e-6).to(device=DEVICE, dtype=torch.bfloat16)
    x, w = _inputs((16, 7, 256), torch.bfloat16, seed=6, offset=1.0)
    with torch.no_grad():
        hf.weight.copy_(w)
    ours = TritonRMSNorm.from_module(hf, offset=1.0, casting_mode="gemma")
    assert ours.weight is hf.weight and ours.variance_epsilon == 1e-6
    exactly("rmsnorm_ref('gemma', offset 1) is GemmaRMSNorm, bit for bit", rmsnorm_ref(x, w, 1e-6, 1.0, "gemma"), hf(x))
    # Both compute in fp32 and round once; the fp32 sums of squares, added in another order, can
    # tip that one rounding by 1 ulp (and the interpreter truncates): at most 1 ulp of the output.
    y_hf, y = hf(x), ours(x)
    err = (y.double() - y_hf.double()).abs().max().item()
    tol = 2.0**-7 * y_hf.double().abs().max().item()
    record("same output as GemmaRMSNorm (bf16), max difference", err, tol, err <= tol)
    dy = random_like_grad(y, seed=7)

    def grads(fn, cast):
        xi, wi = x.to(cast).clone().requires_grad_(), w.to(cast).clone().requires_grad_()
        fn(xi, wi).backward(dy.to(cast))
        return xi.grad, wi.grad

    ours_g = grads(lambda xi, wi: rmsnorm(xi, wi, 1e-6, offset=1.0, casting_mode="gemma"), torch.bfloat16)
    hf_g = grads(lambda xi, wi: torch.func.functional_call(hf, {"weight": wi}, (xi,)), torch.bfloat16)
    ref_g = grads(lambda xi, wi: rmsnorm_ref(xi, wi, 1e-6, 1.0, "gemma"), torch.float64)
    # dx cancels (see _check_all): its error is measured against rstd * |dy| * |1 + w|.
    rstd = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6).max().item()
    dx_scale = rstd * dy.double().abs().max().item() * (1 + w.double()).abs().max().item()
    close_to_reference("Gemma dx vs GemmaRMSNorm's autograd", ours_g[0], hf_g[0], ref_g[0], torch.bfloat16, n=256,
                       scale=dx_scale)
    close_to_reference("Gemma dW vs GemmaRMSNorm's autograd", ours_g[1], hf_g[1], ref_g[1], torch.bfloat16,
                       n=x.numel() // 256)


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


def test_from_module_refuses_a_layer_norm():
    """A LayerNorm subtracts the mean and adds a bias: wrapped as an RMSNorm it would compute
    something else, so it is refused by name."""
    msg = expect_error(TypeError, TritonRMSNorm.from_module, torch.nn.LayerNorm(64))
    assert "LayerNorm is not an RMSNorm" in msg, msg
    assert "no weight" in expect_error(TypeError, TritonRMSNorm.from_module, torch.nn.RMSNorm(64, eps=1e-6,
                                                                                              elementwise_affine=False))


def test_meta_tensors_give_shapes():
    """Tensors on the meta device (a model sized without memory) have no data to launch on: the
    operators' fake functions give the outputs' and the gradients' shapes."""
    x = torch.randn(3, 5, 64, device="meta", requires_grad=True)
    w = torch.ones(64, device="meta", requires_grad=True)
    y = rmsnorm(x, w)
    y.sum().backward()
    assert (y.device.type, y.shape, x.grad.shape, w.grad.shape) == ("meta", x.shape, x.shape, w.shape)


def test_second_order_gradients_raise():
    x, w = _inputs((5, 24), torch.float32)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(rmsnorm(x, w), x, random_like_grad(x), create_graph=True)
    msg = expect_error(RuntimeError, lambda: dx.sum().backward())
    assert "second-order" in msg


@pytest.mark.parametrize("in_place", [False, True], ids=["out of place", "in place"])
def test_eager_calls_skip_the_operators_with_the_same_results(monkeypatch, in_place):
    """An eager call runs the launchers through a plain autograd.Function, because dispatching a
    custom operator costs host time on every call; the operators serve tracing. Both paths give
    the same bits, and the in-place backward bumps dy's version counter as the operator does."""
    x, w = _inputs((37, 200), torch.bfloat16, seed=11)
    dy = random_like_grad(x, seed=12)
    calls = []
    real_op = rmsnorm_kernel.rmsnorm_fwd_op
    monkeypatch.setattr(rmsnorm_kernel, "rmsnorm_fwd_op", lambda *args: calls.append(args) or real_op(*args))

    def run(fn):
        xi, wi, g = x.clone().requires_grad_(), w.clone().requires_grad_(), dy.clone()
        y = fn(xi, wi)
        version = g._version
        dx, dw = torch.autograd.grad(y, (xi, wi), g)
        assert (g._version > version) == (in_place and dx.data_ptr() == g.data_ptr())
        return y, dx, dw

    eager = run(lambda xi, wi: rmsnorm(xi, wi, 1e-6, in_place=in_place))
    assert not calls, "an eager call must not dispatch the custom operator"
    via_op = run(lambda xi, wi: real_op(xi, wi, 1e-6, 0.0, "llama", in_place)[0])
    for what, e, o in zip(("y", "dx", "dW"), eager, via_op):
        exactly(f"eager path == operator path ({'in place' if in_place else 'out of place'}): {what}", e, o)


def test_eager_call_adds_one_autograd_node_and_returns_no_view():
    """An eager call of a [batch, seq, H] input records one autograd node, the norm's own, straight
    onto x and the weight: no reshape or view nodes around it, which the backward would run for
    nothing on every call. Its output is a tensor of its own, not a view, so it may be modified in
    place (autograd refuses that for a view returned by a custom Function), with exact gradients."""
    x, w = _inputs((2, 9, 64), torch.float32, seed=21)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rmsnorm(xi, wi, 1e-6)
    assert y.shape == x.shape and not y._is_view()
    node = y.grad_fn
    assert type(node).__name__ == "RMSNormFunctionBackward", type(node).__name__
    parents = [type(f).__name__ for f, _ in node.next_functions if f is not None]
    assert parents == ["AccumulateGrad", "AccumulateGrad"], parents
    y.mul_(3.0)  # in place on the output
    dy = random_like_grad(y, seed=22)
    y.backward(dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    rmsnorm(xr, wr, 1e-6).backward(3.0 * dy)  # the same through an out-of-place multiply
    exactly("y *= 3 in place, then backward: dx", xi.grad, xr.grad)
    exactly("y *= 3 in place, then backward: dW", wi.grad, wr.grad)
    record("eager call: one autograd node on [2, 9, 64], output not a view, in-place use exact", 0.0, 0.0, True)


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake (meta) implementation, autograd registration, and the
    operators traced by AOTAutograd with dynamic shapes (gradients included for the forward)."""
    x, w = _inputs((7, 37), torch.bfloat16, seed=8)
    torch.library.opcheck(rmsnorm_fwd_op, (x.clone().requires_grad_(), w.clone().requires_grad_(), 1e-6))
    torch.library.opcheck(rmsnorm_fwd_op, (x[:0].float(), w.float(), 1e-5))  # empty batch
    y, rstd = rmsnorm_fwd_op(x, w, 1e-6)
    dy = random_like_grad(y)
    for need_dw in (True, False):
        torch.library.opcheck(rmsnorm_bwd_op, (dy, x, w, rstd, need_dw))
    # Gemma's options, and the in-place backward (its schema declares that it writes into dy)
    torch.library.opcheck(rmsnorm_fwd_op, (x.clone().requires_grad_(), w.clone().requires_grad_(), 1e-6, 1.0,
                                           "gemma", True))
    y, rstd = rmsnorm_fwd_op(x, w, 1e-6, 1.0, "gemma")
    torch.library.opcheck(rmsnorm_bwd_op, (dy, x, w, rstd, True, 1.0, "gemma"))
    for need_dw in (True, False):
        torch.library.opcheck(rmsnorm_bwd_in_place_op, (dy.clone(), x, w, rstd, need_dw, 1.0, "gemma"))
    record("opcheck: rmsnorm_fwd (x3), rmsnorm_bwd (x3), rmsnorm_bwd_in_place (x2)", 0.0, 0.0, True)


@pytest.mark.parametrize("options", [{}, {"offset": 1.0, "casting_mode": "gemma", "in_place": True}],
                         ids=["defaults", "gemma in place"])
def test_torch_compile_matches_eager(options):
    """fullgraph=True: the functional API compiles to one graph around the opaque operators, so
    forward and both gradients are the same kernels' results, bit for bit (in place too: the
    compiler sees the in-place operator's declared write into dy)."""
    torch._dynamo.reset()
    fn = functools.partial(rmsnorm, **options)
    compiled = torch.compile(fn, fullgraph=True)
    x, w = _inputs((3, 5, 48), torch.bfloat16, seed=9)
    dy = random_like_grad(x, seed=10)
    results = []
    for f in (fn, compiled):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(xi, wi, 1e-5)
        y.backward(dy.clone())  # a copy each: in place, the backward overwrites it
        results.append((y, xi.grad, wi.grad))
    for what, eager, comp in zip(("y", "dx", "dW"), *results):
        exactly(f"torch.compile == eager: {what}", comp, eager)


def _tiny_model(kind: str, layers: int = 2):
    import transformers
    from transformers import AutoModelForCausalLM

    from core.model_families import FAMILIES

    config_class = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "gemma": "GemmaConfig",
                    "gemma2": "Gemma2Config", "phi3": "Phi3Config"}[kind]
    config = getattr(transformers, config_class)(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(DEVICE)
    offset = FAMILIES[kind].norm_offset
    for m in model.modules():  # HF initialises (offset + weight) to ones; make it random
        if type(m).__name__.endswith("RMSNorm"):
            torch.nn.init.uniform_(m.weight, 0.5 - offset, 1.5 - offset)
    return model


# RMSNorms per layer: input and post-attention; Qwen3 adds q/k norms, Gemma 2 pre/post feed-forward
NORMS_PER_LAYER = {"llama": 2, "qwen3": 4, "gemma": 2, "gemma2": 4, "phi3": 2}
# tests/lesson_contract_test.py patches a tiny model of each of these families: the count expected_patches says,
# patching twice a no-op, the same Parameters, the logits of the unpatched model; then calls check_patched.
CONTRACT_FAMILIES = tuple(NORMS_PER_LAYER)


def check_patched(kind: str, model, count: int):
    """RMSNorm's own part of the contract: every RMSNorm (Qwen3: the q/k norms too) became a TritonRMSNorm
    (sharing its weight: the contract checks the Parameters), with the family's offset and casting, out of place;
    the count is the architecture's hand count."""
    from core.model_families import FAMILIES

    assert count == NORMS_PER_LAYER[kind] * model.config.num_hidden_layers + 1, (kind, count)
    norms = [m for m in model.modules() if isinstance(m, TritonRMSNorm)]
    assert len(norms) == count and not any(type(m).__name__.endswith("RMSNorm") and not isinstance(m, TritonRMSNorm)
                                           for m in model.modules()), f"{kind}: an RMSNorm left unpatched"
    fam = FAMILIES[kind]
    assert all((n.offset, n.casting_mode, n.in_place) == (fam.norm_offset, fam.norm_casting, False) for n in norms)
    record(f"{kind}: {count} TritonRMSNorms, offset {fam.norm_offset}, casting {fam.norm_casting}", 0.0, 0.0, True)


def test_patch_model_in_place_spares_the_residual_norms():
    """patch_model(in_place=True) runs every norm in place except Gemma 2's post-attention and
    post-feed-forward norms, whose output is added to the residual stream."""
    model = _tiny_model("gemma2")
    patch_model(model, in_place=True)
    in_place = {name.rsplit(".", 1)[-1]: m.in_place for name, m in model.named_modules()
                if isinstance(m, TritonRMSNorm)}
    assert in_place == {"input_layernorm": True, "post_attention_layernorm": False, "pre_feedforward_layernorm": True,
                        "post_feedforward_layernorm": False, "norm": True}, in_place
    record("gemma2, in_place=True: 2 of 4 norms per layer and the final one run in place", 0.0, 0.0, True)


def test_patch_model_refuses_an_unknown_family():
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2"))
    assert "gpt2" in expect_error(NotImplementedError, patch_model, model)


def test_ideal_bytes_is_the_hand_count():
    """LLaMA 3.1 8B, 16384 tokens x 4096 hidden, bf16: the hand count behind the module docstring's figures (that
    the docstring states what ideal_bytes gives is tests/lesson_contract_test.py's)."""
    n, h, e = 16384, 4096, 2
    forward = ideal_bytes(n, h, torch.bfloat16)
    both = ideal_bytes(n, h, torch.bfloat16, backward=True)
    assert forward == (2 * e) * n * h + h * e  # x read, y written; the weight read once
    assert both == forward + (3 * e) * n * h + 2 * h * e  # dy and x read, dx written; w read, dW written
    assert ideal_bytes(n, h, torch.float32) == 2 * forward  # every byte count doubles in fp32
    record(f"ideal bytes at 16384 x 4096 bf16: fwd {forward / 1e6:.1f} MB, fwd+bwd {both / 1e6:.1f} MB",
           0.0, 0.0, True)


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(7)), ValueError, id="hidden mismatch"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(2, 4)), ValueError, id="2-D weight"),
        pytest.param(lambda: (torch.randint(0, 5, (4, 8)), torch.randn(8)), TypeError, id="integer input"),
        pytest.param(lambda: (torch.randn(2, MAX_HIDDEN + 1), torch.randn(MAX_HIDDEN + 1)), ValueError,
                     id="hidden too large"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(8), {"casting_mode": "fp32"}), ValueError,
                     id="unknown casting mode"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(8), {"offset": float("nan")}), ValueError,
                     id="offset not finite"),
    ],
)
def test_bad_input_gives_clear_error(make, error):
    x, w, *options = make()
    expect_error(error, functools.partial(rmsnorm, **(options[0] if options else {})), x.to(DEVICE), w.to(DEVICE))


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fused RMSNorm: test report"))
