"""Tests of the FP8 producers and the hand-off (fp8_producers_kernel.py): q/k/v and gate/up quantize their
shared input once, with the bits of quantizing it for each; the SwiGLU backward that takes the maxima of
d gate_up and the RMSNorm and SwiGLU forwards that write their output's FP8 row copy give the bits of the
pairs they replace; the model's hand-off and the producers linked to its FP8 layers change no bit.
Tolerances: none, everything is compared bit for bit (fp8_linear_test.py's module docstring).

    $ python fp8_producers_test.py     # a readable report
    $ pytest fp8_producers_test.py
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import copy

import pytest
import torch
from torch import nn

from core.kernel_utils import DEVICE
from testkit import exactly, random_like_grad, record, run_as_script
import fp8_linear_kernel
from fp8_linear_kernel import FP8_DTYPE, Float8Linear, Float8LinearFunction, fp8_linear, ideal_bytes, quantize_rows
import fp8_producers_kernel
import fp8_recipes_kernel
import mx_quant_kernel
from fp8_producers_kernel import Fp8Handoff, patch_model
from fp8_linear_test import bits, loss_and_grads, spread, tiny_llama

def _count_quantizations(monkeypatch, activation=lambda x: x.shape[0] == 40):
    """Count the row and column quantizations of activations (`activation(x)`: by default the 40 token
    rows of `_qkv_inputs`; its weights have 32 or 64). The launchers are counted, which the operators
    and the eager path both call, and which see 2-D views rather than the Parameters."""
    calls = {"rows": 0, "cols": 0}
    rows, cols = fp8_linear_kernel.quantize_rows, fp8_linear_kernel.quantize_cols

    def count_rows(x, *a, **k):
        calls["rows"] += bool(activation(x))
        return rows(x, *a, **k)

    def count_cols(x, *a, **k):
        calls["cols"] += bool(activation(x))
        return cols(x, *a, **k)

    monkeypatch.setattr(fp8_linear_kernel, "quantize_rows", count_rows)
    monkeypatch.setattr(fp8_linear_kernel, "quantize_cols", count_cols)
    return calls


def _qkv(x, weights, dys, handoff=None, ops=False):
    """Three layers reading one input, as q, k and v do, sharing `handoff`; returns (outputs, dx, dWs).
    `ops`: the layer launches through the custom operators, as under torch.compile."""
    xi = x.detach().clone().requires_grad_()
    h = xi * 1  # a non-leaf, like the RMSNorm output that q/k/v share
    ws = [nn.Parameter(w.clone()) for w in weights]
    if ops:  # what fp8_linear runs for a 2-D bf16 input, with the operators
        ys = [Float8LinearFunction.apply(h, w, False, True, True, handoff, True, False) for w in ws]
    else:
        ys = [fp8_linear(h, w, keep_fp8_input=False, handoff=handoff) for w in ws]
    torch.autograd.backward(ys, dys)
    return [y.detach() for y in ys], xi.grad, [w.grad for w in ws]


def _qkv_inputs():
    x = spread((40, 64), torch.bfloat16, seed=30)
    weights = [spread((n, 64), torch.bfloat16, seed=31 + n) for n in (64, 32, 32)]
    dys = [random_like_grad(x.new_empty(40, n), seed=40 + n) for n in (64, 32, 32)]
    return x, weights, dys


def test_shared_input_is_quantized_once(monkeypatch):
    """q/k/v-like layers on one tensor, sharing a hand-off: its row quantization (forward) and its
    column quantization (backward) run once, not three times, with the bits of quantizing it for each
    layer (no hand-off)."""
    x, weights, dys = _qkv_inputs()
    separate = _qkv(x, weights, dys, handoff=None)
    calls = _count_quantizations(monkeypatch)
    shared = _qkv(x, weights, dys, handoff=Fp8Handoff())
    # x once each way, and each layer's dy per row and per column
    exactly("activation row quantizations: x once + 3 dy", torch.tensor(calls["rows"]), torch.tensor(1 + 3))
    exactly("activation column quantizations: x once + 3 dy", torch.tensor(calls["cols"]), torch.tensor(1 + 3))
    for i in range(3):
        exactly(f"layer {i}: output bits", separate[0][i], shared[0][i])
        exactly(f"layer {i}: weight gradient bits", separate[2][i], shared[2][i])
    exactly("input gradient bits", separate[1], shared[1])


def test_eager_layers_launch_their_kernels_without_the_operators(monkeypatch):
    """In eager mode the FP8 layer calls the launchers directly (a custom-operator call costs the host
    ~15 us), with the bits it gets through the operators (`ops=True`, what torch.compile traces; the
    compile tests below run the graph itself)."""
    x, weights, dys = _qkv_inputs()
    calls = {"ops": 0}
    for name in ("fp8_rows_op", "fp8_cols_op", "fp8_both_op", "fp8_scaled_mm_op"):
        def counting(*a, _op=getattr(fp8_linear_kernel, name), **k):
            calls["ops"] += 1
            return _op(*a, **k)

        monkeypatch.setattr(fp8_linear_kernel, name, counting)
    direct = _qkv(x, weights, dys, Fp8Handoff())
    assert calls["ops"] == 0, calls
    through_ops = _qkv(x, weights, dys, Fp8Handoff(), ops=True)
    assert calls["ops"] > 0, calls
    for i in range(3):
        exactly(f"layer {i}: output, direct launch vs operators", direct[0][i], through_ops[0][i])
        exactly(f"layer {i}: weight gradient, direct launch vs operators", direct[2][i], through_ops[2][i])
    exactly("input gradient, direct launch vs operators", direct[1], through_ops[1])


def test_an_input_changed_in_place_is_quantized_again(monkeypatch):
    """Evaluation (no autograd, which would refuse the in-place write): the third layer reads the
    tensor after an in-place change and must not reuse the first layer's FP8 copy."""
    x, weights, _ = _qkv_inputs()
    weights = [nn.Parameter(w, requires_grad=False) for w in weights]  # counted apart from activations
    calls = _count_quantizations(monkeypatch)
    handoff = Fp8Handoff()
    with torch.no_grad():
        h = x.clone()
        ys = [fp8_linear(h, w, keep_fp8_input=False, handoff=handoff) for w in weights[:2]]
        h.mul_(0.5)
        ys.append(fp8_linear(h, weights[2], keep_fp8_input=False, handoff=handoff))
        fresh = fp8_linear(x.clone() * 0.5, weights[2], keep_fp8_input=False)
    # the shared tensor before and after the change, and the reference's own input
    exactly("row quantizations: before and after the change", torch.tensor(calls["rows"]), torch.tensor(2 + 1))
    exactly("the changed input's output", ys[2], fresh)


