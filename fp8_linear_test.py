"""Tests of the row-wise FP8 linear layers (fp8_linear_kernel.py): the quantizing kernels against PyTorch bit
for bit, the three FP8 matmuls against float64 within e4m3's rounding, what backward keeps, and a tiny LLaMA
patched, trained, and run through `finetune_optimized.py --fp8`. The other FP8 lessons' tests
(fp8_recipes_test.py, fp8_producers_test.py, fp8_lora_test.py) use the helpers and tolerances defined here.

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
     worst case of rounding both operands to e4m3 (derived in `e4m3_bound`).
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

from playbook.model import registry as ak
from playbook.store.files import RESULTS_DIR
from playbook.model import models
from playbook.run import training
from playbook.config import make_parser, parse_config
from core.kernel_utils import DEVICE
from testkit import close_to_reference, exactly, expect_error, random_like_grad, record, run_as_script
from playbook.optim.optimizer import make_optimizer
from playbook.run.start import make_run_data
import fp8_linear_kernel
from fp8_linear_kernel import (AMAX_FLOOR, FP8_DTYPE, FP8_MAX, Float8Linear, check_fp8_device, compiled_graph_trusted,
                               expected_patches, fp8_cols_op, fp8_linear, fp8_rows_op, fp8_scaled_mm_op, ideal_bytes,
                               padded, patch_model, quantize, quantize_cols_ref, quantize_rows_ref)

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


def spread(shape, dtype, seed=0):
    """Values over many binades, and row 0 all zeros (the scale's floor): not a plain randn."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if len(shape) == 2 and shape[0] > 1:
        x = x * torch.logspace(-4, 3, shape[0])[:, None]
        x[0] = 0
    return x.to(device=DEVICE, dtype=dtype)


def bits(t):
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
    x = spread(shape, dtype)
    q, s, qt, st = quantize(x, rows=True, cols=True)
    rq, rs = quantize_rows_ref(x)
    cq, cs = quantize_cols_ref(x)
    assert qt.shape == (shape[1], padded(shape[0])) and qt.is_contiguous()
    exactly(f"{list(shape)} {str(dtype)[6:]}: row scales", s, rs)
    exactly(f"{list(shape)} {str(dtype)[6:]}: rows (fp8 bits)", bits(q), bits(rq))
    exactly(f"{list(shape)} {str(dtype)[6:]}: column scales", st, cs)
    exactly(f"{list(shape)} {str(dtype)[6:]}: columns, transposed and zero-padded", bits(qt), bits(cq))


# Shapes that take each launch setting of `row_launch` on a GPU (rows of 1024, 4096 and 14336 values, as
# in LLaMA 3.1 8B, 6144 and 28672, the joined q/k/v's and gate/up's output gradients; the double-buffered
# loop for 4096 to 14336 and the single one for the others; with row counts that
# leave the last loop iteration of a program partly filled); the interpreter, which runs its own
# settings, gets small stand-ins of the same row widths.
LAUNCH_SHAPES = ([(8190, 1024), (4100, 4096), (2050, 6144), (1030, 14336), (1030, 28672)] if DEVICE.type == "cuda"
                 else [(35, 1024), (9, 4096), (5, 6144), (5, 14336), (3, 28672)])


@pytest.mark.parametrize("shape", LAUNCH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_matches_reference_at_launch_shapes(shape):
    x = spread(shape, torch.bfloat16, seed=shape[1])
    q, s, qt, st = quantize(x, rows=True, cols=True)
    rq, rs = quantize_rows_ref(x)
    cq, cs = quantize_cols_ref(x)
    exactly(f"{list(shape)}: row scales", s, rs)
    exactly(f"{list(shape)}: rows (fp8 bits)", bits(q), bits(rq))
    exactly(f"{list(shape)}: column scales", st, cs)
    exactly(f"{list(shape)}: columns, transposed and zero-padded", bits(qt), bits(cq))


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
    x = spread((70, 64), torch.bfloat16, seed=3)
    both = quantize(x, True, True)
    rows, cols = quantize(x, True, False), quantize(x, False, True)
    exactly("rows alone == rows of both", bits(rows[0]), bits(both[0]))
    exactly("columns alone == columns of both", bits(cols[2]), bits(both[2]))
    assert rows[2].numel() == cols[0].numel() == 0


def test_rounding_of_every_e4m3_value_and_midpoint():
    """A row holding 448 has scale 1, so the kernel's output is its own rounding of the other values:
    every finite e4m3 value, every midpoint between neighbours (ties: to even), one fp32 ulp either
    side of each midpoint, and -0.0, must round as PyTorch's cast rounds them, per row and per column."""
    grid = bits(torch.arange(256, dtype=torch.uint8)).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([torch.tensor([FP8_MAX, -0.0]), grid, mids, torch.nextafter(mids, mids + 1),
                        torch.nextafter(mids, mids - 1)])
    expected = values.to(FP8_DTYPE)
    x = values[None, :].to(DEVICE)
    q, s, _, _ = quantize(x, rows=True)
    _, _, qt, st = quantize(x.t().contiguous(), rows=False, cols=True)
    assert s.item() == st.item() == 1.0
    exactly(f"{values.numel()} values rounded per row", bits(q[0]).cpu(), bits(expected))
    exactly(f"{values.numel()} values rounded per column", bits(qt[0, :values.numel()]).cpu(), bits(expected))


def test_zero_rows_stay_zero():
    x = torch.zeros(3, 32, device=DEVICE, dtype=torch.bfloat16)
    q, s, qt, st = quantize(x, True, True)
    assert q.float().abs().max() == 0 and qt.float().abs().max() == 0
    exactly("all-zero rows: scale is the floor / 448", s, torch.full_like(s, AMAX_FLOOR / FP8_MAX))


def test_custom_ops_pass_opcheck():
    """Schema, fake implementations (shapes and dtypes of every output) and AOT dispatch."""
    x = spread((37, 48), torch.bfloat16, seed=2)
    for write_rows, col_max in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(fp8_rows_op, (x, write_rows, col_max))
    torch.library.opcheck(fp8_rows_op, (x[:0], True, True))  # no rows
    torch.library.opcheck(fp8_rows_op, (x.float()[::2], True, True))  # strided rows
    torch.library.opcheck(fp8_rows_op, (x, True, False, torch.rand(48, device=DEVICE)))  # times column factors
    cmax = fp8_rows_op(x, False, True)[2]
    torch.library.opcheck(fp8_cols_op, (x, cmax))
    torch.library.opcheck(fp8_cols_op, (x[:0], torch.zeros_like(cmax)))
    xq, sx, _ = fp8_rows_op(x, True, False)
    wq, sw, _ = fp8_rows_op(spread((32, 48), torch.bfloat16, seed=3), True, False)
    # Without "test_schema": its mutation check compares the fp8 inputs with arithmetic that PyTorch
    # does not implement for float8_e4m3fn on the CPU; the fake, AOT and dispatch checks all run.
    for fast_accum in (True, False):
        torch.library.opcheck(fp8_scaled_mm_op, (xq, sx, wq, sw, fast_accum),
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    record("opcheck: fp8_quantize_rows (x6), fp8_quantize_cols (x2), fp8_scaled_mm (x2)", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------ the linear layer
def dequant_rows(t):
    q, s = quantize_rows_ref(t)
    return q.double() * s.double()[:, None]


def dequant_cols(t):
    qt, s = quantize_cols_ref(t)
    return (qt.double() * s.double()[:, None])[:, :t.shape[0]].t()


def e4m3_bound(a, b, exact, out):
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


def worst_ratio(err, bound) -> float:
    """max of err / bound, elementwise (0 where err is 0: rows of zeros must come out exactly 0)."""
    return torch.where(err == 0, 0.0, err / bound).max().item() if err.numel() else 0.0


def check_matmul(tag, ours, a, b, a_deq, b_deq):
    """ours ~ a @ b.T, where a_deq, b_deq are the operands as the FP8 matmul sees them (dequantized).

    Rule 1, element by element: ours is the dequantized product summed with fp32 (or, on a GPU, the
    FP8 tensor cores') accumulation, then rounded to bf16 (at most 2^-8 of itself, 8 significant bits).
    That bound is tight: among thousands of outputs some round by nearly 2^-8, so ratios just under 1
    are the bf16 rounding itself, and anything above 1 is a bug.
    """
    n = a.shape[1]
    plumbing = a_deq @ b_deq.t()
    bound = 2.0**-8 * plumbing.abs() + (1 + 2.0**-8) * n * ACC * (a_deq.abs() @ b_deq.abs().t())
    ratio = worst_ratio((ours.double() - plumbing).abs(), bound)
    record(f"{tag}: vs dequantized operands, / bound", ratio, 1.0, ratio <= 1.0)
    exact = a.double() @ b.double().t()
    ratio = worst_ratio((ours.double() - exact).abs(), e4m3_bound(a, b, exact, ours))
    record(f"{tag}: vs exact, / worst case of e4m3", ratio, 1.0, ratio <= 1.0)
    rel = (torch.linalg.vector_norm(ours.double() - exact) / torch.linalg.vector_norm(exact)).item()
    record(f"{tag}: relative L2 error", rel, RMS_BOUND, rel <= RMS_BOUND)


def run_linear(x, w, dy, keep, grad_x=True, grad_w=True, bias=None):
    xi = x.detach().clone().requires_grad_(grad_x)
    wi = w.detach().clone().requires_grad_(grad_w)
    y = fp8_linear(xi, wi, bias, keep_fp8_input=keep)
    y.backward(dy)
    return y, xi.grad, wi.grad


@pytest.mark.parametrize("keep", [True, False], ids=["fp8 input kept", "bf16 input kept"])
def test_linear_forward_and_gradients(keep):
    """74 tokens (not a multiple of 16: the transposed copies are padded), 64 -> 48 features, bf16."""
    x = spread((74, 64), torch.bfloat16, seed=4).view(2, 37, 64)
    w = spread((48, 64), torch.bfloat16, seed=5)
    dy = random_like_grad(x.new_empty(2, 37, 48), seed=6)
    y, dx, dw = run_linear(x, w, dy, keep)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16 and y.shape == (2, 37, 48)
    x2, dy2 = x.reshape(74, 64), dy.reshape(74, 48)
    check_matmul("y = x W^T", y.reshape(74, 48), x2, w, dequant_rows(x2), dequant_rows(w))
    check_matmul("dx = dy W", dx.reshape(74, 64), dy2, w.t(), dequant_rows(dy2), dequant_cols(w).t())
    check_matmul("dW = dy^T x", dw, dy2.t(), x2.t(), dequant_cols(dy2).t(), dequant_cols(x2).t())


def test_what_backward_keeps():
    """Exactly the tensors the class docstring lists: the weight Parameter itself and its column
    maxima, and x's transposed FP8 copy with its scales (or x itself and its column maxima, or nothing
    of x when the weight is frozen)."""
    M, K, N = 40, 64, 32
    x = spread((M, K), torch.bfloat16, seed=7)
    w = nn.Parameter(spread((N, K), torch.bfloat16, seed=8))

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



def test_frozen_weight_and_frozen_input():
    """A gradient not asked for is not computed, and the others are the same bits as with both."""
    x = spread((33, 32), torch.bfloat16, seed=9)
    w = spread((16, 32), torch.bfloat16, seed=10)
    dy = random_like_grad(x.new_empty(33, 16), seed=11)
    both = run_linear(x, w, dy, True)
    frozen_w = run_linear(x, w, dy, True, grad_w=False)
    frozen_x = run_linear(x, w, dy, True, grad_x=False)
    assert frozen_w[2] is None and frozen_x[1] is None
    exactly("frozen weight (LoRA): dx unchanged", frozen_w[1], both[1])
    exactly("frozen input: dW unchanged", frozen_x[2], both[2])


def test_strided_input_bias_and_empty_batch():
    base = spread((24, 128), torch.bfloat16, seed=12)
    w = spread((32, 64), torch.bfloat16, seed=13)
    b = spread((32,), torch.bfloat16, seed=14)
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
    x = spread((20, 32), torch.bfloat16, seed=15)
    x[3, 5] = float("nan")
    q, s, qt, st = quantize(x, True, True)
    rq, rs = quantize_rows_ref(x)
    cq, cs = quantize_cols_ref(x)
    assert q[3, 5].isnan() and qt[5, 3].isnan() and q.float().isnan().sum() == qt.float().isnan().sum() == 1
    exactly("scales with a NaN in x (row and column)", torch.cat([s, st]), torch.cat([rs, cs]))
    exactly("the other FP8 values", q.float().nan_to_num(7.0), rq.float().nan_to_num(7.0))
    y = fp8_linear(x, spread((16, 32), torch.bfloat16, seed=16))
    assert y[3].isnan().all() and y[torch.arange(20) != 3].isfinite().all()
    record("a NaN input: its output row is NaN, the others finite", 0.0, 0.0, True)


def test_second_order_gradients_raise():
    x = spread((16, 32), torch.float32, seed=17).requires_grad_()
    w = spread((16, 32), torch.float32, seed=18)
    y = fp8_linear(x, w)
    msg = expect_error(RuntimeError, lambda: torch.autograd.grad(y, x, random_like_grad(y), create_graph=True))
    assert "second-order" in msg


def _compiled_and_eager(compiled, seed=19):
    x = spread((3, 19, 64), torch.bfloat16, seed=seed)
    w = spread((48, 64), torch.bfloat16, seed=seed + 1)
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
    x = spread((3, 19, 64), torch.bfloat16, seed=5)
    w = spread((48, 64), torch.bfloat16, seed=6)
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
def tiny_llama(layers=1, dtype=torch.bfloat16, **overrides):
    model = models.build_preset("llama-tiny", layers, DEVICE, dtype)
    for name, value in overrides.items():
        setattr(model.config, name, value)
    model.config.use_cache = False
    return model


def test_patch_model_converts_the_decoder_projections():
    model = tiny_llama(layers=2, dtype=torch.float32)
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

    model = tiny_llama(layers=1)
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
    from playbook.model.lora import apply_lora
    from lora_kernel import fuse_lora_layers

    model = tiny_llama(layers=1)
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


def loss_and_grads(model, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.double() for n, p in model.named_parameters()}


def test_tiny_llama_loss_and_gradients_close_to_bf16():
    """Same inputs through a bf16 model, its FP8-patched copy and an fp32 copy (the reference): the FP8
    loss and every parameter's gradient (relative L2) at most 32x as far from fp32 as bf16's."""
    base = tiny_llama(layers=1)
    ref = copy.deepcopy(base).float()
    ours = copy.deepcopy(base)
    patch_model(ours)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (lb, gb), (lo, go), (lr, gr) = (loss_and_grads(m, ids) for m in (base, ours, ref))
    close_to_reference("loss (fp32 logits)", lo, lb, lr, torch.bfloat16, factor=MODEL_FACTOR)
    worst = gradients_close(go, gb, gr, gr)
    record(f"gradients, worst of {len(gr)}: {worst[0]}", worst[1], worst[2], True)


def gradients_close(ours: dict, bf16: dict, ref: dict, names) -> tuple:
    """Each named gradient of `ours` within MODEL_FACTOR times the bf16 model's relative error against the fp32
    reference, plus one bf16 ulp, relative (testkit's allowance for a single rounding flip); returns the worst
    (name, error, tolerance)."""
    worst = (None, 0.0, 1.0)
    for name in names:
        r = ref[name]
        norm = torch.linalg.vector_norm(r).item()
        err = torch.linalg.vector_norm(ours[name] - r).item() / norm
        tol = MODEL_FACTOR * torch.linalg.vector_norm(bf16[name] - r).item() / norm + 2.0**-7
        assert err <= tol, f"{name}: relative gradient error {err:.3e} > {tol:.3e}"
        if err / tol > worst[1] / worst[2]:
            worst = (name, err, tol)
    return worst



def run_config(*argv):
    return parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized", list(argv))


STEPS = 3


def train_tiny(fp8: bool, dtype: torch.dtype):
    cfg = run_config("--kernels", "none", "--batch-size", "2", "--seq-len", "32", "--data", TEXT, "--lr", "1e-2",
                  "--steps", str(STEPS))
    model = tiny_llama(layers=1, dtype=dtype)
    model.train()
    if fp8:
        patch_model(model)
    opt = make_optimizer(model, cfg.training, cfg.run)
    data = make_run_data(cfg, model, None)
    return torch.stack([training.training_step(model, opt, [data.batch(i, DEVICE)])[0].float() for i in range(STEPS)])


def test_training_loss_falls_as_in_bf16():
    """Three AdamW steps on real text (a high learning rate, so that the loss falls within them): the
    FP8 model's loss at every step within 32x the bf16 model's distance from the fp32 model's (plus one
    bf16 ulp of the loss), so it falls as the bf16 loss does."""
    ref, base, ours = train_tiny(False, torch.float32), train_tiny(False, torch.bfloat16), train_tiny(True, torch.bfloat16)
    assert ref[-1] < ref[0] - 0.5, f"the tiny model should learn the text (else the test is vacuous): {ref.tolist()}"
    close_to_reference(f"loss at each of {STEPS} steps", ours, base, ref, torch.bfloat16, factor=MODEL_FACTOR)
    record(f"loss {ours[0]:.3f} -> {ours[-1]:.3f} (bf16: {base[0]:.3f} -> {base[-1]:.3f})", 0.0, 0.0, True)


def test_fp8_flag_is_parsed():
    assert run_config().model.fp8 is False
    assert run_config("--fp8").model.fp8 is True
    assert "--fp8" in make_parser("test", kernels_default=ak.DEFAULT_KERNELS).format_help()
    record("--fp8: off by default, RunConfig.fp8 when given", 0.0, 0.0, True)


def test_fp8_backend_flag(capsys):
    assert run_config("--fp8").model.fp8_backend == "playbook"
    assert run_config("--fp8", "--fp8-backend", "torchao").model.fp8_backend == "torchao"
    expect_error(SystemExit, run_config, "--fp8-backend", "torchao")  # without --fp8: nothing to choose
    assert "add --fp8" in capsys.readouterr().err
    record("--fp8-backend: playbook by default; torchao only with --fp8", 0.0, 0.0, True)


def test_torchao_backend_without_torchao_says_so(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    msg = expect_error(SystemExit, ak.apply_fp8, tiny_llama(layers=1), "torchao")
    assert "pip install torchao" in msg
    record("--fp8-backend torchao without torchao: one line naming the package", 0.0, 0.0, True)


def test_torchao_backend_converts_the_same_projections():
    pytest.importorskip("torchao.float8")
    model = tiny_llama(layers=2)
    assert ak.apply_fp8(model, "torchao", compiled=True) == 14  # 7 per layer; lm_head left alone
    assert type(model.lm_head) is nn.Linear
    record("--fp8-backend torchao: the 7 projections per layer, not the lm_head", 0.0, 0.0, True)


def test_finetune_optimized_with_fp8_runs():
    """What `python finetune_optimized.py --fp8 --num-layers 1 --steps 2 ...` runs, in this process: the
    script's default kernels, then the FP8 patch (logged with its count), two steps with finite losses."""
    tag = "test_fp8_cpu"
    cfg = run_config("--fp8", "--fp8-recipe", "rowwise", "--fp8-layers", "all", "--model", "llama-tiny", "--num-layers", "1",
                  "--steps", "2", "--timing-warmup-steps", "1",
                  "--batch-size", "1", "--seq-len", "16", "--tag", tag, "--overwrite")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result = training.train(cfg)
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)
    assert "FP8: 7 of 7 decoder projections" in out.getvalue(), out.getvalue()[-2000:]
    assert len(result["losses"]) == 2 and all(math.isfinite(v) for v in result["losses"])
    record(f"finetune_optimized --fp8: 7 projections, losses {[round(v, 3) for v in result['losses']]}", 0.0, 0.0,
           True)



if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "FP8 linear layers: test report"))
