"""Tests of the FP8 linear layers: the quantizing kernels against PyTorch bit for bit, the three FP8
matmuls against float64 within e4m3's rounding, what backward keeps, and a tiny LLaMA patched,
trained, and run through `finetune_optimized.py --fp8`; then every `--fp8-recipe` the same way (its
quantizers bit for bit, its matmuls against its own dequantized operands, which layers it converts,
the per-GPU guards, and MXFP8's reference quantizer); and LoRA on a frozen base kept in FP8 (the stored
weight, its forward and input gradient within e4m3's worst case, the bytes left, a LoRA run against
bf16 LoRA, and `finetune_optimized.py --lora-r --fp8` with its checkpoint).

    $ python fp8_linear_test.py     # a readable report
    $ pytest fp8_linear_test.py

Tolerances. The quantizers have no tolerance: scales and FP8 values must equal the plain-PyTorch
reference exactly (same IEEE divisions, same round-to-nearest-even cast). Each FP8 matmul is checked
three ways against float64:
  1. against the exact product of its *dequantized* operands (the reference quantizers' values times
     their scales), element by element: within one bf16 rounding of the output (2^-8 of itself) plus
     the accumulation's worst case (`ACC` below). This isolates the plumbing (which scale runs along
     which dimension, transposes, padding) from FP8's own error.
  2. against the exact product of the *unquantized* operands, element by element, within the
     worst case of rounding both operands to e4m3 (derived in `_e4m3_bound`).
  3. the relative L2 error against the same, at most 2x its expected size: rounding to e4m3 leaves an
     RMS relative error of 2^-3 / sqrt(12) * 0.736 = 0.0266 per operand (a uniform error over half a
     step of 2^-3 relative, for mantissas spread over a binade: sqrt(E[1/m^2]) = 0.736), so 0.0376
     for a product of two; the bound is 0.075.
For whole models the rule is testkit's factor 2 times 2^4: e4m3 keeps 4 mantissa bits fewer than
bf16, so each of its roundings is 16x larger than bf16's, and an FP8 model may be at most 32x as far
from an fp32 model as the bf16 model is.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import contextlib
import copy
import io
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from playbook.core import gpu_arch
from playbook import registry as ak
from playbook import common
import fp8_linear_kernel
from playbook import models
from playbook import training
from fp8_linear_kernel import (AMAX_FLOOR, FP8_DTYPE, FP8_MAX, Float8Linear, Float8LinearFunction, Fp8Handoff,
                               check_fp8_device, compiled_graph_trusted, expected_patches, fp8_cols_op, fp8_linear,
                               fp8_rows_op, fp8_scaled_mm_op, ideal_bytes, padded, patch_model, quantize,
                               quantize_cols_ref, quantize_rows, quantize_rows_ref)
from playbook.core.kernel_utils import DEVICE
from playbook.config import make_parser, parse_config
from playbook.testkit import close_to_reference, exactly, expect_error, random_like_grad, record, run_as_script

U = 2.0**-4  # e4m3's largest relative rounding error for normal values: half of its 2^-3 step
SUB = 2.0**-10  # its largest absolute rounding error below 2^-6, in units of the scale: half of 2^-9
RMS_BOUND = 2 * math.sqrt(2) * 2.0**-3 / math.sqrt(12) * 0.736  # rule 3 of the module docstring
MODEL_FACTOR = 2 * 2**4  # for whole models (module docstring)
# Accumulation: with fp32 sums each of n additions rounds by at most 2^-24 of the running sum. On a
# GPU the forward accumulates without promotion to fp32 (fast accumulation), and Hopper's FP8 tensor
# cores then keep about 14 bits (DeepSeek-V3 technical report): 2^-14 there.
ACC = 2.0**-14 if DEVICE.type == "cuda" else 2.0**-24
# Real text the tiny model can learn, in a file no code change edits (the chat examples, read as raw text)
TEXT = str(Path(__file__).parent / "examples" / "chat.jsonl")


def _spread(shape, dtype, seed=0):
    """Values over many binades, and row 0 all zeros (the scale's floor): not a plain randn."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if len(shape) == 2 and shape[0] > 1:
        x = x * torch.logspace(-4, 3, shape[0])[:, None]
        x[0] = 0
    return x.to(device=DEVICE, dtype=dtype)


def _bits(t):
    return t.view(torch.uint8)


# ------------------------------------------------------------------------------------------------ quantizers
@pytest.mark.parametrize("shape, dtype", [
    pytest.param((37, 48), torch.bfloat16, id="37x48 bf16"),
    # several row blocks per program, two programs: the partial column maxima are reduced
    pytest.param((300, 16), torch.bfloat16, id="300x16 bf16"),
    pytest.param((19, 176), torch.float16, id="19x176 fp16"),
    pytest.param((5, 1), torch.float32, id="one column fp32"),
    pytest.param((1, 4096), torch.bfloat16, id="one long row"),
    pytest.param((0, 32), torch.bfloat16, id="no rows"),
])
def test_quantize_matches_reference(shape, dtype):
    x = _spread(shape, dtype)
    q, s, qt, st = quantize(x, rows=True, cols=True)
    rq, rs = quantize_rows_ref(x)
    cq, cs = quantize_cols_ref(x)
    assert qt.shape == (shape[1], padded(shape[0])) and qt.is_contiguous()
    exactly(f"{list(shape)} {str(dtype)[6:]}: row scales", s, rs)
    exactly(f"{list(shape)} {str(dtype)[6:]}: rows (fp8 bits)", _bits(q), _bits(rq))
    exactly(f"{list(shape)} {str(dtype)[6:]}: column scales", st, cs)
    exactly(f"{list(shape)} {str(dtype)[6:]}: columns, transposed and zero-padded", _bits(qt), _bits(cq))


# Shapes that take each launch setting of `row_launch` on a GPU (rows of 1024, 4096 and 14336 values, as
# in LLaMA 3.1 8B, 6144 and 28672, the joined q/k/v's and gate/up's output gradients; the double-buffered
# loop for 4096 to 14336 and the single one for the others; with row counts that
# leave the last loop iteration of a program partly filled); the interpreter, which runs its own
# settings, gets small stand-ins of the same row widths.
LAUNCH_SHAPES = ([(8190, 1024), (4100, 4096), (2050, 6144), (1030, 14336), (1030, 28672)] if DEVICE.type == "cuda"
                 else [(35, 1024), (9, 4096), (5, 6144), (5, 14336), (3, 28672)])


@pytest.mark.parametrize("shape", LAUNCH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_matches_reference_at_launch_shapes(shape):
    x = _spread(shape, torch.bfloat16, seed=shape[1])
    q, s, qt, st = quantize(x, rows=True, cols=True)
    rq, rs = quantize_rows_ref(x)
    cq, cs = quantize_cols_ref(x)
    exactly(f"{list(shape)}: row scales", s, rs)
    exactly(f"{list(shape)}: rows (fp8 bits)", _bits(q), _bits(rq))
    exactly(f"{list(shape)}: column scales", st, cs)
    exactly(f"{list(shape)}: columns, transposed and zero-padded", _bits(qt), _bits(cq))


def test_row_launch_settings_fit_the_registers():
    """Every row width up to MAX_COLS gets a launch a GPU can run: at most 128 fp32 values per thread
    (counting both blocks of the double-buffered loop), at most 32 warps, and at least 16384 values in
    flight per program."""
    for p in range(17):
        block_k = 2**p
        rows, warps, programs = fp8_linear_kernel.row_launch(block_k, 132)
        live = 2 if fp8_linear_kernel.row_prefetch(block_k) else 1  # loop iterations held in registers
        assert rows >= 1 and warps in (1, 2, 4, 8, 16, 32) and programs in (132, 264), (block_k, rows, warps)
        assert live * rows * block_k // (32 * warps) <= 128, (block_k, rows, warps)
        assert live * rows * block_k >= 16384, (block_k, rows, warps)
    assert [fp8_linear_kernel.row_prefetch(2**p) for p in (11, 12, 13, 14, 15)] == [False, True, True, True, False]


def test_each_layout_alone_equals_both():
    x = _spread((70, 64), torch.bfloat16, seed=3)
    both = quantize(x, True, True)
    rows, cols = quantize(x, True, False), quantize(x, False, True)
    exactly("rows alone == rows of both", _bits(rows[0]), _bits(both[0]))
    exactly("columns alone == columns of both", _bits(cols[2]), _bits(both[2]))
    assert rows[2].numel() == cols[0].numel() == 0


def test_rounding_of_every_e4m3_value_and_midpoint():
    """A row holding 448 has scale 1, so the kernel's output is its own rounding of the other values:
    every finite e4m3 value, every midpoint between neighbours (ties: to even), one fp32 ulp either
    side of each midpoint, and -0.0, must round as PyTorch's cast rounds them, per row and per column."""
    grid = _bits(torch.arange(256, dtype=torch.uint8)).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([torch.tensor([FP8_MAX, -0.0]), grid, mids, torch.nextafter(mids, mids + 1),
                        torch.nextafter(mids, mids - 1)])
    expected = values.to(FP8_DTYPE)
    x = values[None, :].to(DEVICE)
    q, s, _, _ = quantize(x, rows=True)
    _, _, qt, st = quantize(x.t().contiguous(), rows=False, cols=True)
    assert s.item() == st.item() == 1.0
    exactly(f"{values.numel()} values rounded per row", _bits(q[0]).cpu(), _bits(expected))
    exactly(f"{values.numel()} values rounded per column", _bits(qt[0, :values.numel()]).cpu(), _bits(expected))


def test_zero_rows_stay_zero():
    x = torch.zeros(3, 32, device=DEVICE, dtype=torch.bfloat16)
    q, s, qt, st = quantize(x, True, True)
    assert q.float().abs().max() == 0 and qt.float().abs().max() == 0
    exactly("all-zero rows: scale is the floor / 448", s, torch.full_like(s, AMAX_FLOOR / FP8_MAX))


def test_custom_ops_pass_opcheck():
    """Schema, fake implementations (shapes and dtypes of every output) and AOT dispatch."""
    x = _spread((37, 48), torch.bfloat16, seed=2)
    for write_rows, col_max in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(fp8_rows_op, (x, write_rows, col_max))
    torch.library.opcheck(fp8_rows_op, (x[:0], True, True))  # no rows
    torch.library.opcheck(fp8_rows_op, (x.float()[::2], True, True))  # strided rows
    torch.library.opcheck(fp8_rows_op, (x, True, False, torch.rand(48, device=DEVICE)))  # times column factors
    cmax = fp8_rows_op(x, False, True)[2]
    torch.library.opcheck(fp8_cols_op, (x, cmax))
    torch.library.opcheck(fp8_cols_op, (x[:0], torch.zeros_like(cmax)))
    xq, sx, _ = fp8_rows_op(x, True, False)
    wq, sw, _ = fp8_rows_op(_spread((32, 48), torch.bfloat16, seed=3), True, False)
    # Without "test_schema": its mutation check compares the fp8 inputs with arithmetic that PyTorch
    # does not implement for float8_e4m3fn on the CPU; the fake, AOT and dispatch checks all run.
    for fast_accum in (True, False):
        torch.library.opcheck(fp8_scaled_mm_op, (xq, sx, wq, sw, fast_accum),
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    record("opcheck: fp8_quantize_rows (x6), fp8_quantize_cols (x2), fp8_scaled_mm (x2)", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------ the linear layer
def _dequant_rows(t):
    q, s = quantize_rows_ref(t)
    return q.double() * s.double()[:, None]


def _dequant_cols(t):
    qt, s = quantize_cols_ref(t)
    return (qt.double() * s.double()[:, None])[:, :t.shape[0]].t()


def _e4m3_bound(a, b, exact, out):
    """Worst-case |error| of each element of a @ b.T when both are rounded to e4m3 (row scales of a,
    row scales of b), plus the output's bf16 rounding.

    Each operand value v becomes v' with |v' - v| <= U |v| + SUB s (s its row's scale: the second
    term covers e4m3's subnormals). Summing (a' b' - a b) = (a' - a) b + a (b' - b) + (a' - a)(b' - b)
    over the reduction gives, with e_a = SUB s_a and e_b = SUB s_b:
        (2U + U^2) sum|a||b| + (1 + U)(e_a sum|b| + e_b sum|a|) + n e_a e_b
    and the bf16 output adds up to 2^-8 of itself (round to nearest, 8 significant bits).
    """
    a, b = a.double(), b.double()
    e_a = SUB * a.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX  # [rows of a, 1]
    e_b = SUB * b.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX  # [rows of b, 1]
    n = a.shape[1]
    bound = ((2 * U + U * U) * (a.abs() @ b.abs().t()) + (1 + U) * (e_a * b.abs().sum(1)[None, :]
             + e_b.t() * a.abs().sum(1)[:, None]) + n * e_a * e_b.t())
    return bound + 2.0**-8 * out.double().abs() + 2.0**-24 * n * (a.abs() @ b.abs().t())  # + fp32 sums


def _worst_ratio(err, bound) -> float:
    """max of err / bound, elementwise (0 where err is 0: rows of zeros must come out exactly 0)."""
    return torch.where(err == 0, 0.0, err / bound).max().item() if err.numel() else 0.0


def _check_matmul(tag, ours, a, b, a_deq, b_deq):
    """ours ~ a @ b.T, where a_deq, b_deq are the operands as the FP8 matmul sees them (dequantized).

    Rule 1, element by element: ours is the dequantized product summed with fp32 (or, on a GPU, the
    FP8 tensor cores') accumulation, then rounded to bf16 (at most 2^-8 of itself, 8 significant bits).
    That bound is tight: among thousands of outputs some round by nearly 2^-8, so ratios just under 1
    are the bf16 rounding itself, and anything above 1 is a bug.
    """
    n = a.shape[1]
    plumbing = a_deq @ b_deq.t()
    bound = 2.0**-8 * plumbing.abs() + (1 + 2.0**-8) * n * ACC * (a_deq.abs() @ b_deq.abs().t())
    ratio = _worst_ratio((ours.double() - plumbing).abs(), bound)
    record(f"{tag}: vs dequantized operands, / bound", ratio, 1.0, ratio <= 1.0)
    exact = a.double() @ b.double().t()
    ratio = _worst_ratio((ours.double() - exact).abs(), _e4m3_bound(a, b, exact, ours))
    record(f"{tag}: vs exact, / worst case of e4m3", ratio, 1.0, ratio <= 1.0)
    rel = (torch.linalg.vector_norm(ours.double() - exact) / torch.linalg.vector_norm(exact)).item()
    record(f"{tag}: relative L2 error", rel, RMS_BOUND, rel <= RMS_BOUND)


def _run_linear(x, w, dy, keep, grad_x=True, grad_w=True, bias=None):
    xi = x.detach().clone().requires_grad_(grad_x)
    wi = w.detach().clone().requires_grad_(grad_w)
    y = fp8_linear(xi, wi, bias, keep_fp8_input=keep)
    y.backward(dy)
    return y, xi.grad, wi.grad


@pytest.mark.parametrize("keep", [True, False], ids=["fp8 input kept", "bf16 input kept"])
def test_linear_forward_and_gradients(keep):
    """74 tokens (not a multiple of 16: the transposed copies are padded), 64 -> 48 features, bf16."""
    x = _spread((74, 64), torch.bfloat16, seed=4).view(2, 37, 64)
    w = _spread((48, 64), torch.bfloat16, seed=5)
    dy = random_like_grad(x.new_empty(2, 37, 48), seed=6)
    y, dx, dw = _run_linear(x, w, dy, keep)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16 and y.shape == (2, 37, 48)
    x2, dy2 = x.reshape(74, 64), dy.reshape(74, 48)
    _check_matmul("y = x W^T", y.reshape(74, 48), x2, w, _dequant_rows(x2), _dequant_rows(w))
    _check_matmul("dx = dy W", dx.reshape(74, 64), dy2, w.t(), _dequant_rows(dy2), _dequant_cols(w).t())
    _check_matmul("dW = dy^T x", dw, dy2.t(), x2.t(), _dequant_cols(dy2).t(), _dequant_cols(x2).t())


def test_what_backward_keeps():
    """Exactly the tensors the class docstring lists: the weight Parameter itself and its column
    maxima, and x's transposed FP8 copy with its scales (or x itself and its column maxima, or nothing
    of x when the weight is frozen)."""
    M, K, N = 40, 64, 32
    x = _spread((M, K), torch.bfloat16, seed=7)
    w = nn.Parameter(_spread((N, K), torch.bfloat16, seed=8))

    def saved_by(keep, frozen=False):
        saved = []
        w.requires_grad_(not frozen)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fp8_linear(x.clone().requires_grad_(), w, keep_fp8_input=keep)
        w.requires_grad_(True)
        return [(tuple(t.shape), t.dtype, t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr())
                for t in saved]

    weight, col_max = ((N, K), torch.bfloat16, True), ((K,), torch.float32, False)
    assert saved_by(True) == [weight, col_max, ((K, padded(M)), FP8_DTYPE, False), ((K,), torch.float32, False)]
    assert saved_by(False) == [weight, col_max, ((M, K), torch.bfloat16, False), col_max]
    assert saved_by(True, frozen=True) == saved_by(False, frozen=True) == [weight, col_max]
    per_token = K * 1
    record(f"kept for backward: FP8 xT ({per_token} B/token) or bf16 x ({2 * K} B/token), weight shared",
           0.0, 0.0, True)


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
    x = _spread((40, 64), torch.bfloat16, seed=30)
    weights = [_spread((n, 64), torch.bfloat16, seed=31 + n) for n in (64, 32, 32)]
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
    x = _spread((40, 64), torch.bfloat16, seed=32).requires_grad_()
    w = nn.Parameter(_spread((32, 64), torch.bfloat16, seed=33))
    handoff = Fp8Handoff()
    y = fp8_linear(x * 1, w, keep_fp8_input=False, handoff=handoff)
    assert handoff.shared_rows.tensor is not None
    y.sum().backward()
    assert handoff.shared_rows.tensor is None and handoff.shared_cols.tensor is not None
    handoff.offer_grad(y.detach(), (y.new_zeros(40), y.new_zeros(32)))
    fp8_linear(x * 1, w, keep_fp8_input=False, handoff=handoff)
    assert handoff.shared_cols.tensor is None and handoff.grad_maxima.tensor is None
    record("hand-off slots emptied by the other pass", 0.0, 0.0, True)


def test_frozen_weight_and_frozen_input():
    """A gradient not asked for is not computed, and the others are the same bits as with both."""
    x = _spread((33, 32), torch.bfloat16, seed=9)
    w = _spread((16, 32), torch.bfloat16, seed=10)
    dy = random_like_grad(x.new_empty(33, 16), seed=11)
    both = _run_linear(x, w, dy, True)
    frozen_w = _run_linear(x, w, dy, True, grad_w=False)
    frozen_x = _run_linear(x, w, dy, True, grad_x=False)
    assert frozen_w[2] is None and frozen_x[1] is None
    exactly("frozen weight (LoRA): dx unchanged", frozen_w[1], both[1])
    exactly("frozen input: dW unchanged", frozen_x[2], both[2])


def test_strided_input_bias_and_empty_batch():
    base = _spread((24, 128), torch.bfloat16, seed=12)
    w = _spread((32, 64), torch.bfloat16, seed=13)
    b = _spread((32,), torch.bfloat16, seed=14)
    x = base[:, ::2]  # every other column: not a view the kernels can read in place
    exactly("column-sliced input == its contiguous copy", fp8_linear(x, w), fp8_linear(x.contiguous(), w))
    exactly("bias added after the matmul", fp8_linear(x, w, b), fp8_linear(x, w) + b)
    x0, w0 = base[:0, :64].clone().requires_grad_(), w.clone().requires_grad_()
    y0 = fp8_linear(x0, w0)
    y0.sum().backward()
    assert y0.shape == (0, 32) and x0.grad.shape == (0, 64)
    exactly("no tokens: dW is zero", w0.grad, torch.zeros_like(w))


def test_nan_poisons_only_its_row():
    """A NaN stays NaN in both FP8 copies (not +-448), the maxima skip it (the rest of its row and
    column quantize as without it), and it makes exactly its own output row NaN."""
    x = _spread((20, 32), torch.bfloat16, seed=15)
    x[3, 5] = float("nan")
    q, s, qt, st = quantize(x, True, True)
    rq, rs = quantize_rows_ref(x)
    cq, cs = quantize_cols_ref(x)
    assert q[3, 5].isnan() and qt[5, 3].isnan() and q.float().isnan().sum() == qt.float().isnan().sum() == 1
    exactly("scales with a NaN in x (row and column)", torch.cat([s, st]), torch.cat([rs, cs]))
    exactly("the other FP8 values", q.float().nan_to_num(7.0), rq.float().nan_to_num(7.0))
    y = fp8_linear(x, _spread((16, 32), torch.bfloat16, seed=16))
    assert y[3].isnan().all() and y[torch.arange(20) != 3].isfinite().all()
    record("a NaN input: its output row is NaN, the others finite", 0.0, 0.0, True)


def test_second_order_gradients_raise():
    x = _spread((16, 32), torch.float32, seed=17).requires_grad_()
    w = _spread((16, 32), torch.float32, seed=18)
    y = fp8_linear(x, w)
    msg = expect_error(RuntimeError, lambda: torch.autograd.grad(y, x, random_like_grad(y), create_graph=True))
    assert "second-order" in msg


def _compiled_and_eager(compiled, seed=19):
    x = _spread((3, 19, 64), torch.bfloat16, seed=seed)
    w = _spread((48, 64), torch.bfloat16, seed=seed + 1)
    dy = random_like_grad(x.new_empty(3, 19, 48), seed=seed + 2)
    results = []
    for fn in (fp8_linear, compiled):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi)
        y.backward(dy)
        results.append((y, xi.grad, wi.grad))
    return results


def test_torch_compile_matches_eager():
    """Where the compiled graph is trusted (the CPU): one graph around the opaque quantize and
    scaled-matmul operators, the same bits as eager. On a GPU (not trusted, `compiled_graph_trusted`
    says why): fullgraph=True is refused, and a compiled caller runs the layer eagerly, same bits."""
    torch._dynamo.reset()
    if compiled_graph_trusted(torch.device(DEVICE)):
        eager, comp = _compiled_and_eager(torch.compile(fp8_linear, fullgraph=True))
        label = "torch.compile(fullgraph=True) == eager"
    else:
        x = torch.randn(32, 64, device=DEVICE, dtype=torch.bfloat16)
        w = torch.randn(48, 64, device=DEVICE, dtype=torch.bfloat16)
        with pytest.raises(Exception, match="(?i)disable|skip|graph break"):
            torch.compile(fp8_linear, fullgraph=True)(x, w)
        torch._dynamo.reset()
        eager, comp = _compiled_and_eager(torch.compile(fp8_linear))
        label = "torch.compile (the FP8 layer outside the graph) == eager"
    for what, a, b in zip(("y", "dx", "dW"), eager, comp):
        exactly(f"{label}: {what}", b, a)


def test_untrusted_compile_runs_the_layer_outside_the_graph(monkeypatch):
    """The GPU's path, taken on this device: with the compiled graph not trusted, the layer is left
    out of the traced graph (the multiplication after it is traced), and the results equal eager's
    bit for bit."""
    monkeypatch.setattr(fp8_linear_kernel, "compiled_graph_trusted", lambda device: False)
    torch._dynamo.reset()
    x = _spread((3, 19, 64), torch.bfloat16, seed=5)
    w = _spread((48, 64), torch.bfloat16, seed=6)
    explained = torch._dynamo.explain(lambda a, b: fp8_linear(a, b) * 2)(x, w)
    traced = [str(node.target) for g in explained.graphs for node in g.graph.nodes]
    assert explained.graph_count >= 1 and any("mul" in t for t in traced), traced  # the rest is compiled
    assert not any("fp8" in t or "Float8" in t or "autograd_function" in t for t in traced), \
        f"the FP8 layer must run outside the compiled graph: {traced}"
    torch._dynamo.reset()
    eager, comp = _compiled_and_eager(torch.compile(fp8_linear), seed=7)
    for what, a, b in zip(("y", "dx", "dW"), eager, comp):
        exactly(f"compiled with a graph break == eager: {what}", b, a)


@pytest.mark.parametrize("make, error, says", [
    pytest.param(lambda: (torch.randn(4, 40), torch.randn(48, 40)), ValueError, "multiple of 16", id="in_features 40"),
    pytest.param(lambda: (torch.randn(4, 32), torch.randn(24, 32)), ValueError, "multiple of 16", id="out_features 24"),
    pytest.param(lambda: (torch.randn(4, 32), torch.randn(48, 16)), ValueError, "in_features", id="shape mismatch"),
    pytest.param(lambda: (torch.randint(0, 5, (4, 32)), torch.randn(48, 32)), TypeError, "float", id="integer input"),
])
def test_bad_shapes_are_refused_clearly(make, error, says):
    x, w = make()
    assert says in expect_error(error, fp8_linear, x.to(DEVICE), w.to(DEVICE))


def test_device_guard(monkeypatch):
    """CUDA below compute capability 8.9 and devices other than CUDA and the CPU are refused."""
    check_fp8_device(torch.device("cpu"))  # allowed: the tests run here
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert "8.9" in expect_error(RuntimeError, check_fp8_device, torch.device("cuda", 0))
    assert "CUDA" in expect_error(RuntimeError, check_fp8_device, torch.device("meta"))


def test_ideal_bytes_is_the_docstring_count():
    n, k = 8192, 4096
    rows, both = ideal_bytes(n, k, torch.bfloat16, "rows"), ideal_bytes(n, k, torch.bfloat16, "both")
    assert rows == 3 * n * k + 4 * n  # read bf16 x once, write fp8 q and a scale per row
    assert both == 6 * n * k + 4 * n + 4 * k  # read x twice, write both copies and both scales
    assert ideal_bytes(n, k, torch.bfloat16, "cols") == 3 * n * k + 4 * k  # given the maxima: one read
    for value in (rows, both):
        assert f"{value:,} B" in fp8_linear_kernel.__doc__, f"the docstring must state {value:,} B"
    record(f"ideal bytes at 8192 x 4096 bf16: rows {rows / 1e6:.1f} MB, both {both / 1e6:.1f} MB", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------ models
def _tiny(layers=1, dtype=torch.bfloat16, **overrides):
    model = models.build_preset("llama-tiny", layers, DEVICE, dtype)
    for name, value in overrides.items():
        setattr(model.config, name, value)
    model.config.use_cache = False
    return model


def test_patch_model_converts_the_decoder_projections():
    model = _tiny(layers=2, dtype=torch.float32)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    count = patch_model(model)
    assert count == expected_patches(model.config) == 7 * 2
    for layer in model.model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                m = getattr(owner, name)
                assert isinstance(m, Float8Linear) and m.keep_fp8_input == (name == "down_proj")
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert all(p is params[n] for n, p in model.named_parameters()), "Parameters must be shared, not copied"
    assert list(model.state_dict()) == keys
    assert patch_model(model) == count, "patching twice converts nothing more"
    record("2 layers: 14 projections in FP8, lm_head and embeddings not, Parameters shared", 0.0, 0.0, True)


def test_projections_the_matmul_cannot_take_stay_bf16(capsys):
    """An MLP width of 40 (not a multiple of 16): gate/up/down stay nn.Linear, named in one log line."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = LlamaForCausalLM(config)
    assert patch_model(model) == expected_patches(config) == 4 * 2
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    logged = capsys.readouterr().out
    assert "6 projection(s) stay" in logged and "not a multiple of 16" in logged, logged
    record("width 40: q/k/v/o in FP8, gate/up/down kept (logged)", 0.0, 0.0, True)


def test_phi3_fused_projections_are_counted():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    model = Phi3ForCausalLM(config)
    assert patch_model(model) == expected_patches(config) == 4 * 2  # qkv_proj, o_proj, gate_up_proj, down_proj
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Float8Linear)
    record("Phi-3: qkv_proj and gate_up_proj converted too", 0.0, 0.0, True)


def test_down_proj_runs_in_fp8_under_the_fused_swiglu(monkeypatch):
    """The fused SwiGLU folds down_proj into its own op only for `type(down_proj) is nn.Linear`; a
    Float8Linear fails that test, so the MLP calls it as a module: all 7 projections run in FP8."""
    import swiglu_kernel

    model = _tiny(layers=1)
    swiglu_kernel.patch_model(model)
    patch_model(model)
    calls = []
    real = fp8_linear_kernel.fp8_linear
    monkeypatch.setattr(fp8_linear_kernel, "fp8_linear",
                        lambda x, w, *a: calls.append(tuple(w.shape)) or real(x, w, *a))
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        logits = model(ids).logits
    assert len(calls) == 7 and (64, 176) in calls, calls
    assert logits.isfinite().all()
    record("fused SwiGLU MLP: down_proj called as a module, 7 FP8 matmuls per layer", 0.0, 0.0, True)


def test_lora_on_fp8_projections(monkeypatch):
    """peft wraps a Float8Linear as it wraps nn.Linear (it is one); the frozen base weight runs in FP8
    and saves nothing of its input, and the adapters train."""
    from playbook.lora import apply_lora
    from lora_kernel import fuse_lora_layers

    model = _tiny(layers=1)
    patch_model(model)
    model = apply_lora(model, r=4)
    fuse_lora_layers(model)  # as prepare_model does with the kernels on: Float8Linear bases stay peft's path
    calls = []
    real = fp8_linear_kernel.fp8_linear
    monkeypatch.setattr(fp8_linear_kernel, "fp8_linear",
                        lambda x, w, *a: calls.append(w.requires_grad) or real(x, w, *a))
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert calls == [False] * 7, "the 7 frozen base projections run in FP8"
    assert len(lora_grads) == 14 and all(g is not None and g.abs().sum() > 0 for g in lora_grads[1::2])
    record("LoRA on FP8 bases: 7 frozen FP8 projections, 14 adapter matrices with gradients", 0.0, 0.0, True)


def _loss_and_grads(model, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.double() for n, p in model.named_parameters()}


def test_tiny_llama_loss_and_gradients_close_to_bf16():
    """Same inputs through a bf16 model, its FP8-patched copy and an fp32 copy (the reference): the FP8
    loss and every parameter's gradient (relative L2) at most 32x as far from fp32 as bf16's."""
    base = _tiny(layers=1)
    ref = copy.deepcopy(base).float()
    ours = copy.deepcopy(base)
    patch_model(ours)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (lb, gb), (lo, go), (lr, gr) = (_loss_and_grads(m, ids) for m in (base, ours, ref))
    close_to_reference("loss (fp32 logits)", lo, lb, lr, torch.bfloat16, factor=MODEL_FACTOR)
    worst = (None, 0.0, 1.0)
    for name, r in gr.items():
        norm = torch.linalg.vector_norm(r).item()
        err = torch.linalg.vector_norm(go[name] - r).item() / norm
        # + one bf16 ulp, relative: testkit's allowance for a single rounding flip
        tol = MODEL_FACTOR * torch.linalg.vector_norm(gb[name] - r).item() / norm + 2.0**-7
        assert err <= tol, f"{name}: relative gradient error {err:.3e} > {tol:.3e}"
        if err / tol > worst[1] / worst[2]:
            worst = (name, err, tol)
    record(f"gradients, worst of {len(gr)}: {worst[0]}", worst[1], worst[2], True)


def _set_handoff(model, handoff):
    """Give every FP8 layer of the model `handoff` (None: each layer quantizes what it reads itself)."""
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.fp8_handoff = handoff


def test_patch_model_gives_the_model_one_handoff():
    """Every layer `patch_model` converts shares the model's hand-off, and so do the layers of a copy of
    the model, with a hand-off of their own that starts empty."""
    model = _tiny(layers=2)
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
    base = _tiny(layers=2)
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
            runs.append((*_loss_and_grads(model, ids), dict(calls)))
    (l0, g0, c0), (l1, g1, c1) = runs
    exactly("loss, shared vs separate quantization", l1, l0)
    for name in g0:
        exactly(f"{name}.grad", g1[name], g0[name])
    # per layer, forward: q/k/v read one tensor (3 -> 1), gate/up one (2 -> 1); backward the same
    saved = 2 * (2 + 1)
    exactly("activation quantizations saved per way (rows, cols)", torch.tensor([c0["rows"] - c1["rows"], c0["cols"] - c1["cols"]]),
            torch.tensor([saved, saved]))


def _config(*argv):
    return parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized", list(argv))


STEPS = 3


def _train(fp8: bool, dtype: torch.dtype):
    cfg = _config("--kernels", "none", "--batch-size", "2", "--seq-len", "32", "--data", TEXT, "--lr", "1e-2",
                  "--steps", str(STEPS))
    model = _tiny(layers=1, dtype=dtype)
    model.train()
    if fp8:
        patch_model(model)
    opt = training.make_optimizer(model, cfg)
    data = training.make_run_data(cfg, model, None)
    return torch.stack([training.training_step(model, opt, [data.batch(i, DEVICE)])[0].float() for i in range(STEPS)])


def test_training_loss_falls_as_in_bf16():
    """Three AdamW steps on real text (a high learning rate, so that the loss falls within them): the
    FP8 model's loss at every step within 32x the bf16 model's distance from the fp32 model's (plus one
    bf16 ulp of the loss), so it falls as the bf16 loss does."""
    ref, base, ours = _train(False, torch.float32), _train(False, torch.bfloat16), _train(True, torch.bfloat16)
    assert ref[-1] < ref[0] - 0.5, f"the tiny model should learn the text (else the test is vacuous): {ref.tolist()}"
    close_to_reference(f"loss at each of {STEPS} steps", ours, base, ref, torch.bfloat16, factor=MODEL_FACTOR)
    record(f"loss {ours[0]:.3f} -> {ours[-1]:.3f} (bf16: {base[0]:.3f} -> {base[-1]:.3f})", 0.0, 0.0, True)


def test_fp8_flag_is_parsed():
    assert _config().fp8 is False
    assert _config("--fp8").fp8 is True
    assert "--fp8" in make_parser("test", kernels_default=ak.DEFAULT_KERNELS).format_help()
    record("--fp8: off by default, RunConfig.fp8 when given", 0.0, 0.0, True)


def test_fp8_backend_flag(capsys):
    assert _config("--fp8").fp8_backend == "playbook"
    assert _config("--fp8", "--fp8-backend", "torchao").fp8_backend == "torchao"
    expect_error(SystemExit, _config, "--fp8-backend", "torchao")  # without --fp8: nothing to choose
    assert "add --fp8" in capsys.readouterr().err
    record("--fp8-backend: playbook by default; torchao only with --fp8", 0.0, 0.0, True)


def test_torchao_backend_without_torchao_says_so(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    msg = expect_error(SystemExit, models.apply_fp8, _tiny(layers=1), "torchao")
    assert "pip install torchao" in msg
    record("--fp8-backend torchao without torchao: one line naming the package", 0.0, 0.0, True)


def test_torchao_backend_converts_the_same_projections():
    pytest.importorskip("torchao.float8")
    model = _tiny(layers=2)
    assert models.apply_fp8(model, "torchao", compiled=True) == 14  # 7 per layer; lm_head left alone
    assert type(model.lm_head) is nn.Linear
    record("--fp8-backend torchao: the 7 projections per layer, not the lm_head", 0.0, 0.0, True)


def test_finetune_optimized_with_fp8_runs():
    """What `python finetune_optimized.py --fp8 --num-layers 1 --steps 2 ...` runs, in this process: the
    script's default kernels, then the FP8 patch (logged with its count), two steps with finite losses."""
    tag = "test_fp8_cpu"
    cfg = _config("--fp8", "--fp8-recipe", "rowwise", "--fp8-layers", "all", "--model", "llama-tiny", "--num-layers", "1",
                  "--steps", "2", "--timing-warmup-steps", "1",
                  "--batch-size", "1", "--seq-len", "16", "--tag", tag, "--overwrite")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result = training.train(cfg)
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (common.RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)
    assert "FP8: 7 of 7 decoder projections" in out.getvalue(), out.getvalue()[-2000:]
    assert len(result["losses"]) == 2 and all(math.isfinite(v) for v in result["losses"])
    record(f"finetune_optimized --fp8: 7 projections, losses {[round(v, 3) for v in result['losses']]}", 0.0, 0.0,
           True)


# ------------------------------------------------------------------------------ the SwiGLU backward with maxima
def _same_bits(name, ours, expected):
    """`exactly`, also for float8 tensors (compared as their bytes)."""
    if ours.dtype == FP8_DTYPE:
        ours, expected = _bits(ours), _bits(expected)
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
    dgu, row_max, col_max = fp8_linear_kernel.swiglu_joined_backward_maxima(dh, gate, up, activation)
    plain = swiglu_kernel.swiglu_backward(dh, gate, up, activation, packed=True)
    _same_bits(f"{tag}: d gate_up", dgu, plain)
    ours = fp8_linear_kernel.quantize_both(dgu, row_max, col_max)
    for what, o, e in zip(("q", "row scales", "qT", "column scales"), ours, _both_copies(plain)):
        _same_bits(f"{tag}: {what}", o, e)


def test_fp8_mlp_hands_its_maxima_to_the_fp8_projections():
    """A tiny LLaMA with joined projections and FP8 layers: with the model's hand-off each gate/up
    projection takes d gate_up's maxima from the SwiGLU backward (counted), and the loss and every
    gradient equal those of the model without a hand-off (separate quantizing passes) bit for bit."""
    from playbook import registry
    from playbook.testkit import batch, loss_and_grads, tiny_model

    model = tiny_model("llama").to(torch.bfloat16)
    registry.apply_kernels(model, ("rmsnorm", "swiglu", "rope", "projections"))
    patch_model(model)
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
    reordering an fp32 sum of H non-negative terms), and each output within one bf16 ulp (that relative
    change is below half an ulp, 2^-9, so at most one rounding flips). Inputs of mixed magnitudes, one
    row of zeros (its scale is the floor's) and one NaN (it poisons its own row, as in the pair).
    (LLaMA 3.1 8B's 8192 x 4096 on a GPU.)"""
    import rmsnorm_kernel

    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * torch.logspace(-2, 2, rows)[:, None]).to(DEVICE, torch.bfloat16)
    x[rows // 2] = 0
    x[-1, 1] = float("nan")
    w = (1.0 - offset + 0.3 * torch.randn(hidden, generator=g)).to(DEVICE, torch.bfloat16)
    tag = f"RMSNorm + FP8 rows [{rows}, {hidden}] {casting}"
    y, rstd, *copies = fp8_linear_kernel.rmsnorm_quantize_rows(x, w, 1e-6, offset, casting)
    for what, o, e in zip(("q", "row scales", "column maxima"), copies, quantize_rows(y, True, True)):
        _same_bits(f"{tag}: {what} of its own output", o, e)
    rows_only = fp8_linear_kernel.rmsnorm_quantize_rows(x, w, 1e-6, offset, casting, col_max=False)
    assert rows_only[4] is None
    _same_bits(f"{tag}: q without column maxima", rows_only[2], copies[0])
    y_pair, rstd_pair = rmsnorm_kernel.rmsnorm_forward(x, w, 1e-6, offset, casting)
    if DEVICE.type == "cpu":  # the interpreter: one order of addition for any block layout
        _same_bits(f"{tag}: output", y, y_pair)
        _same_bits(f"{tag}: rstd", rstd, rstd_pair)
        return
    ok = rstd_pair.isfinite()
    assert torch.equal(ok, rstd.isfinite()), tag
    rel = ((rstd - rstd_pair).abs() / rstd_pair.abs())[ok].max().item()
    assert rel <= (hidden - 1) * 2.0**-24, f"{tag}: rstd {rel:.3e} relative"
    yf, pf = y.float(), y_pair.float()
    assert torch.equal(yf.isnan(), pf.isnan()), tag
    both = ~yf.isnan()
    ulp = torch.ldexp(torch.ones_like(yf), torch.frexp(torch.maximum(yf.abs(), pf.abs()))[1] - 8)
    worst = ((yf - pf).abs() / ulp)[both].max().item()
    assert worst <= 1, f"{tag}: output {worst} bf16 ulp from the plain norm's"
    record(f"{tag}: rstd within {rel:.1e} relative, output within {worst:.0f} bf16 ulp of the plain norm", rel,
           (hidden - 1) * 2.0**-24, True)


def test_rmsnorm_producer_bytes():
    """The bytes the producer saves, counted: the pair reads x and writes y (the norm), then reads y and
    writes q (the quantizer): 7 bytes per bf16 element; the producer 5, without the read of y."""
    import rmsnorm_kernel

    m, h = 8192, 4096
    pair = rmsnorm_kernel.ideal_bytes(m, h, torch.bfloat16) + ideal_bytes(m, h, torch.bfloat16, "rows")
    fused = fp8_linear_kernel.rmsnorm_rows_ideal_bytes(m, h, torch.bfloat16)
    assert pair - fused == 2 * m * h, (pair, fused)
    record(f"RMSNorm + FP8 rows at 8192 x 4096: {fused:,} B against the pair's {pair:,} B", 0.0, 0.0, True)


def test_fp8_producers_change_no_bit_and_skip_the_row_pass(monkeypatch):
    """A tiny LLaMA with the default kernels and FP8 layers, with and without the FP8 producers: the
    norms linked to the projections that read them (`link_norms`: input_layernorm -> q/k/v,
    post_attention_layernorm -> gate/up) and the SwiGLU writing h's row copy for down_proj. The loss and
    every gradient equal bit for bit, each producer's row copy is taken (counted: 3 per decoder layer),
    and the FP8 layers run 3 row quantizations of activations per layer fewer."""
    from playbook import registry
    from playbook.testkit import batch, loss_and_grads, tiny_model

    ids, labels = batch()
    results = {}
    for on in (False, True):
        model = tiny_model("llama").to(torch.bfloat16)  # the same weights each time (seeded); not a deep copy,
        registry.apply_kernels(model, ("rmsnorm", "swiglu", "rope", "projections"))  # which unjoins the projections
        patch_model(model)
        n_layers = model.config.num_hidden_layers
        handoff = model.fp8_handoff
        weights = {p.data_ptr() for p in model.parameters()}
        with monkeypatch.context() as m:
            m.setattr(fp8_linear_kernel, "SWIGLU_WRITES_ROWS", True)  # off by default (slower), tested here
            if on:
                assert fp8_linear_kernel.link_norms(model) == 2 * n_layers
            else:
                m.setattr(fp8_linear_kernel, "takes_rows", lambda reader, handoff: False)
            calls = _count_quantizations(m, lambda x: x.data_ptr() not in weights)
            results[on] = (*loss_and_grads(model, ids, labels), dict(calls), handoff.input_rows.taken)
        assert handoff.input_rows.tensor is None  # taken, or cleared by backward: nothing outlives the step
    (loss, grads, c0, t0), (loss_on, grads_on, c1, t1) = results[False], results[True]
    exactly("FP8 producers: loss", loss_on, loss)
    for name, g in grads.items():
        exactly(f"FP8 producers: {name}.grad", grads_on[name], g)
    assert (t0, t1) == (0, 3 * n_layers), (t0, t1)
    exactly("row quantizations saved", torch.tensor(c0["rows"] - c1["rows"]), torch.tensor(3 * n_layers))
    assert fp8_linear_kernel.link_norms(model) == 2 * n_layers  # again: the same count


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
    ours = fp8_linear_kernel.swiglu_quantize_rows(gate, up, activation)
    h = swiglu_kernel.swiglu_forward(gate, up, activation)
    for what, o, e in zip(("h", "q", "row scales", "column maxima"), ours, (h, *quantize_rows(h, True, True))):
        _same_bits(f"{tag}: {what}", o, e)
    rows_only = fp8_linear_kernel.swiglu_quantize_rows(gate, up, activation, col_max=False)
    assert rows_only[3] is None
    _same_bits(f"{tag}: q without column maxima", rows_only[1], ours[1])


def test_swiglu_producer_bytes():
    """The pair reads gate and up and writes h (6 bytes per element), then reads h and writes q (3); the
    producer moves 7: 2 bytes per element of the MLP width fewer."""
    m, width = 8192, 14336
    pair = (3 * m * width * 2) + ideal_bytes(m, width, torch.bfloat16, "rows")
    fused = fp8_linear_kernel.swiglu_rows_ideal_bytes(m, width, torch.bfloat16)
    assert pair - fused == 2 * m * width, (pair, fused)
    record(f"SwiGLU + FP8 rows at 8192 x 14336: {fused:,} B against the pair's {pair:,} B", 0.0, 0.0, True)


def test_norms_are_linked_only_to_fp8_readers():
    """link_norms links nothing where the reader is not a trained FP8 layer of a row-wise recipe: a
    bf16 model, a tensor-wise recipe, a frozen FP8 weight (LoRA's base); and nothing in Gemma 2, whose
    post_attention_layernorm feeds the residual stream."""
    from playbook import registry
    from playbook.testkit import tiny_model

    model = tiny_model("llama").to(torch.bfloat16)
    registry.apply_kernels(model, ("rmsnorm", "swiglu", "rope", "projections"))
    assert fp8_linear_kernel.link_norms(model) == 0  # no FP8 layers
    tensorwise = copy.deepcopy(model)
    patch_model(tensorwise, "tensorwise")
    assert fp8_linear_kernel.link_norms(tensorwise) == 0
    patch_model(model)
    for p in model.parameters():
        p.requires_grad_(False)
    assert fp8_linear_kernel.link_norms(model) == 0
    gemma2 = tiny_model("gemma2").to(torch.bfloat16)
    registry.apply_kernels(gemma2, ("rmsnorm",))
    patch_model(gemma2)
    assert fp8_linear_kernel.link_norms(gemma2) == 0
    record("link_norms: nothing without a trained row-wise FP8 reader, nothing in Gemma 2", 0.0, 0.0, True)


def test_swiglu_maxima_op_passes_opcheck():
    gate_up = _gate_up(6, 64, seed=0).nan_to_num()
    dh = random_like_grad(gate_up[:, :64])
    torch.library.opcheck(fp8_linear_kernel.swiglu_joined_fp8_bwd_op, (dh, gate_up, "silu"))
    record("swiglu_joined_fp8_bwd passes torch.library.opcheck", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------ recipes
# Each recipe's three matmuls are checked as the row-wise ones are (module docstring): element by
# element against the exact product of the operands *as that recipe quantizes them* (rule 1: the
# plumbing of scales, blocks, transposes and padding), and by relative L2 against the exact product of
# the unquantized operands (rule 3). Rule 3's bound holds for every recipe: each operand value is
# rounded to e4m3 once, whatever its scale, so the RMS relative error per operand is the same 0.0266
# (values far below their block's maximum fall into e4m3's subnormals, but they carry a negligible
# share of the L2 norm of these data). The bf16 input gradient of rowwise-bf16-dgrad is checked
# against the exact product of the bf16 operands: bf16's rounding of the output only.
RECIPE_NAMES = tuple(fp8_linear_kernel.RECIPES)
TILE = fp8_linear_kernel.TILE


def _runs_here(recipe: str) -> bool:
    """Whether this device runs the recipe: the CPU all of them (reference arithmetic for the block and MX
    matmuls); a GPU mxfp8 from Blackwell on and blockwise on Hopper only (test_blackwell_and_hopper_guards)."""
    if DEVICE.type == "cpu" or recipe not in ("mxfp8", "blockwise"):
        return True
    family = gpu_arch.device_family(DEVICE)
    return family == gpu_arch.HOPPER if recipe == "blockwise" else family not in (gpu_arch.OLDER, gpu_arch.HOPPER)


RUNNABLE = tuple(r for r in RECIPE_NAMES if _runs_here(r))


def _as_quantized(t, how):
    """t [rows, reduction] (float64), with each value replaced by what the recipe's matmul sees: the
    dequantized FP8 copy. how: 'tensor', 'act' (1x128 blocks along the reduction), 'tile' (128x128),
    'mx' (1x32, power-of-two scales), 'row'. The reduction is zero-padded to whole blocks and cut back."""
    R, S = t.shape
    step = {"act": TILE, "tile": TILE, "mx": fp8_linear_kernel.MX_BLOCK}.get(how, 1)
    rows = TILE if how == "tile" else 1
    tp = torch.nn.functional.pad(t.float(), (0, -S % step, 0, -R % rows))
    if how == "tensor":
        q, s = fp8_linear_kernel.quantize_tensor_ref(tp)
    elif how == "row":
        q, s = quantize_rows_ref(tp)
        s = s[:, None]
    elif how == "mx":
        q, s = fp8_linear_kernel.quantize_mx_ref(tp)
    else:
        q, s = fp8_linear_kernel.quantize_blocks_ref(tp, rows, step)
    return fp8_linear_kernel.dequantize_blocks(q, s).double()[:R, :S]


# recipe -> how it quantizes (x and dy along the features, the weight, x and dy along the tokens)
HOW = {"rowwise": ("row", "row", "row"), "rowwise-bf16-dgrad": ("row", "row", "row"),
       "rowwise-bf16-ends": ("row", "row", "row"), "tensorwise": ("tensor", "tensor", "tensor"),
       "blockwise": ("act", "tile", "act"), "mxfp8": ("mx", "mx", "mx")}


def _check_plumbing(tag, ours, a_deq, b_deq, exact):
    """Rule 1 (element by element against the dequantized operands' product) and rule 3."""
    n = a_deq.shape[1]
    plumbing = a_deq @ b_deq.t()
    bound = 2.0**-8 * plumbing.abs() + (1 + 2.0**-8) * n * ACC * (a_deq.abs() @ b_deq.abs().t())
    ratio = _worst_ratio((ours.double() - plumbing).abs(), bound)
    record(f"{tag}: vs dequantized operands, / bound", ratio, 1.0, ratio <= 1.0)
    rel = (torch.linalg.vector_norm(ours.double() - exact) / torch.linalg.vector_norm(exact)).item()
    record(f"{tag}: relative L2 error", rel, RMS_BOUND, rel <= RMS_BOUND)
    return rel


@pytest.mark.parametrize("recipe", [r for r in RUNNABLE if r != "rowwise-bf16-ends"])
def test_recipe_forward_and_gradients(recipe):
    """74 tokens (padding to 16, 32 and 128 along the tokens), 512 -> 1024 features (whole groups of
    four 128x128 tiles, and N != K so that a transposed scale cannot pass), values over seven decades."""
    K, N = 512, 1024
    x = _spread((74, K), torch.bfloat16, seed=50).view(2, 37, K)
    w = _spread((N, K), torch.bfloat16, seed=51)
    dy = random_like_grad(x.new_empty(2, 37, N), seed=52)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xi, wi, recipe=recipe)
    y.backward(dy)
    assert y.dtype == xi.grad.dtype == wi.grad.dtype == torch.bfloat16
    x2, dy2, wd = x.reshape(74, K).double(), dy.reshape(74, N).double(), w.double()
    act, weight, tokens = HOW[recipe]
    _check_plumbing(f"{recipe}: y = x W^T", y.reshape(74, N), _as_quantized(x2, act), _as_quantized(wd, weight),
                    x2 @ wd.t())
    w_for_dx = _as_quantized(wd, weight) if weight == "tile" else _as_quantized(wd.t(), weight).t()
    if recipe == "rowwise-bf16-dgrad":  # the bf16 operands themselves: one bf16 rounding of each output
        exact = dy2 @ wd
        err = _worst_ratio((xi.grad.reshape(74, K).double() - exact).abs(),
                           2.0**-8 * exact.abs() + N * 2.0**-24 * (dy2.abs() @ wd.abs()))
        dx = xi.grad.reshape(74, K).double()
        rel = (torch.linalg.vector_norm(dx - exact) / torch.linalg.vector_norm(exact)).item()
        record(f"{recipe}: dx = dy W in bf16, / bf16 rounding bound", err, 1.0, err <= 1.0)
        assert rel < 2.0**-7 < RMS_BOUND / 8, f"dx must be bf16's, not FP8's: relative L2 {rel:.3g}"
    else:
        _check_plumbing(f"{recipe}: dx = dy W", xi.grad.reshape(74, K), _as_quantized(dy2, act), w_for_dx.t(),
                        dy2 @ wd)
    _check_plumbing(f"{recipe}: dW = dy^T x", wi.grad, _as_quantized(dy2.t(), tokens), _as_quantized(x2.t(), tokens),
                    dy2.t() @ x2)


@pytest.mark.parametrize("mode, shape", [
    pytest.param("tensor", (37, 48), id="tensor 37x48"),
    pytest.param("tensor", (0, 32), id="tensor, no rows"),
    pytest.param("act", (200, 256), id="1x128 blocks 200x256"),
    pytest.param("act", (5, 384), id="1x128 blocks, 5 rows"),
    pytest.param("tile", (256, 384), id="128x128 tiles 256x384"),
])
def test_tile_quantizer_matches_reference(mode, shape):
    """`quantize_tiles` against the plain-PyTorch references bit for bit: the row-major copy, the
    transposed copy (zero-padded along the rows to 16, or to 128 for 1x128 blocks), and their scales."""
    x = _spread(shape, torch.bfloat16, seed=shape[0])
    q, s, qt, st = fp8_linear_kernel.quantize_tiles(x, mode, True, True)
    M, K = shape
    m_pad = fp8_linear_kernel.tile_rows(M, mode)
    xt = torch.nn.functional.pad(x.float(), (0, 0, 0, m_pad - M)).t()
    if mode == "tensor":
        (rq, rs), (cq, cs) = fp8_linear_kernel.quantize_tensor_ref(x), fp8_linear_kernel.quantize_tensor_ref(xt)
    else:
        block = (TILE, TILE) if mode == "tile" else (1, TILE)
        (rq, rs), (cq, cs) = (fp8_linear_kernel.quantize_blocks_ref(x, *block),
                              fp8_linear_kernel.quantize_blocks_ref(xt, *block))
    tag = f"{mode} {list(shape)}"
    exactly(f"{tag}: scales", s.reshape(rs.shape), rs)
    exactly(f"{tag}: q (fp8 bits)", _bits(q), _bits(rq))
    exactly(f"{tag}: transposed scales", st.reshape(cs.shape), cs)
    exactly(f"{tag}: qT (fp8 bits), zero-padded", _bits(qt), _bits(cq))


def test_tile_ops_pass_opcheck():
    x = _spread((40, 256), torch.bfloat16, seed=60)
    for mode, rows, cols in (("tensor", True, True), ("act", True, False), ("act", False, True), ("tile", True, True)):
        xx = x if mode != "tile" else _spread((128, 256), torch.bfloat16, seed=61)
        torch.library.opcheck(fp8_linear_kernel.fp8_tiles_op, (xx, mode, rows, cols, None))
    # the product's operands at 48 rows: on a GPU torch._scaled_mm (cuBLASLt) takes widths that are multiples of 16
    q, s, _, _ = fp8_linear_kernel.quantize_tiles(_spread((48, 256), torch.bfloat16, seed=62), "tensor")
    torch.library.opcheck(fp8_linear_kernel.fp8_scaled_mm_tiles_op, (q, s, q, s, False, True),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    record("opcheck: fp8_quantize_tiles (x4), fp8_scaled_mm_tiles", 0.0, 0.0, True)


def test_mx_reference_quantizer():
    """MXFP8's reference: scales are powers of two (e8m0), one per 32 values of a row, each the
    smallest that keeps its block's largest value at most 448 (so in (224, 448] after scaling); a block
    does not see its neighbours; values round to e4m3 (within 2^-4 relative, or half of e4m3's
    smallest subnormal step times the scale)."""
    x = _spread((19, 96), torch.float32, seed=70).cpu()
    x[3, 40] = 1e6  # one huge value in row 3's second block
    q, s = fp8_linear_kernel.quantize_mx_ref(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float8_e8m0fnu and s.shape == (19, 3)
    sf = s.float()
    assert torch.equal(torch.exp2(torch.log2(sf).round()), sf), "every scale is a power of two"
    amax = x.view(19, 3, 32).abs().amax(dim=2)
    live = amax > AMAX_FLOOR
    top = amax[live] / sf[live]
    assert (top <= FP8_MAX).all() and (top > FP8_MAX / 2).all(), "each block's largest value in (224, 448]"
    assert sf[3, 1] > 1e3 * sf[3, 0] and sf[3, 2] == fp8_linear_kernel.quantize_mx_ref(x[3:4, 64:])[1].float()[0, 0]
    deq = fp8_linear_kernel.dequantize_blocks(q, s)
    bound = U * x.abs() + SUB * sf.repeat_interleave(32, dim=1) * FP8_MAX / FP8_MAX
    assert ((deq - x).abs() <= bound).all(), "each value within e4m3's rounding"
    assert (deq[0] == 0).all() and (sf[0] == sf[0, 0]).all(), "an all-zero row stays zero"
    # the rounding rule at its edge: amax exactly 448 * 2^k takes 2^k, the next float above it 2^(k+1)
    edge = torch.zeros(2, 32)
    edge[0, 0], edge[1, 0] = FP8_MAX * 4, torch.nextafter(torch.tensor(FP8_MAX * 4), torch.tensor(1e9))
    assert fp8_linear_kernel.quantize_mx_ref(edge)[1].float()[:, 0].tolist() == [4.0, 8.0]
    expect_error(ValueError, fp8_linear_kernel.quantize_mx_ref, torch.ones(2, 48))
    record("MX reference: power-of-two scales per 32 values, largest value in (224, 448]", 0.0, 0.0, True)


def _tiny_layers(n, hidden=64, inter=176, heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=n,
                         num_attention_heads=heads, num_key_value_heads=1, head_dim=hidden // heads)
    return LlamaForCausalLM(config).to(DEVICE, torch.bfloat16)


def test_recipe_selection_per_layer():
    """Which layers each recipe converts: rowwise-bf16-ends keeps the first and the last 2 decoder layers
    nn.Linear (all of them when there are 4 or fewer), blockwise only layers of whole groups of four
    128x128 tiles (multiples of 512), and only the row-wise recipes share a hand-off."""
    model = _tiny_layers(6)
    assert patch_model(model, "rowwise-bf16-ends") == expected_patches(model.config, "rowwise-bf16-ends") == 2 * 7
    kinds = [type(layer.self_attn.q_proj).__name__ + "/" + type(layer.mlp.down_proj).__name__
             for layer in model.model.layers]
    assert kinds == ["Linear/Linear"] * 2 + ["Float8Linear/Float8Linear"] * 2 + ["Linear/Linear"] * 2, kinds
    assert all(m.recipe == "rowwise-bf16-ends" and m.fp8_handoff is model.fp8_handoff
               for m in model.modules() if isinstance(m, Float8Linear))
    assert patch_model(_tiny_layers(4), "rowwise-bf16-ends") == 0
    model = _tiny_layers(2)
    assert patch_model(model, "tensorwise") == 14
    assert not hasattr(model, "fp8_handoff") and all(
        m.recipe == "tensorwise" and m.fp8_handoff is None for m in model.modules() if isinstance(m, Float8Linear))
    if "blockwise" in RUNNABLE:  # patch_model refuses it on a GPU without PyTorch's block-scaled matmul
        assert patch_model(_tiny_layers(2), "blockwise") == expected_patches(model.config, "blockwise") == 0  # 64 wide
        wide = _tiny_layers(2, hidden=512, inter=1024, heads=8)
        assert patch_model(wide, "blockwise") == expected_patches(wide.config, "blockwise") == 2 * 5  # k, v: 64 wide
    record("recipes per layer: ends keep 4 of 6 layers bf16; blockwise needs 512-multiples", 0.0, 0.0, True)


@pytest.mark.parametrize("recipe", [r for r in ("rowwise-bf16-dgrad", "tensorwise", "mxfp8") if r in RUNNABLE])
def test_tiny_llama_with_recipe_close_to_bf16(recipe):
    """A whole (one-layer) model: the loss and every gradient at most 32x as far from fp32 as bf16's, as
    for the row-wise recipe."""
    base = _tiny(layers=1)
    ref = copy.deepcopy(base).float()
    ours = copy.deepcopy(base)
    # mxfp8 converts attention only: the MLP's 176 is no multiple of its 32-value blocks
    assert patch_model(ours, recipe) == expected_patches(ours.config, recipe) >= 4
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (lb, gb), (lo, go), (lr, gr) = (_loss_and_grads(m, ids) for m in (base, ours, ref))
    close_to_reference(f"{recipe}: loss", lo, lb, lr, torch.bfloat16, factor=MODEL_FACTOR)
    for name, r in gr.items():
        norm = torch.linalg.vector_norm(r).item()
        err = torch.linalg.vector_norm(go[name] - r).item() / norm
        tol = MODEL_FACTOR * torch.linalg.vector_norm(gb[name] - r).item() / norm + 2.0**-7
        assert err <= tol, f"{recipe}: {name}: relative gradient error {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "rowwise-bf16-dgrad"])
def test_recipes_compile_like_eager(recipe):
    """Where the compiled graph is trusted (the CPU), the recipes' layers trace through their custom
    operators into one graph (fullgraph=True) with eager's bits; on a GPU they run outside it."""
    if not compiled_graph_trusted(torch.device(DEVICE)):
        pytest.skip("the compiled graph is not trusted on this device: the layer runs eagerly (tested above)")
    torch._dynamo.reset()
    x = _spread((3 * 19, 512), torch.bfloat16, seed=90).view(3, 19, 512)
    w = _spread((1024, 512), torch.bfloat16, seed=91)
    dy = random_like_grad(x.new_empty(3, 19, 1024), seed=92)
    results = []
    for fn in (fp8_linear, torch.compile(fp8_linear, fullgraph=True)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, None, True, None, recipe)
        y.backward(dy)
        results.append((y, xi.grad, wi.grad))
    for what, a, b in zip(("y", "dx", "dW"), *results):
        exactly(f"{recipe}: torch.compile(fullgraph=True) == eager: {what}", b, a)


def test_the_default_recipe_says_when_it_converts_nothing(capsys):
    """rowwise-bf16-ends keeps the first and last 2 decoder layers in bf16: a model of 4 layers or fewer has
    no FP8 layer left, and apply_fp8 says so instead of running bf16 under --fp8 in silence."""
    from playbook.testkit import tiny_model

    few, many = _tiny(layers=2), tiny_model("llama", num_hidden_layers=6).to(torch.bfloat16)
    assert models.apply_fp8(few, recipe="rowwise-bf16-ends") == 0
    said = capsys.readouterr().out + capsys.readouterr().err
    assert "converted nothing" in said and "--fp8-recipe rowwise" in said, said
    converted = models.apply_fp8(many, recipe="rowwise-bf16-ends")
    assert converted == fp8_linear_kernel.expected_patches(many.config, "rowwise-bf16-ends") > 0
    said = capsys.readouterr().out
    assert "converted nothing" not in said
    # the log counts against every decoder projection (6 layers x 7), not only those the recipe converts
    assert f"FP8: {converted} of 42 decoder projections" in said and "first and last 2 decoder layers" in said, said
    record(f"rowwise-bf16-ends: 2 layers -> 0 FP8 projections and a warning; 6 layers -> {converted} of 42 logged",
           0.0, 0.0, True)


def test_bad_recipe_names_are_refused(capsys):
    from playbook.config import FP8_RECIPES

    assert FP8_RECIPES == RECIPE_NAMES, "the command line offers exactly the kernel file's recipes"
    assert _config("--fp8").fp8_recipe == "rowwise-bf16-ends"  # the command line's default (docs/fp8.md)
    assert _config("--fp8", "--fp8-recipe", "tensorwise").fp8_recipe == "tensorwise"
    expect_error(SystemExit, _config, "--fp8", "--fp8-recipe", "fp4")
    assert "invalid choice" in capsys.readouterr().err
    expect_error(SystemExit, _config, "--fp8-recipe", "tensorwise")
    assert "add --fp8" in capsys.readouterr().err
    expect_error(SystemExit, _config, "--fp8", "--fp8-backend", "torchao", "--fp8-recipe", "blockwise")
    assert "torchao" in capsys.readouterr().err
    assert "fp4" in expect_error(ValueError, patch_model, _tiny(layers=1), "fp4")
    assert "choose from" in expect_error(ValueError, fp8_linear, torch.ones(4, 32), torch.ones(16, 32), None, True,
                                         None, "fp4")
    record("--fp8-recipe: unknown names and missing --fp8 are usage errors", 0.0, 0.0, True)


def _as_gpu(monkeypatch, capability):
    """Make check_fp8_device see a CUDA device of this compute capability (nothing runs on it)."""
    probes = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(fp8_linear_kernel, "_probed", {})
    monkeypatch.setattr(fp8_linear_kernel, "_fast_accum", {})
    monkeypatch.setattr(fp8_linear_kernel, "_probe_scaled_mm", lambda device, scaling: probes.append(scaling))
    return probes


def test_blackwell_and_hopper_guards(monkeypatch):
    """Per GPU generation: Hopper runs every recipe but mxfp8 (refused, naming the MX tensor cores it
    lacks); Blackwell (sm_100, sm_103, sm_120) runs the row-wise and tensor-wise recipes with fast
    accumulation off, refuses blockwise (PyTorch's block-scaled cuBLAS path is Hopper's) and probes
    mxfp8's matmul (tests/blackwell_test.py checks each gate at every capability)."""
    cuda = torch.device("cuda", 0)
    for capability in ((9, 0), (10, 0), (10, 3), (12, 0)):
        probes = _as_gpu(monkeypatch, capability)
        for recipe in ("rowwise", "rowwise-bf16-dgrad", "tensorwise"):
            check_fp8_device(cuda, recipe)
        assert probes == ["row", "tensor"], probes  # once per scaling, then cached
        assert fp8_linear_kernel.fast_accum_allowed(cuda) == (capability < (10, 0))
        if capability < (10, 0):
            check_fp8_device(cuda, "blockwise")
            mx = expect_error(RuntimeError, check_fp8_device, cuda, "mxfp8")
            assert len(mx.splitlines()) == 1
            assert "MX block-scaled FP8 tensor cores" in mx and "sm_90" in mx
        else:
            block = expect_error(RuntimeError, check_fp8_device, cuda, "blockwise")
            assert "Hopper (sm_90) only" in block and f"sm_{capability[0]}{capability[1]}" in block
            check_fp8_device(cuda, "mxfp8")
            assert probes == ["row", "tensor", "mx"], probes
    record("guards: sm_90 all but mxfp8; sm_100/103/120 row/tensor-wise without fast accumulation, and mxfp8",
           0.0, 0.0, True)


def test_forward_fast_accumulation_follows_the_device(monkeypatch):
    """The forward matmul asks for fast accumulation only where `fast_accum_allowed` says so (not on
    Blackwell); the gradient matmuls never do."""
    flags = []
    real = fp8_linear_kernel._scaled_mm_launch
    monkeypatch.setattr(fp8_linear_kernel, "_scaled_mm_launch", lambda *a: flags.append(a[-1]) or real(*a))
    x, w = _spread((32, 64), torch.bfloat16, seed=80).requires_grad_(), _spread((48, 64), torch.bfloat16, seed=81)
    for allowed in (True, False):
        monkeypatch.setattr(fp8_linear_kernel, "fast_accum_allowed", lambda device, a=allowed: a)
        flags.clear()
        fp8_linear(x, w.requires_grad_()).sum().backward()
        assert flags == [allowed, False, False], flags


# ------------------------------------------------------------------------------ LoRA on a frozen FP8 base
# A frozen weight kept in FP8 (`Float8Linear.store_fp8_weight`): one row-scaled e4m3 copy serves the
# forward (y = x W^T) and the input gradient (dx = dy W, W's row scales folded into dy's quantization).
# Tolerances: the quantized operands equal the references bit for bit; each matmul is within the worst
# case of its two e4m3 roundings (`_frozen_bound`: per element U of the value plus SUB of its scale, for
# each operand) and the bf16 output rounding, and its relative L2 error within RMS_BOUND; models within
# MODEL_FACTOR of bf16's distance from fp32, as the other FP8 model tests.
@pytest.mark.parametrize("shape", [(37, 48), (300, 16), (9, 4096)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_rows_with_column_factors_matches_reference(shape):
    """quantize_rows(dy, col_scale=s) quantizes dy * s[None, :] (fp32 product, in registers): the same
    bits as the reference on that product, in both loops of the row kernel (9 x 4096 double-buffers)."""
    dy = _spread(shape, torch.bfloat16, seed=shape[1] + 1)
    s = (torch.rand(shape[1], generator=torch.Generator().manual_seed(shape[0])) * 2.0**-6 + 2.0**-12).to(DEVICE)
    q, scale, col_max = quantize_rows(dy, col_max=True, col_scale=s)
    rq, rs = quantize_rows_ref(dy.float() * s[None, :])
    exactly(f"{list(shape)} dy * s: row scales", scale, rs)
    exactly(f"{list(shape)} dy * s: rows (fp8 bits)", _bits(q), _bits(rq))
    exactly(f"{list(shape)} dy * s: column maxima of the product", col_max,
            (dy.float() * s).abs().amax(dim=0))
    expect_error(ValueError, quantize_rows, dy, True, False, s[:-1])


@pytest.mark.parametrize("shape", [(48, 64), (300, 17), (1, 1), (0, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_transpose_bytes_matches_pytorch(shape):
    """The transposing copy of a stored FP8 weight: the bytes of PyTorch's q.t().contiguous(), for tiles
    cut at both edges, one element and no rows."""
    q = _spread(shape, torch.bfloat16, seed=sum(shape)).to(FP8_DTYPE)
    qt = fp8_linear_kernel.transpose_bytes(q)
    assert qt.dtype == FP8_DTYPE and qt.shape == shape[::-1] and qt.is_contiguous()
    exactly(f"{list(shape)}: transposed bytes", _bits(qt), _bits(q).t().contiguous())
    expect_error(ValueError, fp8_linear_kernel.transpose_bytes, q.float())


def _stored(w: torch.Tensor, recipe: str = "rowwise") -> Float8Linear:
    """A Float8Linear around a frozen copy of w, its weight kept in FP8."""
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = Float8Linear.from_linear(linear.requires_grad_(False), keep_fp8_input=True, recipe=recipe)
    layer.store_fp8_weight()
    return layer


def _frozen_bound(a, b, e_a, e_b, out):
    """Worst-case |error| of each element of a @ b.T when each operand value v is replaced by v' with
    |v' - v| <= e (e_a, e_b: elementwise bounds shaped like a and b): (a' b' - a b) = (a' - a) b +
    a (b' - b) + (a' - a)(b' - b) summed over the reduction, plus the bf16 output's rounding (2^-8 of
    itself) and fp32 sums (n 2^-24 of the sum of |a b|, or `ACC` on a GPU)."""
    a, b, e_a, e_b = a.double(), b.double(), e_a.double(), e_b.double()
    n = a.shape[1]
    return (e_a @ b.abs().t() + a.abs() @ e_b.t() + e_a @ e_b.t() + 2.0**-8 * out.double().abs()
            + n * ACC * ((a.abs() + e_a) @ (b.abs() + e_b).t()))


def _check_frozen(tag, ours, a, b, a_deq, b_deq, e_a, e_b):
    """ours ~ a @ b.T: against the dequantized operands (rule 1 of the module docstring), against the exact
    product within `_frozen_bound`, and its relative L2 error within RMS_BOUND."""
    n = a.shape[1]
    plumbing = a_deq @ b_deq.t()
    bound = 2.0**-8 * plumbing.abs() + (1 + 2.0**-8) * n * ACC * (a_deq.abs() @ b_deq.abs().t())
    ratio = _worst_ratio((ours.double() - plumbing).abs(), bound)
    record(f"{tag}: vs dequantized operands, / bound", ratio, 1.0, ratio <= 1.0)
    exact = a.double() @ b.double().t()
    ratio = _worst_ratio((ours.double() - exact).abs(), _frozen_bound(a, b, e_a, e_b, ours))
    record(f"{tag}: vs exact, / worst case of two e4m3 roundings", ratio, 1.0, ratio <= 1.0)
    rel = (torch.linalg.vector_norm(ours.double() - exact) / torch.linalg.vector_norm(exact)).item()
    record(f"{tag}: relative L2 error", rel, RMS_BOUND, rel <= RMS_BOUND)


def test_frozen_fp8_weight_forward_and_input_gradient():
    """74 tokens, 64 -> 48 features, bf16: the weight kept as 1 byte per value plus one fp32 scale per
    row (the bf16 copy gone), y = x W^T and dx = dy W from it, each within e4m3's worst case; backward
    keeps only the stored weight and its scales, and W gets no gradient."""
    x = _spread((74, 64), torch.bfloat16, seed=40).view(2, 37, 64)
    w = _spread((48, 64), torch.bfloat16, seed=41)
    dy = random_like_grad(x.new_empty(2, 37, 48), seed=42)
    layer = _stored(w)
    assert layer.weight.dtype == FP8_DTYPE and not layer.weight.requires_grad and layer.stores_fp8()
    assert layer.weight.untyped_storage().nbytes() == 48 * 64 and layer.weight_scale.shape == (48,)
    assert set(dict(layer.named_parameters())) == {"weight"} and set(dict(layer.named_buffers())) == {"weight_scale"}
    wq, ws = quantize_rows_ref(w)
    exactly("stored weight == W quantized per row (fp8 bits)", _bits(layer.weight), _bits(wq))
    exactly("stored scales == W's row scales", layer.weight_scale, ws)
    xi = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(xi)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(FP8_DTYPE, (48, 64)), (torch.float32, (48,))]
    assert saved[0].data_ptr() == layer.weight.data_ptr(), "backward keeps the stored weight itself, not a copy"
    y.backward(dy)
    assert y.dtype == xi.grad.dtype == torch.bfloat16 and layer.weight.grad is None
    x2, dy2 = x.reshape(74, 64), dy.reshape(74, 48)
    w_deq = wq.double() * ws.double()[:, None]
    s_x = quantize_rows_ref(x2)[1].double()[:, None]
    e_w = U * w.double().abs() + SUB * ws.double()[:, None]  # W per row, in W's units
    _check_frozen("frozen W, y = x W^T", y.reshape(74, 48), x2, w, _dequant_rows(x2), w_deq,
                  U * x2.double().abs() + SUB * s_x, e_w)
    # dx = (dy s) q: dy's error in its own units is that of dy * s, divided by s (s: W's row scales)
    dyq, sdy = quantize_rows_ref(dy2.float() * ws[None, :])
    dy_deq = dyq.double() * sdy.double()[:, None] / ws.double()[None, :]
    e_dy = U * dy2.double().abs() + SUB * sdy.double()[:, None] / ws.double()[None, :]
    _check_frozen("frozen W, dx = dy W", xi.grad.reshape(74, 64), dy2, w.t(), dy_deq, w_deq.t(), e_dy, e_w.t())


def test_frozen_fp8_weight_bf16_dgrad_recipe_and_refusals():
    """rowwise-bf16-dgrad: dx = dy W as a bf16 matmul of dy and the dequantized stored weight; a trained
    weight, a block-scaled recipe and a stored weight twice are refused or left alone."""
    x = _spread((33, 32), torch.bfloat16, seed=43).requires_grad_()
    w = _spread((16, 32), torch.bfloat16, seed=44)
    dy = random_like_grad(x.new_empty(33, 16), seed=45)
    layer = _stored(w, "rowwise-bf16-dgrad")
    layer(x).backward(dy)
    w_deq = (layer.weight.float() * layer.weight_scale[:, None]).to(torch.bfloat16)
    exactly("rowwise-bf16-dgrad: dx == dy @ dequantized W (bf16)", x.grad, dy @ w_deq)
    before = layer.weight
    layer.store_fp8_weight()
    assert layer.weight is before, "storing twice changes nothing"
    trained = Float8Linear.from_linear(nn.Linear(32, 16).to(DEVICE, torch.bfloat16))
    assert "frozen" in expect_error(ValueError, trained.store_fp8_weight)
    tiles = Float8Linear.from_linear(nn.Linear(512, 512).to(DEVICE, torch.bfloat16).requires_grad_(False),
                                     recipe="blockwise")
    assert "row-wise" in expect_error(ValueError, tiles.store_fp8_weight)
    record("frozen FP8 weight: bf16-dgrad recipe, refusals", 0.0, 0.0, True)


def test_frozen_fp8_weight_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) of the layer on the CPU (where the compiled graph is trusted): no
    graph break, so no host sync (`.item()`) in the forward or the input gradient; the same bits as eager."""
    if not compiled_graph_trusted(torch.device(DEVICE)):
        pytest.skip("the compiled FP8 graph is not trusted on this device (compiled_graph_trusted)")
    torch._dynamo.reset()
    layer = _stored(_spread((48, 64), torch.bfloat16, seed=46))
    x = _spread((3, 19, 64), torch.bfloat16, seed=47)
    dy = random_like_grad(x.new_empty(3, 19, 48), seed=48)
    compiled = torch.compile(lambda t: fp8_linear_kernel.fp8_frozen_linear(t, layer.weight, layer.weight_scale),
                             fullgraph=True)
    results = []
    for fn in (layer, compiled):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(dy)
        results.append((y, xi.grad))
    for what, a, b in zip(("y", "dx"), *results):
        exactly(f"frozen FP8 weight, torch.compile(fullgraph=True) == eager: {what}", b, a)


def _lora_config(*argv):
    return _config("--model", "llama-tiny", "--lora-r", "4", "--seq-len", "32", *argv)


# --fp8 for LoRA on the FP8 base in these tests: the row-wise recipe, every projection (on a GPU the size
# rule, --fp8-layers auto, would keep all of llama-tiny's narrow projections bf16; the CPU converts all)
FP8_BASE = ("--fp8", "--fp8-recipe", "rowwise", "--fp8-layers", "all")


def _bytes(model) -> int:
    """Bytes of every distinct storage the model's parameters and buffers live in."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def test_lora_fp8_base_keeps_one_byte_per_weight(capsys):
    """prepare_model with --lora-r --fp8: every decoder projection's weight is float8_e4m3fn (1 byte per
    value, plus 4 per row for its scale), no bf16 copy of it is left anywhere (the Parameters it replaced
    are freed), and the model's parameters and buffers take exactly those bytes."""
    import gc
    import weakref

    base = _tiny(layers=2)
    originals = [weakref.ref(p) for n, p in base.named_parameters() if "_proj" in n]
    n_proj = sum(p().numel() for p in originals)
    model = models.prepare_model(_lora_config(*FP8_BASE), model=base)[0]
    logged = capsys.readouterr().out
    assert "FP8 base: 14 frozen projection weights kept in FP8" in logged, logged[-2000:]
    gc.collect()
    alive = [r() for r in originals if r() is not None]
    assert not alive, f"{len(alive)} bf16 projection weights are still held"
    stored = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(stored) == 14 and all(m.weight.dtype == FP8_DTYPE and m.weight.element_size() == 1 for m in stored)
    rows = sum(m.weight.shape[0] for m in stored)
    others = sum(t.numel() * t.element_size() for n, t in (*model.named_parameters(), *model.named_buffers())
                 if "base_layer" not in n)  # embeddings, norms, lm_head, adapters; the rotary frequencies
    assert _bytes(model) == others + n_proj + 4 * rows, (_bytes(model), others, n_proj, rows)
    bf16 = _bytes(models.prepare_model(_lora_config(), model=_tiny(layers=2))[0])
    record(f"parameters and buffers: {_bytes(model):,} B with the FP8 base, {bf16:,} B with bf16 "
           f"(projections {n_proj:,} values: 1 B each + 4 B per row)", 0.0, 0.0, _bytes(model) == bf16 - n_proj + 4 * rows)


def test_fp8_layers_all_forces_every_projection_into_the_fp8_base():
    """The size rule (sizes="auto", --fp8-layers auto on a GPU) keeps llama-tiny's projections (all
    narrower than FP8_MIN_WIDTH) bf16, and none of their weights is then kept in FP8; "all" (the CPU's
    choice, and --fp8-layers all) converts and stores all 14."""
    from playbook.lora import apply_lora

    for sizes, expected in (("auto", 0), ("all", 14)):
        model = _tiny(layers=2)
        assert patch_model(model, "rowwise", sizes=sizes) == expected
        model = apply_lora(model, r=4)
        assert models.apply_fp8_base(model) == expected
        weights = [p for n, p in model.named_parameters() if "base_layer.weight" in n]
        assert sum(p.dtype == FP8_DTYPE for p in weights) == expected and len(weights) == 14
    record("--fp8-layers auto: tiny projections stay bf16; all: 14 weights kept in FP8", 0.0, 0.0, True)


def _lora_models(fused: bool):
    """The same 1-layer llama-tiny with LoRA r=4 on all seven projections: fp32 (the reference), bf16, and
    bf16 on the frozen FP8 base; the adapters equal in all three, B not zero (peft starts it at zero)."""
    kernels = "default" if fused else "none"
    built = []
    for argv, dtype in (((), torch.float32), ((), torch.bfloat16), (FP8_BASE, torch.bfloat16)):
        cfg = _lora_config("--kernels", kernels, *argv)
        built.append(models.prepare_model(cfg, model=_tiny(layers=1, dtype=dtype))[0])
    g = torch.Generator().manual_seed(50)
    with torch.no_grad():
        for name, p in built[0].named_parameters():
            if "lora_" in name:
                value = torch.randn(p.shape, generator=g) * (0.1 if "lora_B" in name else 1.0) / p.shape[1] ** 0.5
                for model in built:
                    dict(model.named_parameters())[name].copy_(value)
    return built


@pytest.mark.parametrize("fused", [True, False], ids=["fused LoRA path", "peft's path"])
def test_lora_on_fp8_base_close_to_bf16_lora(fused, monkeypatch):
    """Loss and adapter gradients of LoRA on the FP8 base, against the fp32 model: at most MODEL_FACTOR
    times as far as bf16 LoRA's (plus one bf16 ulp, relative), through lora_kernel's fused functions
    and through peft's own forward (Float8FrozenLinearFunction); only the adapters get gradients, and
    the 7 projections run their forward (and the 4 whose input needs a gradient their dx) from the
    stored FP8 weights."""
    ref, bf16, ours = _lora_models(fused)
    calls = []
    for name in ("frozen_forward", "frozen_input_grad"):
        real = getattr(fp8_linear_kernel, name)
        monkeypatch.setattr(fp8_linear_kernel, name, lambda *a, n=name, f=real: calls.append(n) or f(*a))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(51)).to(DEVICE)
    runs = []
    for model in (ref, bf16, ours):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach().float(), {n: p.grad.double() for n, p in model.named_parameters()
                                             if p.grad is not None}))
    (lr, gr), (lb, gb), (lo, go) = runs
    # q/k/v of the first layer read the normed frozen embeddings: nothing upstream needs their dx
    assert calls.count("frozen_forward") == 7 and calls.count("frozen_input_grad") == 4, calls
    with_grad = set(go)
    assert with_grad == {n for n, _ in ours.named_parameters() if "lora_" in n} and len(with_grad) == 14, sorted(go)
    close_to_reference("loss, LoRA on the FP8 base", lo, lb, lr, torch.bfloat16, factor=MODEL_FACTOR)
    worst = (None, 0.0, 1.0)
    for name in with_grad:
        r = gr[name]
        norm = torch.linalg.vector_norm(r).item()
        err = torch.linalg.vector_norm(go[name] - r).item() / norm
        tol = MODEL_FACTOR * torch.linalg.vector_norm(gb[name] - r).item() / norm + 2.0**-7
        assert err <= tol, f"{name}: relative gradient error {err:.3e} > {tol:.3e}"
        if err / tol > worst[1] / worst[2]:
            worst = (name, err, tol)
    record(f"adapter gradients ({'fused' if fused else 'peft'}), worst of 14: {worst[0]}", worst[1], worst[2], True)


def test_finetune_optimized_lora_on_fp8_base(tmp_path, capsys):
    """`finetune_optimized.py --model llama-tiny --lora-r 4 --fp8 --fp8-recipe rowwise --fp8-layers all
    --steps 3 --output-dir DIR`, in this process: three finite steps; the adapter it saves loads with peft's
    AutoPeftModelForCausalLM on the bf16 base (the same adapter tensors); the run resumes from its
    checkpoint on the bf16 base (without --fp8: the checkpoint's base fingerprint is the bf16 weights');
    --merge-lora (and --load-in-4bit) are refused before training, and merge_and_save on an FP8 base
    says why."""
    import json

    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file
    from playbook.lora import merge_and_save

    out = tmp_path / "run"
    run = ["--model", "llama-tiny", "--lora-r", "4", "--output-dir", str(out), "--overwrite"]
    fp8 = FP8_BASE
    tag = "test_lora_fp8_base"
    try:
        result = training.train(_config(*run, *fp8, "--steps", "3", "--tag", tag))
        logged = capsys.readouterr().out
        resumed = training.train(_config(*run, "--steps", "4", "--resume", str(out), "--tag", tag + "_resumed"))
    finally:
        for name in (tag, tag + "_resumed"):
            for suffix in (".json", ".png", ".metrics.jsonl"):
                (common.RESULTS_DIR / f"{name}{suffix}").unlink(missing_ok=True)
    assert "FP8 base: 14 frozen projection weights kept in FP8" in logged, logged[-2000:]
    assert len(result["losses"]) == 3 and all(math.isfinite(v) for v in result["losses"])
    assert len(resumed["losses"]) == 4 and resumed["losses"][:3] == result["losses"]
    ckpt = out / "checkpoint-3"
    saved = load_file(ckpt / "adapter_model.safetensors")
    assert saved and all("lora_" in k and v.dtype == torch.float32 for k, v in saved.items())
    # AutoPeft loads the base its adapter_config.json names: here the bf16 preset, written to a directory
    base_dir = tmp_path / "base"
    models.build_preset("llama-tiny", None, torch.device("cpu"), torch.bfloat16).save_pretrained(base_dir)
    config_file = ckpt / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = str(base_dir)
    config_file.write_text(json.dumps(config))
    loaded = AutoPeftModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    state = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    assert loaded.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    capsys.readouterr()
    expect_error(SystemExit, _config, *run, *fp8, "--merge-lora")
    assert "kept in FP8" in capsys.readouterr().err
    expect_error(SystemExit, _config, *run, *fp8, "--load-in-4bit")  # two quantized bases: one is chosen
    assert "choose one" in capsys.readouterr().err
    stored = models.prepare_model(_lora_config(*fp8), model=_tiny(layers=1))[0]
    assert "kept in FP8" in expect_error(RuntimeError, merge_and_save, stored, tmp_path / "merged")
    record(f"--lora-r 4 --fp8: losses {[round(v, 3) for v in result['losses']]}; adapter loads on the bf16 base; "
           "resumes there; --merge-lora refused", 0.0, 0.0, True)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "FP8 linear layers: test report"))