def test_shared_quantization_holds_nothing_across_passes():
    """A forward empties backward's slots (the shared column copy, an offered gradient's maxima) and a
    backward the forward's, so no value (nor the tensor it came from) outlives the pass that made it."""
    x = spread((40, 64), torch.bfloat16, seed=32).requires_grad_()
    w = nn.Parameter(spread((32, 64), torch.bfloat16, seed=33))
    handoff = Fp8Handoff()
    y = fp8_linear(x * 1, w, keep_fp8_input=False, handoff=handoff)
    assert handoff.shared_rows.tensor is not None
    y.sum().backward()
    assert handoff.shared_rows.tensor is None and handoff.shared_cols.tensor is not None
    handoff.offer_grad(y.detach(), (y.new_zeros(40), y.new_zeros(32)))
    fp8_linear(x * 1, w, keep_fp8_input=False, handoff=handoff)
    assert handoff.shared_cols.tensor is None and handoff.grad_maxima.tensor is None
    record("hand-off slots emptied by the other pass", 0.0, 0.0, True)



def _set_handoff(model, handoff):
    """Give every FP8 layer of the model `handoff` (None: each layer quantizes what it reads itself)."""
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.fp8_handoff = handoff


def test_patch_model_gives_the_model_one_handoff():
    """Every layer `patch_model` converts shares the model's hand-off, and so do the layers of a copy of
    the model, with a hand-off of their own that starts empty."""
    model = tiny_llama(layers=2)
    patch_model(model)
    handoff = model.fp8_handoff
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 14 and all(m.fp8_handoff is handoff for m in layers)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    model(ids).logits.sum().backward()
    assert not handoff.is_empty()  # o_proj's input, quantized per column in backward
    copied = copy.deepcopy(model)
    others = {id(m.fp8_handoff) for m in copied.modules() if isinstance(m, Float8Linear)}
    assert others == {id(copied.fp8_handoff)} and copied.fp8_handoff is not handoff and copied.fp8_handoff.is_empty()
    assert patch_model(model) == 14 and model.fp8_handoff is handoff
    record("patch_model: one hand-off per model, shared by its 14 FP8 layers; a copy gets its own", 0.0, 0.0, True)


def test_tiny_llama_shared_quantization_changes_no_bit(monkeypatch):
    """The whole model (q/k/v and gate/up share their inputs) with and without the hand-off of the FP8
    copies: the same loss and the same gradient bits, with fewer activation quantizations."""
    base = tiny_llama(layers=2)
    patch_model(base)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    runs = []
    for share in (False, True):
        model = copy.deepcopy(base)
        if not share:
            _set_handoff(model, None)
        weights = {p.data_ptr() for p in model.parameters()}
        with monkeypatch.context() as m:
            calls = _count_quantizations(m, lambda x: x.data_ptr() not in weights)
            runs.append((*loss_and_grads(model, ids), dict(calls)))
    (l0, g0, c0), (l1, g1, c1) = runs
    exactly("loss, shared vs separate quantization", l1, l0)
    for name in g0:
        exactly(f"{name}.grad", g1[name], g0[name])
    # per layer, forward: q/k/v read one tensor (3 -> 1), gate/up one (2 -> 1); backward the same
    saved = 2 * (2 + 1)
    exactly("activation quantizations saved per way (rows, cols)", torch.tensor([c0["rows"] - c1["rows"], c0["cols"] - c1["cols"]]),
            torch.tensor([saved, saved]))



# ------------------------------------------------------------------------------ the SwiGLU backward with maxima
def _same_bits(name, ours, expected):
    """`exactly`, also for float8 tensors (compared as their bytes)."""
    if ours.dtype == FP8_DTYPE:
        ours, expected = bits(ours), bits(expected)
    exactly(name, ours, expected)


