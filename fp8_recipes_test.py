"""Tests of the FP8 recipes (fp8_recipes_kernel.py): every `--fp8-recipe` (its quantizers bit for bit, its
matmuls against its own dequantized operands, which layers it converts), MXFP8's reference quantizer, and
the per-GPU guards. Tolerances: fp8_linear_test.py's module docstring, and the comment below.

    $ python fp8_recipes_test.py     # a readable report
    $ pytest fp8_recipes_test.py
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import copy

import pytest
import torch

from playbook.model import registry
from core import gpu_arch
from core import fp8_support
from core.kernel_utils import DEVICE
from testkit import close_to_reference, exactly, expect_error, random_like_grad, record, run_as_script
import fp8_linear_kernel
from fp8_linear_kernel import (AMAX_FLOOR, FP8_DTYPE, FP8_MAX, Float8Linear, compiled_graph_trusted, expected_patches,
                               quantize_rows_ref)
from fp8_producers_kernel import patch_model  # every recipe, with the model's hand-off for the row-wise ones
import fp8_recipes_kernel
from fp8_recipes_kernel import check_fp8_device, fp8_linear
from fp8_linear_test import (ACC, MODEL_FACTOR, RMS_BOUND, SUB, U, bits, loss_and_grads, run_config, spread, tiny_llama,
                             worst_ratio)

# ------------------------------------------------------------------------------------------------ recipes
# Each recipe's three matmuls are checked as the row-wise ones are (module docstring): element by
# element against the exact product of the operands *as that recipe quantizes them* (rule 1: the
# plumbing of scales, blocks, transposes and padding), and by relative L2 against the exact product of
# the unquantized operands (rule 3). Rule 3's bound holds for every recipe: each operand value is
# rounded to e4m3 once, whatever its scale, so the RMS relative error per operand is the same 0.0266
# (values far below their block's maximum fall into e4m3's subnormals, but they carry a negligible
# share of the L2 norm of these data). The bf16 input gradient of rowwise-bf16-dgrad is checked
# against the exact product of the bf16 operands: bf16's rounding of the output only.
RECIPE_NAMES = tuple(n for n, r in fp8_recipes_kernel.RECIPES.items() if not r.emulated)  # --fp8-recipe's choices
TILE = fp8_recipes_kernel.TILE


def _runs_here(recipe: str) -> bool:
    """Whether this device runs the recipe: the CPU all of them (reference arithmetic for the block and MX
    matmuls); a GPU mxfp8 from Blackwell on and blockwise on Hopper only (test_blackwell_and_hopper_guards)."""
    if DEVICE.type == "cpu" or recipe not in ("mxfp8", "nvfp4", "blockwise"):
        return True
    family = gpu_arch.device_family(DEVICE)
    return family == gpu_arch.HOPPER if recipe == "blockwise" else family not in (gpu_arch.OLDER, gpu_arch.HOPPER)


RUNNABLE = tuple(r for r in RECIPE_NAMES if _runs_here(r))


def _as_quantized(t, how):
    """t [rows, reduction] (float64), with each value replaced by what the recipe's matmul sees: the
    dequantized FP8 copy. how: 'tensor', 'act' (1x128 blocks along the reduction), 'tile' (128x128),
    'mx' (1x32, power-of-two scales), 'row'. The reduction is zero-padded to whole blocks and cut back."""
    R, S = t.shape
    step = {"act": TILE, "tile": TILE, "mx": fp8_recipes_kernel.MX_BLOCK}.get(how, 1)
    rows = TILE if how == "tile" else 1
    tp = torch.nn.functional.pad(t.float(), (0, -S % step, 0, -R % rows))
    if how == "tensor":
        q, s = fp8_recipes_kernel.quantize_tensor_ref(tp)
    elif how == "row":
        q, s = quantize_rows_ref(tp)
        s = s[:, None]
    elif how == "mx":
        q, s = fp8_recipes_kernel.quantize_mx_ref(tp)
    else:
        q, s = fp8_recipes_kernel.quantize_blocks_ref(tp, rows, step)
    return fp8_recipes_kernel.dequantize_blocks(q, s).double()[:R, :S]


# recipe -> how it quantizes (x and dy along the features, the weight, x and dy along the tokens)
HOW = {"rowwise": ("row", "row", "row"), "rowwise-bf16-dgrad": ("row", "row", "row"),
       "rowwise-bf16-ends": ("row", "row", "row"), "tensorwise": ("tensor", "tensor", "tensor"),
       "blockwise": ("act", "tile", "act"), "mxfp8": ("mx", "mx", "mx")}


def _check_plumbing(tag, ours, a_deq, b_deq, exact):
    """Rule 1 (element by element against the dequantized operands' product) and rule 3."""
    n = a_deq.shape[1]
    plumbing = a_deq @ b_deq.t()
    bound = 2.0**-8 * plumbing.abs() + (1 + 2.0**-8) * n * ACC * (a_deq.abs() @ b_deq.abs().t())
    ratio = worst_ratio((ours.double() - plumbing).abs(), bound)
    record(f"{tag}: vs dequantized operands, / bound", ratio, 1.0, ratio <= 1.0)
    rel = (torch.linalg.vector_norm(ours.double() - exact) / torch.linalg.vector_norm(exact)).item()
    record(f"{tag}: relative L2 error", rel, RMS_BOUND, rel <= RMS_BOUND)
    return rel


@pytest.mark.parametrize("recipe", [r for r in RUNNABLE if r not in ("rowwise-bf16-ends", "nvfp4", "nvfp4-46")])  # nvfp4: mx_quant_test.py
def test_recipe_forward_and_gradients(recipe):
    """74 tokens (padding to 16, 32 and 128 along the tokens), 512 -> 1024 features (whole groups of
    four 128x128 tiles, and N != K so that a transposed scale cannot pass), values over seven decades."""
    K, N = 512, 1024
    x = spread((74, K), torch.bfloat16, seed=50).view(2, 37, K)
    w = spread((N, K), torch.bfloat16, seed=51)
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
        err = worst_ratio((xi.grad.reshape(74, K).double() - exact).abs(),
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
    x = spread(shape, torch.bfloat16, seed=shape[0])
    q, s, qt, st = fp8_recipes_kernel.quantize_tiles(x, mode, True, True)
    M, K = shape
    m_pad = fp8_recipes_kernel.tile_rows(M, mode)
    xt = torch.nn.functional.pad(x.float(), (0, 0, 0, m_pad - M)).t()
    if mode == "tensor":
        (rq, rs), (cq, cs) = fp8_recipes_kernel.quantize_tensor_ref(x), fp8_recipes_kernel.quantize_tensor_ref(xt)
    else:
        block = (TILE, TILE) if mode == "tile" else (1, TILE)
        (rq, rs), (cq, cs) = (fp8_recipes_kernel.quantize_blocks_ref(x, *block),
                              fp8_recipes_kernel.quantize_blocks_ref(xt, *block))
    tag = f"{mode} {list(shape)}"
    exactly(f"{tag}: scales", s.reshape(rs.shape), rs)
    exactly(f"{tag}: q (fp8 bits)", bits(q), bits(rq))
    exactly(f"{tag}: transposed scales", st.reshape(cs.shape), cs)
    exactly(f"{tag}: qT (fp8 bits), zero-padded", bits(qt), bits(cq))


def test_tile_ops_pass_opcheck():
    x = spread((40, 256), torch.bfloat16, seed=60)
    for mode, rows, cols in (("tensor", True, True), ("act", True, False), ("act", False, True), ("tile", True, True)):
        xx = x if mode != "tile" else spread((128, 256), torch.bfloat16, seed=61)
        torch.library.opcheck(fp8_recipes_kernel.fp8_tiles_op, (xx, mode, rows, cols, None))
    # the product's operands at 48 rows: on a GPU torch._scaled_mm (cuBLASLt) takes widths that are multiples of 16
    q, s, _, _ = fp8_recipes_kernel.quantize_tiles(spread((48, 256), torch.bfloat16, seed=62), "tensor")
    torch.library.opcheck(fp8_recipes_kernel.fp8_scaled_mm_tiles_op, (q, s, q, s, False, True),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    record("opcheck: fp8_quantize_tiles (x4), fp8_scaled_mm_tiles", 0.0, 0.0, True)


def test_mx_reference_quantizer():
    """MXFP8's reference: scales are powers of two (e8m0), one per 32 values of a row, each the
    smallest that keeps its block's largest value at most 448 (so in (224, 448] after scaling); a block
    does not see its neighbours; values round to e4m3 (within 2^-4 relative, or half of e4m3's
    smallest subnormal step times the scale)."""
    x = spread((19, 96), torch.float32, seed=70).cpu()
    x[3, 40] = 1e6  # one huge value in row 3's second block
    q, s = fp8_recipes_kernel.quantize_mx_ref(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float8_e8m0fnu and s.shape == (19, 3)
    sf = s.float()
    assert torch.equal(torch.exp2(torch.log2(sf).round()), sf), "every scale is a power of two"
    amax = x.view(19, 3, 32).abs().amax(dim=2)
    live = amax > AMAX_FLOOR
    top = amax[live] / sf[live]
    assert (top <= FP8_MAX).all() and (top > FP8_MAX / 2).all(), "each block's largest value in (224, 448]"
    assert sf[3, 1] > 1e3 * sf[3, 0] and sf[3, 2] == fp8_recipes_kernel.quantize_mx_ref(x[3:4, 64:])[1].float()[0, 0]
    deq = fp8_recipes_kernel.dequantize_blocks(q, s)
    bound = U * x.abs() + SUB * sf.repeat_interleave(32, dim=1) * FP8_MAX / FP8_MAX
    assert ((deq - x).abs() <= bound).all(), "each value within e4m3's rounding"
    assert (deq[0] == 0).all() and (sf[0] == sf[0, 0]).all(), "an all-zero row stays zero"
    # the rounding rule at its edge: amax exactly 448 * 2^k takes 2^k, the next float above it 2^(k+1)
    edge = torch.zeros(2, 32)
    edge[0, 0], edge[1, 0] = FP8_MAX * 4, torch.nextafter(torch.tensor(FP8_MAX * 4), torch.tensor(1e9))
    assert fp8_recipes_kernel.quantize_mx_ref(edge)[1].float()[:, 0].tolist() == [4.0, 8.0]
    expect_error(ValueError, fp8_recipes_kernel.quantize_mx_ref, torch.ones(2, 48))
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
    base = tiny_llama(layers=1)
    ref = copy.deepcopy(base).float()
    ours = copy.deepcopy(base)
    # mxfp8 converts attention only: the MLP's 176 is no multiple of its 32-value blocks
    assert patch_model(ours, recipe) == expected_patches(ours.config, recipe) >= 4
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (lb, gb), (lo, go), (lr, gr) = (loss_and_grads(m, ids) for m in (base, ours, ref))
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
    x = spread((3 * 19, 512), torch.bfloat16, seed=90).view(3, 19, 512)
    w = spread((1024, 512), torch.bfloat16, seed=91)
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
    from testkit import tiny_model

    few, many = tiny_llama(layers=2), tiny_model("llama", num_hidden_layers=6).to(torch.bfloat16)
    assert registry.apply_fp8(few, recipe="rowwise-bf16-ends") == 0
    said = capsys.readouterr().out + capsys.readouterr().err
    assert "converted nothing" in said and "--fp8-recipe rowwise" in said, said
    converted = registry.apply_fp8(many, recipe="rowwise-bf16-ends")
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
    assert run_config("--fp8").model.fp8_recipe == "rowwise-bf16-ends"  # the command line's default (docs/fp8.md)
    assert run_config("--fp8", "--fp8-recipe", "tensorwise").model.fp8_recipe == "tensorwise"
    expect_error(SystemExit, run_config, "--fp8", "--fp8-recipe", "fp4")
    assert "invalid choice" in capsys.readouterr().err
    expect_error(SystemExit, run_config, "--fp8-recipe", "tensorwise")
    assert "add --fp8" in capsys.readouterr().err
    expect_error(SystemExit, run_config, "--fp8", "--fp8-backend", "torchao", "--fp8-recipe", "blockwise")
    assert "torchao" in capsys.readouterr().err
    assert "fp4" in expect_error(ValueError, patch_model, tiny_llama(layers=1), "fp4")
    assert "choose from" in expect_error(ValueError, fp8_linear, torch.ones(4, 32), torch.ones(16, 32), None, True,
                                         None, "fp4")
    record("--fp8-recipe: unknown names and missing --fp8 are usage errors", 0.0, 0.0, True)


def _as_gpu(monkeypatch, capability):
    """Make check_fp8_device see a CUDA device of this compute capability (nothing runs on it)."""
    probes = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(fp8_support, "_probed", {})
    monkeypatch.setattr(fp8_support, "_fast_accum", {})
    for lesson in (fp8_linear_kernel, fp8_recipes_kernel):
        monkeypatch.setattr(lesson, "probe_scaled_mm", lambda device, scaling: probes.append(scaling))
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
    real = fp8_linear_kernel.scaled_mm_launch
    x, w = spread((32, 64), torch.bfloat16, seed=80).requires_grad_(), spread((48, 64), torch.bfloat16, seed=81)
    # first, unwatched: where this test is its process's first FP8 matmul, the device's one-time set-up probe
    # launches matmuls of its own (probe_scaled_mm), which are not the layer's
    fp8_linear(x, w.requires_grad_()).sum().backward()
    monkeypatch.setattr(fp8_linear_kernel, "scaled_mm_launch", lambda *a: flags.append(a[-1]) or real(*a))
    for allowed in (True, False):
        monkeypatch.setattr(fp8_linear_kernel, "fast_accum_allowed", lambda device, a=allowed: a)
        flags.clear()
        fp8_linear(x, w.requires_grad_()).sum().backward()
        assert flags == [allowed, False, False], flags




if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "FP8 recipes: test report"))