def _both_copies(x):
    """What the FP8 layer makes of x without the maxima: rows (and column maxima), then columns."""
    q, scale, col_max = fp8_linear_kernel.quantize_rows(x, True, True)
    return (q, scale, *fp8_linear_kernel.quantize_cols(x, col_max))


def _gate_up(rows, width, seed):
    """gate_up [rows, 2 width] bf16 with a row stride of 4 width (a view), gate values over +-9 (both
    tails of sigmoid), and one NaN."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.cat([torch.randn(rows, 2 * width, generator=g) * 3, torch.randn(rows, 2 * width, generator=g)], dim=1)
    gate_up = wide.to(DEVICE, torch.bfloat16)[:, : 2 * width]
    gate_up[rows // 2, 3] = float("nan")
    return gate_up


SWIGLU_SHAPES = [(7, 96), (33, 200), (1, 16), (19, 1100)] + ([(300, 14336)] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows, width", SWIGLU_SHAPES)
def test_swiglu_maxima_kernel_gives_the_same_fp8_copies(rows, width, activation):
    """The SwiGLU backward with maxima writes what the SwiGLU backward writes, bit for bit, and the FP8
    copies made in one read from its maxima (`quantize_both`) equal those of the two separate
    quantizing passes: both layouts and all four scales. A NaN stays in its own element. (LLaMA 3.1
    8B's width, 14336, on a GPU.)"""
    import swiglu_kernel

    gate, up = swiglu_kernel.halves(_gate_up(rows, width, seed=rows))
    dh = random_like_grad(gate.new_empty(gate.shape), seed=3)
    tag = f"fp8 SwiGLU backward {activation} [{rows}, {width}]"
    dgu, row_max, col_max = fp8_producers_kernel.swiglu_joined_backward_maxima(dh, gate, up, activation)
    plain = swiglu_kernel.swiglu_backward(dh, gate, up, activation, packed=True)
    _same_bits(f"{tag}: d gate_up", dgu, plain)
    ours = fp8_linear_kernel.quantize_both(dgu, row_max, col_max)
    for what, o, e in zip(("q", "row scales", "qT", "column scales"), ours, _both_copies(plain)):
        _same_bits(f"{tag}: {what}", o, e)


def test_fp8_mlp_hands_its_maxima_to_the_fp8_projections():
    """A tiny LLaMA with joined projections and FP8 layers: with the model's hand-off each gate/up
    projection takes d gate_up's maxima from the SwiGLU backward (counted), and the loss and every
    gradient equal those of the model without a hand-off (separate quantizing passes) bit for bit."""
    from playbook.model import registry
    from testkit import batch, loss_and_grads, tiny_model

    model = tiny_model("llama").to(torch.bfloat16)
    registry.apply_kernels(model, ("rmsnorm", "swiglu", "rope", "projections"))
    patch_model(model)
    fp8_producers_kernel.link_mlps(model)  # the SwiGLU backward that hands over d gate_up's maxima
    handoff = model.fp8_handoff
    ids, labels = batch()
    results = {}
    for on in (False, True):
        _set_handoff(model, handoff if on else None)
        taken = handoff.grad_maxima.taken
        results[on] = loss_and_grads(model, ids, labels)
        count = handoff.grad_maxima.taken - taken
        assert count == (model.config.num_hidden_layers if on else 0), (on, count)
    (loss, grads), (loss_fused, grads_fused) = results[False], results[True]
    exactly("fp8 MLP: loss, hand-off against separate passes", loss_fused, loss)
    for name, g in grads.items():
        exactly(f"fp8 MLP: {name}.grad", grads_fused[name], g)
    assert handoff.grad_maxima.tensor is None


def test_hand_off_goes_only_to_the_same_unchanged_tensor():
    """An offered gradient's maxima go to the layer that receives that very tensor, once, and to nobody
    after that tensor changed in place."""
    handoff = Fp8Handoff()
    dy = torch.randn(8, 32, device=DEVICE, dtype=torch.bfloat16)
    maxima = (dy.float().abs().amax(dim=1), dy.float().abs().amax(dim=0))
    handoff.offer_grad(dy, maxima)
    assert handoff.grad_maxima.take(dy.clone()) is None  # equal values, another tensor
    assert handoff.grad_maxima.take(dy) is maxima
    assert handoff.grad_maxima.take(dy) is None  # taken once
    handoff.offer_grad(dy, maxima)
    dy.mul_(2)
    assert handoff.grad_maxima.take(dy) is None  # changed in place after the offer
    record("FP8 hand-off: only to the same, unchanged tensor, once", 0.0, 0.0, True)


# How many bf16 roundings each casting mode makes on the way to y (rmsnorm_kernel's docstring): one (gemma: the
# whole product in fp32), two (llama: the normalised value, then its product with the weight), three (none: the
# inverse RMS too). An rstd within 2^-9 relative of the plain norm's flips at most the first rounding by one ulp;
# each later rounding of a value already one ulp apart may add one more. Measured on an H100 at 8192 x 4096: 2
# ulp in llama mode.
ROUNDINGS = {"gemma": 1, "llama": 2, "none": 3}


def _near_plain_norm(tag, x, w, offset, casting, y, rstd):
    """A producer's y and rstd against rmsnorm_kernel.rmsnorm_forward's: bit for bit in the interpreter; on
    a GPU within the bounds `test_rmsnorm_producer_gives_the_pair_bits` derives (another order of adding
    a row's squares)."""
    import rmsnorm_kernel

    hidden = x.shape[1]
    y_pair, rstd_pair = rmsnorm_kernel.rmsnorm_forward(x, w, 1e-6, offset, casting)
    if DEVICE.type == "cpu":  # the interpreter: one order of addition for any block layout
        _same_bits(f"{tag}: output", y, y_pair)
        _same_bits(f"{tag}: rstd", rstd, rstd_pair)
        return
    ok = rstd_pair.isfinite()
    assert torch.equal(ok, rstd.isfinite()), tag
    zero = rstd_pair == 0  # a row holding an infinity: its mean square is infinite, its rstd exactly 0 in both
    assert torch.equal(zero, rstd == 0), tag
    ok &= ~zero
    rel = ((rstd - rstd_pair).abs() / rstd_pair.abs())[ok].max().item()
    assert rel <= (hidden - 1) * 2.0**-24, f"{tag}: rstd {rel:.3e} relative"
    yf, pf = y.float(), y_pair.float()
    assert torch.equal(yf.isnan(), pf.isnan()), tag
    both = ~yf.isnan()
    ulp = torch.ldexp(torch.ones_like(yf), torch.frexp(torch.maximum(yf.abs(), pf.abs()))[1] - 8)
    worst = ((yf - pf).abs() / ulp)[both].max().item()
    assert worst <= ROUNDINGS[casting], f"{tag}: output {worst} bf16 ulp from the plain norm's"
    record(f"{tag}: rstd within {rel:.1e} relative, output within {worst:.0f} bf16 ulp of the plain norm", rel,
           (hidden - 1) * 2.0**-24, True)


NORM_SHAPES = [(37, 96, "llama", 0.0), (5, 4096, "llama", 0.0), (19, 200, "gemma", 1.0), (9, 64, "none", 0.0)] + (
    [(8192, 4096, "llama", 0.0)] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("rows, hidden, casting, offset", NORM_SHAPES)
def test_rmsnorm_producer_gives_the_pair_bits(rows, hidden, casting, offset):
    """RMSNorm that writes its output's FP8 row copy (one kernel) against the pair it replaces, the norm
    (rmsnorm_kernel.rmsnorm_forward) and then the row quantizer reading that output.

    Exact everywhere: the FP8 rows, their scales and the column maxima are bit for bit what the row
    quantizer makes of the output this kernel wrote (what the FP8 layer would have made of it), with
    and without column maxima. The output and the inverse RMS equal the plain norm's bit for bit in
    Triton's interpreter. On a GPU the two kernels may add a row's squares in another order (the
    compiler lays the block out for this kernel's other reductions too; measured on an H100): the
    inverse RMS then stays within (H - 1) x 2^-24 of the plain norm's, relative (the worst case of
    reordering an fp32 sum of H non-negative terms), and each output within one bf16 ulp per rounding of its
    casting mode (that relative change is below half an ulp, 2^-9: ROUNDINGS). Inputs of mixed magnitudes, one
    row of zeros (its scale is the floor's) and one NaN (it poisons its own row, as in the pair).
    (LLaMA 3.1 8B's 8192 x 4096 on a GPU.)"""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * torch.logspace(-2, 2, rows)[:, None]).to(DEVICE, torch.bfloat16)
    x[rows // 2] = 0
    x[-1, 1] = float("nan")
    w = (1.0 - offset + 0.3 * torch.randn(hidden, generator=g)).to(DEVICE, torch.bfloat16)
    tag = f"RMSNorm + FP8 rows [{rows}, {hidden}] {casting}"
    y, rstd, *copies = fp8_producers_kernel.rmsnorm_quantize_rows(x, w, 1e-6, offset, casting)
    for what, o, e in zip(("q", "row scales", "column maxima"), copies, quantize_rows(y, True, True)):
        _same_bits(f"{tag}: {what} of its own output", o, e)
    rows_only = fp8_producers_kernel.rmsnorm_quantize_rows(x, w, 1e-6, offset, casting, col_max=False)
    assert rows_only[4] is None
    _same_bits(f"{tag}: q without column maxima", rows_only[2], copies[0])
    _near_plain_norm(tag, x, w, offset, casting, y, rstd)


def test_rmsnorm_producer_bytes():
    """The bytes the producer saves, counted: the pair reads x and writes y (the norm), then reads y and
    writes q (the quantizer): 7 bytes per bf16 element; the producer 5, without the read of y."""
    import rmsnorm_kernel

    m, h = 8192, 4096
    pair = rmsnorm_kernel.ideal_bytes(m, h, torch.bfloat16) + ideal_bytes(m, h, torch.bfloat16, "rows")
    fused = fp8_producers_kernel.rmsnorm_rows_ideal_bytes(m, h, torch.bfloat16)
    assert pair - fused == 2 * m * h, (pair, fused)
    record(f"RMSNorm + FP8 rows at 8192 x 4096: {fused:,} B against the pair's {pair:,} B", 0.0, 0.0, True)


# (rows, hidden, casting mode, weight offset): hidden sizes not a multiple of 32 (the last block zero-padded),
# below one block (20, 8: a block of 32 holds the whole row), several row blocks per program
MX_NORM_SHAPES = [(37, 781, "llama", 0.0), (6, 4096, "llama", 0.0), (19, 200, "gemma", 1.0), (9, 20, "none", 0.0),
                  (3, 8, "llama", 0.0)] + ([(8192, 4096, "llama", 0.0)] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("rows, hidden, casting, offset", MX_NORM_SHAPES)
def test_rmsnorm_mxfp8_producer_gives_the_pair_bits(rows, hidden, casting, offset):
    """RMSNorm that writes its output's MXFP8 copy along H (one kernel) against the pair it replaces, the
    norm and then mx_quant_kernel.quantize_mxfp8 reading its output: the e4m3 values and the e8m0 scales,
    natural and swizzled, bit for bit those of its own output, and those of the plain-PyTorch reference
    `quantize_mxfp8_ref`; y and rstd as the row-wise producer's (`_near_plain_norm`). Rows of mixed
    magnitudes, blocks that exercise mx_quant's rules: a row of zeros (every block 2^-127, values 0), 32
    weights of bf16 subnormals (a subnormal block in every row, kept by its small scale), 32 zero weights
    (a zero block in every row), an infinity and a NaN in x (their rows normalize to NaN: NaN scales and
    values, the other rows untouched)."""
    g = torch.Generator().manual_seed(rows + 7)
    x = (torch.randn(rows, hidden, generator=g) * torch.logspace(-2, 2, rows)[:, None]).to(DEVICE, torch.bfloat16)
    x[rows // 2] = 0
    x[-1, 1] = float("nan")
    if rows > 3:
        x[1, -1] = float("inf")
    w = (1.0 - offset + 0.3 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    special = hidden >= 128 and offset == 0  # (1 + a subnormal rounds to 1 in bf16: no such weights with an offset)
    if special:
        w[32:64] = (torch.rand(32, generator=g) * 2.0**-128).to(torch.bfloat16)  # subnormal products
        w[64:96] = 0  # a block of zeros in every row
    w = w.to(DEVICE)
    tag = f"RMSNorm + MXFP8 [{rows}, {hidden}] {casting}"
    y, rstd, q, s = fp8_producers_kernel.rmsnorm_quantize_mxfp8(x, w, 1e-6, offset, casting)
    q_pair, s_pair, _, _ = mx_quant_kernel.quantize_mxfp8(y)
    _same_bits(f"{tag}: q of its own output", q, q_pair)
    _same_bits(f"{tag}: e8m0 scales of its own output", s.view(torch.uint8), s_pair.view(torch.uint8))
    q_ref, s_ref = mx_quant_kernel.quantize_mxfp8_ref(y)
    _same_bits(f"{tag}: q, the reference's", q, q_ref)
    _same_bits(f"{tag}: scales, the reference's", s.view(torch.uint8), s_ref.view(torch.uint8))
    if special:  # the zero block: 2^-127 (byte 0); the subnormal block: a scale below 2^-100, its values kept
        finite = x.float().isfinite().all(dim=1) & (x.float().abs().amax(dim=1) > 0)
        assert torch.all(s.view(torch.uint8)[finite, 2] == 0) and torch.all(s.view(torch.uint8)[finite, 1] < 27), tag
        assert torch.all(q[finite, 32:64].float().abs().amax(dim=1) > 0), tag
    assert torch.all(s.view(torch.uint8)[-1] == mx_quant_kernel.E8M0_NAN), tag  # the NaN row
    swizzled = fp8_producers_kernel.rmsnorm_quantize_mxfp8(x, w, 1e-6, offset, casting, swizzle=True)[3]
    _same_bits(f"{tag}: swizzled scales", swizzled.view(torch.uint8),
               fp8_recipes_kernel.mx_swizzled_scales(s).view(torch.uint8))
    _near_plain_norm(tag, x, w, offset, casting, y, rstd)


def test_rmsnorm_mxfp8_producer_bytes():
    """The pair reads x and writes y (the norm), then reads y and writes q and a scale byte per 32 values;
    the producer skips the read of y: 2 bytes per bf16 element fewer (5.03 against 7.03)."""
    import rmsnorm_kernel

    m, h = 8192, 4096
    pair = rmsnorm_kernel.ideal_bytes(m, h, torch.bfloat16) + mx_quant_kernel.ideal_bytes(m, h, torch.bfloat16,
                                                                                         copies=1)
    fused = fp8_producers_kernel.rmsnorm_mxfp8_ideal_bytes(m, h, torch.bfloat16)
    assert pair - fused == 2 * m * h, (pair, fused)
    record(f"RMSNorm + MXFP8 at 8192 x 4096: {fused:,} B against the pair's {pair:,} B", 0.0, 0.0, True)


def test_fp8_producers_change_no_bit_and_skip_the_row_pass(monkeypatch):
    """A tiny LLaMA with the default kernels and FP8 layers, with and without the FP8 producers: the
    norms linked to the projections that read them (`link_norms`: input_layernorm -> q/k/v,
    post_attention_layernorm -> gate/up) and the SwiGLU writing h's row copy for down_proj. The loss and
    every gradient equal bit for bit, each producer's row copy is taken (counted: 3 per decoder layer),
    and the FP8 layers run 3 row quantizations of activations per layer fewer."""
    from playbook.model import registry
    from testkit import batch, loss_and_grads, tiny_model

    ids, labels = batch()
    results = {}
    for on in (False, True):
        model = tiny_model("llama").to(torch.bfloat16)  # the same weights each time (seeded); not a deep copy,
        registry.apply_kernels(model, ("rmsnorm", "swiglu", "rope", "projections"))  # which unjoins the projections
        patch_model(model)
        fp8_producers_kernel.link_mlps(model)  # the SwiGLU that writes h's row copy
        n_layers = model.config.num_hidden_layers
        handoff = model.fp8_handoff
        weights = {p.data_ptr() for p in model.parameters()}
        with monkeypatch.context() as m:
            m.setattr(fp8_producers_kernel, "SWIGLU_WRITES_ROWS", True)  # off by default (slower), tested here
            if on:
                assert fp8_producers_kernel.link_norms(model) == 2 * n_layers
            else:
                m.setattr(fp8_producers_kernel, "takes_rows", lambda reader, handoff: False)
            calls = _count_quantizations(m, lambda x: x.data_ptr() not in weights)
            results[on] = (*loss_and_grads(model, ids, labels), dict(calls), handoff.input_rows.taken)
        assert handoff.input_rows.tensor is None  # taken, or cleared by backward: nothing outlives the step
    (loss, grads, c0, t0), (loss_on, grads_on, c1, t1) = results[False], results[True]
    exactly("FP8 producers: loss", loss_on, loss)
    for name, g in grads.items():
        exactly(f"FP8 producers: {name}.grad", grads_on[name], g)
    assert (t0, t1) == (0, 3 * n_layers), (t0, t1)
    exactly("row quantizations saved", torch.tensor(c0["rows"] - c1["rows"]), torch.tensor(3 * n_layers))
    assert fp8_producers_kernel.link_norms(model) == 2 * n_layers  # again: the same count


def test_mxfp8_producers_change_no_bit_and_skip_the_quantizer(monkeypatch):
    """A tiny LLaMA under --fp8 --fp8-recipe mxfp8 --fp8-emulate with and without the MXFP8 producers (the
    norms linked to q/k/v and gate/up by `link_norms`): the loss and every gradient equal bit for bit, the
    norms' copies are read by every projection that reads their output (counted: 5 per decoder layer), the
    quantizer runs 5 row quantizations of activations per layer fewer, and nothing outlives the step.
    Exact because the fused norm's y is the plain norm's: always in the interpreter, and on a GPU as long as
    the compiler adds a row's squares in the same order in both kernels (same block shape and warps, as for
    the row-wise producer's test above); where it does not, `_near_plain_norm`'s bounds say by how much."""
    from playbook.model import registry
    from testkit import batch, loss_and_grads, tiny_model

    ids, labels = batch()
    results = {}
    for on in (False, True):
        model = tiny_model("llama").to(torch.bfloat16)  # the same weights each time (seeded)
        registry.apply_kernels(model, ("rmsnorm", "swiglu", "rope"))  # q/k/v and gate/up apart: 5 readers
        fp8_producers_kernel.patch_model(model, "mxfp8-emulated")
        n_layers = model.config.num_hidden_layers
        handoff = model.fp8_handoff
        assert fp8_producers_kernel.link_norms(model) == 2 * n_layers
        assert all(m.fp8_mx for m in model.modules() if isinstance(m, fp8_producers_kernel.Fp8RMSNorm))
        if not on:
            for norm in model.modules():
                if isinstance(norm, fp8_producers_kernel.Fp8RMSNorm):
                    norm.fp8_handoff = None  # the plain norm: the projections quantize their input themselves
        calls = {"rows": 0}
        quantize, weights = mx_quant_kernel.quantize_mxfp8, {p.data_ptr() for p in model.parameters()}

        def counting(x2, rows=True, cols=False, swizzle=False):  # row copies of activations, not of weights
            calls["rows"] += bool(rows) and x2.data_ptr() not in weights
            return quantize(x2, rows, cols, swizzle)

        monkeypatch.setattr(mx_quant_kernel, "quantize_mxfp8", counting)
        results[on] = (*loss_and_grads(model, ids, labels), calls["rows"], handoff.input_rows.taken)
        monkeypatch.undo()
        assert handoff.input_rows.tensor is None  # cleared by backward: nothing outlives the step
    (loss, grads, c0, t0), (loss_on, grads_on, c1, t1) = results[False], results[True]
    exactly("MXFP8 producers: loss", loss_on, loss)
    for name, g in grads.items():
        exactly(f"MXFP8 producers: {name}.grad", grads_on[name], g)
    assert (t0, t1) == (0, 5 * n_layers), (t0, t1)
    exactly("MXFP8 row quantizations of the norms' outputs saved", torch.tensor(c0 - c1), torch.tensor(5 * n_layers))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows, width", SWIGLU_SHAPES)
def test_swiglu_mxfp8_producer_gives_the_pair_bits(rows, width, activation):
    """The SwiGLU forward that writes its output's MXFP8 copies (one kernel) against the pair it replaces,
    swiglu_kernel's forward and then `quantize_mxfp8(h, True, True)`: h, both copies and both sets of e8m0
    scales bit for bit, and the copy along I the plain-PyTorch reference's; without `cols` the same copy
    along I. Widths not a multiple of 32 (200, 1100) and below one block (16), rows not a multiple of 32 (the
    transposed copy's zero padding), gate values over +-9 and one NaN (its block's scale is e8m0's NaN, the
    neighbours untouched). (LLaMA 3.1 8B's width, 14336, on a GPU.)"""
    import swiglu_kernel

    gate, up = swiglu_kernel.halves(_gate_up(rows, width, seed=rows + 2))
    tag = f"SwiGLU + MXFP8 {activation} [{rows}, {width}]"
    h, *ours = fp8_producers_kernel.swiglu_quantize_mxfp8(gate, up, activation)
    h_pair = swiglu_kernel.swiglu_forward(gate, up, activation)
    _same_bits(f"{tag}: h", h, h_pair)
    pair = mx_quant_kernel.quantize_mxfp8(h_pair, True, True)
    for what, o, e in zip(("q", "scales", "qT", "scales of qT"), ours, pair):
        _same_bits(f"{tag}: {what}", o.view(torch.uint8), e.view(torch.uint8))
    q_ref, s_ref = mx_quant_kernel.quantize_mxfp8_ref(h_pair)
    _same_bits(f"{tag}: q, the reference's", ours[0], q_ref)
    _same_bits(f"{tag}: scales, the reference's", ours[1].view(torch.uint8), s_ref.view(torch.uint8))
    assert ours[1].view(torch.uint8)[rows // 2, 0] == mx_quant_kernel.E8M0_NAN, tag  # the NaN's block
    rows_only = fp8_producers_kernel.swiglu_quantize_mxfp8(gate, up, activation, cols=False)
    assert rows_only[3] is None and rows_only[4] is None
    _same_bits(f"{tag}: q without the transposed copy", rows_only[1], ours[0])


@pytest.mark.parametrize("config", [(64, 64, 4), (128, 32, 8)])
def test_swiglu_mxfp8_producer_tiles_of_several_blocks(config, monkeypatch):
    """The producer's launch settings that `benchmark_kernels.py --mx-quant --tune` may choose (64 or 128 rows per
    program) write the bytes of the pair: 97 rows end inside a program's second and fourth 32-row block."""
    import swiglu_kernel

    monkeypatch.setattr(fp8_producers_kernel, "SWIGLU_MX_CONFIG", config)
    gate, up = swiglu_kernel.halves(_gate_up(97, 200, seed=5))
    h, *ours = fp8_producers_kernel.swiglu_quantize_mxfp8(gate, up, "silu")
    pair = mx_quant_kernel.quantize_mxfp8(swiglu_kernel.swiglu_forward(gate, up, "silu"), True, True)
    for what, o, e in zip(("q", "scales", "qT", "scales of qT"), ours, pair):
        _same_bits(f"SwiGLU + MXFP8 tiles {config}: {what}", o.view(torch.uint8), e.view(torch.uint8))


def test_swiglu_mxfp8_producer_bytes():
    """The pair reads gate and up and writes h (6 bytes per element), then reads h and writes both copies
    (2 + 2 x 1.03); the producer skips the read of h: 2 bytes per element of the MLP width fewer."""
    m, width = 8192, 14336
    pair = 3 * m * width * 2 + mx_quant_kernel.ideal_bytes(m, width, torch.bfloat16, "mxfp8", 2)
    fused = fp8_producers_kernel.swiglu_mxfp8_ideal_bytes(m, width, torch.bfloat16)
    assert pair - fused == 2 * m * width, (pair, fused)
    record(f"SwiGLU + MXFP8 at 8192 x 14336: {fused:,} B against the pair's {pair:,} B", 0.0, 0.0, True)


def test_mxfp8_swiglu_and_joined_readers_change_no_bit(monkeypatch):
    """The same with joined projections (projections_kernel: qkv_proj, gate_up_proj) and the MLP linked
    (`link_mlps`): each norm's copy goes to its one joined reader, and the SwiGLU writes h's two MXFP8
    copies (along I, and transposed for down_proj's dW) for down_proj. Loss and gradients bit for bit
    those of the model without producers; 3 copies taken per decoder layer, and as many copies along K
    fewer made by the quantizer. (The joined readers keep their input's transposed copy for dW, so the
    quantizer still makes that one from the norm's output in the forward; down_proj gets both from the
    SwiGLU.)"""
    from playbook.model import registry
    from testkit import batch, loss_and_grads, tiny_model

    ids, labels = batch()
    results = {}
    for on in (False, True):
        model = tiny_model("llama").to(torch.bfloat16)
        registry.apply_kernels(model, ("rmsnorm", "swiglu", "rope", "projections"))
        fp8_producers_kernel.patch_model(model, "mxfp8-emulated")
        n_layers, handoff = model.config.num_hidden_layers, model.fp8_handoff
        if on:
            assert fp8_producers_kernel.link_norms(model) == 2 * n_layers
            assert fp8_producers_kernel.link_mlps(model) == n_layers
        calls = {"activations": 0}
        quantize, weights = mx_quant_kernel.quantize_mxfp8, {p.data_ptr() for p in model.parameters()}

        def counting(x2, rows=True, cols=False, swizzle=False):  # copies along K of activations and gradients
            calls["activations"] += bool(rows) and x2.data_ptr() not in weights
            return quantize(x2, rows, cols, swizzle)

        monkeypatch.setattr(mx_quant_kernel, "quantize_mxfp8", counting)
        results[on] = (*loss_and_grads(model, ids, labels), handoff.input_rows.taken, calls["activations"])
        monkeypatch.undo()
        assert handoff.input_rows.tensor is None
    (loss, grads, t0, c0), (loss_on, grads_on, t1, c1) = results[False], results[True]
    exactly("MXFP8 producers, joined: loss", loss_on, loss)
    for name, g in grads.items():
        exactly(f"MXFP8 producers, joined: {name}.grad", grads_on[name], g)
    assert (t0, t1) == (0, 3 * n_layers), (t0, t1)
    # per layer, forward: qkv_proj's and gate_up_proj's inputs along K, h both ways for down_proj
    exactly("copies along K saved", torch.tensor(c0 - c1), torch.tensor(3 * n_layers))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows, width", SWIGLU_SHAPES)
def test_swiglu_producer_gives_the_pair_bits(rows, width, activation):
    """The SwiGLU forward that writes its output's FP8 row copy (one kernel) against the pair it replaces,
    swiglu_kernel's forward and then the row quantizer reading h: h, the FP8 rows, their scales and the
    column maxima equal bit for bit; without column maxima the same rows. A NaN stays in its own row.
    (LLaMA 3.1 8B's width, 14336, on a GPU.)"""
    import swiglu_kernel

    gate, up = swiglu_kernel.halves(_gate_up(rows, width, seed=rows + 1))
    tag = f"SwiGLU + FP8 rows {activation} [{rows}, {width}]"
    ours = fp8_producers_kernel.swiglu_quantize_rows(gate, up, activation)
    h = swiglu_kernel.swiglu_forward(gate, up, activation)
    for what, o, e in zip(("h", "q", "row scales", "column maxima"), ours, (h, *quantize_rows(h, True, True))):
        _same_bits(f"{tag}: {what}", o, e)
    rows_only = fp8_producers_kernel.swiglu_quantize_rows(gate, up, activation, col_max=False)
    assert rows_only[3] is None
    _same_bits(f"{tag}: q without column maxima", rows_only[1], ours[1])


def test_swiglu_producer_bytes():
    """The pair reads gate and up and writes h (6 bytes per element), then reads h and writes q (3); the
    producer moves 7: 2 bytes per element of the MLP width fewer."""
    m, width = 8192, 14336
    pair = (3 * m * width * 2) + ideal_bytes(m, width, torch.bfloat16, "rows")
    fused = fp8_producers_kernel.swiglu_rows_ideal_bytes(m, width, torch.bfloat16)
    assert pair - fused == 2 * m * width, (pair, fused)
    record(f"SwiGLU + FP8 rows at 8192 x 14336: {fused:,} B against the pair's {pair:,} B", 0.0, 0.0, True)


def test_norms_are_linked_only_to_fp8_readers():
    """link_norms links nothing where the reader is not a trained FP8 layer of a row-wise (or MXFP8) recipe: a
    bf16 model, a tensor-wise recipe, a frozen FP8 weight (LoRA's base); and nothing in Gemma 2, whose
    post_attention_layernorm feeds the residual stream."""
    from playbook.model import registry
    from testkit import tiny_model

    model = tiny_model("llama").to(torch.bfloat16)
    registry.apply_kernels(model, ("rmsnorm", "swiglu", "rope", "projections"))
    assert fp8_producers_kernel.link_norms(model) == 0  # no FP8 layers
    tensorwise = copy.deepcopy(model)
    patch_model(tensorwise, "tensorwise")
    assert fp8_producers_kernel.link_norms(tensorwise) == 0
    patch_model(model)
    for p in model.parameters():
        p.requires_grad_(False)
    assert fp8_producers_kernel.link_norms(model) == 0
    gemma2 = tiny_model("gemma2").to(torch.bfloat16)
    registry.apply_kernels(gemma2, ("rmsnorm",))
    patch_model(gemma2)
    assert fp8_producers_kernel.link_norms(gemma2) == 0
    record("link_norms: nothing without a trained row-wise FP8 reader, nothing in Gemma 2", 0.0, 0.0, True)


def test_swiglu_maxima_op_passes_opcheck():
    gate_up = _gate_up(6, 64, seed=0).nan_to_num()
    dh = random_like_grad(gate_up[:, :64])
    torch.library.opcheck(fp8_producers_kernel.swiglu_joined_fp8_bwd_op, (dh, gate_up, "silu"))
    record("swiglu_joined_fp8_bwd passes torch.library.opcheck", 0.0, 0.0, True)




if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "FP8 producers: test report"))
