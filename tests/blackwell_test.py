"""Right on Blackwell without a Blackwell GPU: every choice the playbook makes by GPU generation, checked
on the CPU with the compute capability faked, at 8.0 (A100), 9.0 (H100, H200), 10.0 (B200), 10.3
(GB300) and 12.0 (RTX 50 series); and the MXFP8 recipe's arithmetic.

    $ PYTHONPATH=. python tests/blackwell_test.py       # a readable report
    $ pytest tests/blackwell_test.py

Each decision is asserted at every capability, so a gate written for one minor version (`== (10, 0)`,
which drops a GB300 to the path of an unknown GPU) or one that lumps consumer Blackwell in with the
data-centre parts fails here. What each gate picks, and why: docs/troubleshooting.md ("Blackwell").
Two checks compile real kernels or run the interpreter: the quantizers' transposed copies against the
reference (the run-time guard against Triton's FP8 transpose miscompilation), and the shared memory
of the largest quantizer compiled for sm_120 by Triton's own compiler (no GPU needed).
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import pytest
import torch

import fp8_linear_kernel as fp8
import fp8_recipes_kernel as recipes
from playbook.model import models
from playbook.run import cuda_graph
from playbook.runtime import setup_check
from core import fp8_support, gpu_arch
from core.kernel_utils import DEVICE
from playbook.model import registry as ak
from playbook.config import make_parser, parse_config
from testkit import expect_error, record, run_as_script

HERE = Path(__file__).resolve().parent.parent
A100, H100, B200, GB300, RTX5090 = (8, 0), (9, 0), (10, 0), (10, 3), (12, 0)
CAPABILITIES = (A100, H100, B200, GB300, RTX5090)
CUDA = torch.device("cuda", 0)


@dataclasses.dataclass
class _Properties:
    """What torch.cuda.get_device_properties reports, for a GPU that is not there."""
    major: int
    minor: int
    name: str = "a GPU"
    multi_processor_count: int = 132
    total_memory: int = 80 * 2**30


def as_gpu(monkeypatch, capability):
    """Make torch report one CUDA device of this compute capability; nothing can run on it. The FP8
    probes are recorded instead of run (returned list), and every per-device cache starts empty."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Properties(*capability))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(fp8_support, "_probed", {})
    monkeypatch.setattr(fp8_support, "_fast_accum", {})
    probes = []
    for lesson in (fp8, recipes):
        monkeypatch.setattr(lesson, "probe_scaled_mm", lambda device, scaling: probes.append(scaling))
    return probes


# ------------------------------------------------------------------------------------------------ the families
def test_each_capability_has_its_family():
    """By major version: every 10.x is data-centre Blackwell (10.3 with 10.0), every 12.x consumer."""
    want = {(8, 0): "older", (8, 9): "older", (9, 0): "hopper", (10, 0): "blackwell-datacenter",
            (10, 3): "blackwell-datacenter", (12, 0): "blackwell-consumer", (12, 1): "blackwell-consumer",
            (11, 0): "newer", (13, 0): "newer"}
    got = {cc: gpu_arch.arch_family(cc) for cc in want}
    assert got == want, got
    assert gpu_arch.describe(GB300) == "Blackwell, datacenter, sm_103"
    record("families: 10.0 and 10.3 datacenter, 12.x consumer, 11.x and 13+ newer", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------ FP8
# capability -> recipe -> None (runs, after its probe) or a phrase of the one-line refusal
FP8_GATES = {
    A100: {r: "8.9 or newer" for r in ("rowwise", "tensorwise", "blockwise", "mxfp8")},
    H100: {"rowwise": None, "tensorwise": None, "blockwise": None, "mxfp8": "MX block-scaled FP8 tensor cores"},
    B200: {"rowwise": None, "tensorwise": None, "blockwise": "Hopper (sm_90) only", "mxfp8": None},
    GB300: {"rowwise": None, "tensorwise": None, "blockwise": "Hopper (sm_90) only", "mxfp8": None},
    RTX5090: {"rowwise": None, "tensorwise": None, "blockwise": "Hopper (sm_90) only", "mxfp8": None},
}
# Fast accumulation: on for Hopper (and Ada), whose FP8 tensor cores need it to be fast; off on every
# Blackwell (data-centre parts accumulate in fp32 anyway; consumer parts not measured: off is precise).
FAST_ACCUM = {H100: True, B200: False, GB300: False, RTX5090: False}


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_fp8_recipes_per_capability(monkeypatch, capability):
    probes = as_gpu(monkeypatch, capability)
    for recipe, refusal in FP8_GATES[capability].items():
        if refusal is None:
            recipes.check_fp8_device(CUDA, recipe)
        else:
            said = expect_error(RuntimeError, recipes.check_fp8_device, CUDA, recipe)
            assert refusal in said and len(said.splitlines()) == 1, said
    runs = [r for r, refusal in FP8_GATES[capability].items() if refusal is None]
    assert probes == [fp8.get_recipe(r).scaling for r in runs], probes  # each that runs is probed once
    if capability in FAST_ACCUM:
        assert fp8.fast_accum_allowed(CUDA) == FAST_ACCUM[capability]
    assert not fp8.compiled_graph_trusted(CUDA)  # no GPU's compiled FP8 graph is trusted (see its docstring)
    record(f"FP8 gates at sm_{capability[0]}{capability[1]}: runs {', '.join(runs) or 'nothing'}", 0.0, 0.0, True)


def test_a_kernel_mismatch_is_reported_as_such(monkeypatch):
    """A quantizer that writes wrong bytes on the GPU is refused with its own message (Triton, ptxas,
    the issue), not as a PyTorch without the matmul."""
    as_gpu(monkeypatch, GB300)

    def miscompiled(device, scaling):
        raise fp8.Fp8KernelMismatch("FP8 quantizer (quantize_both, 256 x 256) ... triton-lang/triton#11111 ...")

    monkeypatch.setattr(fp8, "probe_scaled_mm", miscompiled)
    said = expect_error(RuntimeError, fp8.check_fp8_device, CUDA, "rowwise")
    assert said.startswith("FP8 quantizer (quantize_both") and "no usable" not in said, said


def test_transposed_copies_are_checked_bit_for_bit(monkeypatch):
    """The guard against Triton releases that miscompile FP8 transposed stores (triton-lang/triton#11111):
    the real kernels pass (on the CPU through the interpreter, or on this machine's GPU); one foreign byte
    in a transposed copy is caught."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fp8_support.check_copies(device, fp8.TRANSPOSING)
    real = fp8.quantize_both

    def one_foreign_byte(x2, row_max, col_max):
        q, s, qt, st = real(x2, row_max, col_max)
        qt.view(torch.uint8)[3, 5] ^= 0x60  # what the issue saw: a byte the input never had
        return q, s, qt, st

    monkeypatch.setattr(fp8, "quantize_both", one_foreign_byte)
    said = expect_error(fp8.Fp8KernelMismatch, fp8_support.check_copies, device, fp8.TRANSPOSING)
    assert "quantize_both" in said and "triton-lang/triton#11111" in said and "Triton 3." in said, said
    record("transposed FP8 copies: reference bits pass, one foreign byte is refused", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------ MXFP8
# e4m3 keeps 3 mantissa bits: its values near v are 2^(e-3) apart (e = v's binary exponent), so rounding
# to nearest errs by at most half of that, 2^-4 of |v|, while v / scale is a normal e4m3 value (at
# least 2^-6). Below that e4m3's subnormals are 2^-9 apart: half of it, times the block's scale, is the
# absolute error. MX scales are chosen so that no value exceeds 448: nothing saturates.
U, SUB = 2.0**-4, 2.0**-10


def _spread(rows, cols, seed):
    """randn values over seven decades (row by row), one zero row: not a plain randn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 4, rows)[:, None]
    x[1] = 0
    return x


def test_mx_scales_are_powers_of_two_one_per_block_of_32():
    x = _spread(37, 160, seed=1)
    q, s = recipes.quantize_mx_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (37, 160 // 32)
    sf = s.float()
    assert torch.equal(torch.exp2(torch.log2(sf).round()), sf), "every scale is a power of two"
    top = x.view(37, 5, 32).abs().amax(dim=2) / sf
    live = top > 0
    assert (top[live] <= 448).all() and (top[live] > 224).all(), "the smallest power of two that fits 448"
    # One block of 32 shares one scale, and only its own: a spike in block 2 of row 7 changes that
    # block's scale and values, and nothing else.
    spiked = x.clone()
    spiked[7, 2 * 32 + 5] = 1e9
    q2, s2 = recipes.quantize_mx_ref(spiked)
    changed = (s2.float() != sf).nonzero().tolist()
    assert changed == [[7, 2]], changed
    other = torch.ones(37, 160, dtype=torch.bool)
    other[7, 64:96] = False
    assert torch.equal(q2.view(torch.uint8)[other], q.view(torch.uint8)[other])
    record("MX scales: powers of two, one per 32 values, a block sees no neighbour", 0.0, 0.0, True)


def test_mx_round_trip_within_e4m3_rounding():
    x = _spread(29, 96, seed=2)
    q, s = recipes.quantize_mx_ref(x)
    per_value = s.float().repeat_interleave(32, dim=1)
    err = (recipes.dequantize_blocks(q, s) - x).abs()
    bound = U * x.abs() + SUB * per_value  # the two cases above, whichever applies
    worst = (err / bound).max().item()
    normal = x.abs() >= 2.0**-6 * per_value
    rel = (err[normal] / x.abs()[normal]).max().item()
    record("MX round trip: worst error / e4m3 bound", worst, 1.0, worst <= 1.0)
    assert worst <= 1.0 and rel <= U, (worst, rel)


def test_mx_reference_matmul_matches_fp32():
    """mx_linear_ref (both operands in 1x32 blocks, dequantized, an fp32 product) against the float64
    product of the unquantized operands: element by element within the worst case of rounding both
    operands (as fp8_linear_test's `e4m3_bound`, with a scale per block: |a' - a| <= U|a| + SUB s_a),
    and in relative L2 within 2x the expected RMS error of rounding two operands to e4m3: 2^-3 / sqrt(12)
    x 0.736 = 0.0266 per operand (uniform over half a step; sqrt(E[1/m^2]) = 0.736 for mantissas
    spread over a binade), x sqrt(2) for two, x 2 = 0.075."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(45, 256, generator=g), torch.randn(72, 256, generator=g)
    ours = recipes.mx_linear_ref(x, w).double()
    exact = x.double() @ w.double().t()
    (xq, sx), (wq, sw) = recipes.quantize_mx_ref(x), recipes.quantize_mx_ref(w)
    e_x = SUB * sx.double().repeat_interleave(32, dim=1)
    e_w = SUB * sw.double().repeat_interleave(32, dim=1)
    ax, aw = x.double().abs(), w.double().abs()
    bound = ((2 * U + U * U) * (ax @ aw.t()) + (1 + U) * (e_x @ aw.t() + ax @ e_w.t()) + e_x @ e_w.t()
             + 256 * 2.0**-24 * ((1 + U) ** 2) * (ax @ aw.t()))  # + the fp32 sums of the dequantized product
    worst = ((ours - exact).abs() / bound).max().item()
    rel = (torch.linalg.vector_norm(ours - exact) / torch.linalg.vector_norm(exact)).item()
    record("MX reference matmul vs float64: worst / bound", worst, 1.0, worst <= 1.0)
    record("MX reference matmul vs float64: relative L2", rel, 0.075, rel <= 0.075)
    assert worst <= 1.0 and rel <= 0.075


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter; a GPU machine "
                    "runs the MX path where its GPU has one (fp8_recipes_test.py)")
def test_mx_reduction_not_a_multiple_of_32_is_refused_clearly():
    """K must hold whole blocks: the quantizer raises, the layer refuses, patch_model leaves it bf16.
    The token dimension (reduced over by dW) needs no such care: it is zero-padded to whole blocks."""
    said = expect_error(ValueError, recipes.quantize_mx_ref, torch.ones(4, 48))
    assert "multiple of 32" in said
    assert "multiple of 32" in fp8.unsupported_reason(48, 64, "mxfp8")
    assert fp8.unsupported_reason(64, 96, "mxfp8") is None
    said = expect_error(ValueError, recipes.fp8_linear, torch.ones(4, 48), torch.ones(64, 48), None, True, None, "mxfp8")
    assert "multiple of 32" in said and "bf16" in said
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 64, generator=g, dtype=torch.float32).to(torch.bfloat16).requires_grad_()  # 37 tokens
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16).requires_grad_()
    recipes.fp8_linear(x, w, recipe="mxfp8").sum().backward()
    exact = torch.ones(37, 32, dtype=torch.float64).t() @ x.detach().double()
    rel = (torch.linalg.vector_norm(w.grad.double() - exact) / torch.linalg.vector_norm(exact)).item()
    assert rel <= 0.075, rel  # dW over 37 tokens, padded to 64: within FP8's error of the exact product
    record("MX: K = 48 refused in one line; 37 tokens padded for dW", 0.0, 0.0, True)


def test_mx_scales_swizzled_as_cublas_reads_them():
    """`mx_swizzled_scales` against the layout of the cuBLAS documentation, entry by entry (128 x 4
    tiles stored as 32 x 16: row r at [r % 32, (r // 32) % 4 * 4 + column]), with rows and blocks padded,
    and against PyTorch's own test helper where it exists."""
    R, B = 200, 6
    tiles_per_row = -(-B // 4)
    for r, b in ((0, 0), (31, 3), (32, 0), (127, 5), (128, 1), (199, 4), (77, 2)):
        s = torch.zeros(R, B, dtype=torch.uint8)
        s[r, b] = 127  # 2^0 in e8m0
        flat = recipes.mx_swizzled_scales(s.view(torch.float8_e8m0fnu)).view(torch.uint8)
        assert flat.numel() == 256 * 8
        want = ((r // 128) * tiles_per_row + b // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + b % 4
        assert flat.nonzero().flatten().tolist() == [want], (r, b)
    try:
        from torch.testing._internal.common_quantized import to_blocked
    except ImportError:
        return
    s = torch.randint(0, 255, (R, B), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    assert torch.equal(recipes.mx_swizzled_scales(s.view(torch.float8_e8m0fnu)).view(torch.uint8), to_blocked(s))


def test_mx_gpu_matmuls_pass_pytorchs_checks():
    """The GPU path's torch._scaled_mm calls for the three matmuls of a layer (37 tokens, 64 -> 96
    features), run on the meta device: PyTorch's own checks of operand layout (row-major a, column-major
    b), alignment and MXFP8 scale sizes, without a Blackwell GPU. The operands are quantized on this
    machine's device (the kernels take a GPU's tensors where there is a GPU, the CPU's in the interpreter)."""
    g = torch.Generator().manual_seed(6)
    x, w, dy = (torch.randn(shape, generator=g).to(DEVICE) for shape in ((37, 64), (96, 64), (37, 96)))
    (xq, sx, xqt, sxt), (dyq, sdy, dyqt, sdyt), (wq, sw, wqt, swt) = (
        recipes.quant_operand(t, "mx", t is w, True, True, False) for t in (x, dy, w))
    for a, sa, bt, sbt, shape in ((xq, sx, wq, sw, (37, 96)), (dyq, sdy, wqt, swt, (37, 64)),
                                  (dyqt, sdyt, xqt, sxt, (96, 64))):
        y = recipes.scaled_mm_mx_launch(*(t.to("meta") for t in (a, sa, bt, sbt)))
        assert y.shape == shape and y.dtype == torch.bfloat16


def test_mx_probe_runs_the_three_matmuls():
    """The set-up probe of mxfp8 (the transposing quantizers bit for bit against their references, then the
    three matmuls' operands quantized, multiplied and compared with the dequantized product) on this
    machine's device: on the CPU, where the matmul is the reference; on a Blackwell GPU, its MXFP8 matmul;
    on a GPU without block-scaled tensor cores (Hopper refuses the native matmul), as the emulated recipe
    (--fp8-emulate) probes it: the dequantized product on bf16 tensor cores."""
    native = DEVICE.type != "cuda" or gpu_arch.device_family(DEVICE) not in (gpu_arch.OLDER, gpu_arch.HOPPER)
    recipes.probe_scaled_mm(DEVICE, "mx" if native else "mx-emulated")


# ------------------------------------------------------------------------------------------------ other gates
ATTENTION = {A100: "default backend order", H100: "cuDNN > flash", B200: "default backend order",
             GB300: "default backend order", RTX5090: "default backend order"}


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_attention_backend_order(monkeypatch, capability):
    """cuDNN first on Hopper, where it was measured fastest; PyTorch's own order elsewhere."""
    as_gpu(monkeypatch, capability)
    entered = []

    class Order:
        def __init__(self, backends, set_priority):
            self.backends = backends

        def __enter__(self):
            entered.append(self.backends)

    import torch.nn.attention

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", Order)
    monkeypatch.setattr(models, "_attention_order", [])
    line = models.prefer_fast_attention(CUDA)
    assert ATTENTION[capability] in line, line
    assert bool(entered) == (capability == H100)


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_cuda_graph_capture_does_not_depend_on_the_generation(monkeypatch, capability):
    as_gpu(monkeypatch, capability)
    cfg = parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized", [])
    assert cuda_graph.graph_blocker(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device=CUDA))) is None


def test_no_kernel_uses_programmatic_dependent_launch():
    """Triton's PDL (launch_pdl=True, gdc_wait, gdc_launch_dependents) has made CUDA-graph capture fail on
    Blackwell; the step is captured on every GPU, so a kernel that adopts PDL must turn it off while a
    graph is captured. Until then, none may use it (the kernel files hold every kernel and launch)."""
    words = ("launch_pdl", "gdc_wait", "gdc_launch_dependents", "griddepcontrol")
    users = [p.name for p in sorted(HERE.glob("*_kernel.py")) for word in words if word in p.read_text()]
    assert not users, f"{users}: PDL must be off under CUDA-graph capture (playbook/run/cuda_graph.py); then update this"


# capability -> (first CUDA for it, wheel index with a CUDA 12.8 driver, with a CUDA 13.0 driver)
WHEELS = {A100: ((12, 6), "cu128", "cu130"), H100: ((12, 6), "cu128", "cu130"), B200: ((12, 8), "cu128", "cu130"),
          GB300: ((12, 9), None, "cu130"), RTX5090: ((12, 8), "cu128", "cu130")}


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_set_up_asks_for_the_cuda_the_gpu_needs(capability):
    """CUDA 12.8 is the first to compile for sm_100 and sm_120, 12.9 for sm_103: a GB300 with a 12.8
    driver is told to update it, and a torch built with CUDA 12.8 gets a note there (its sm_100a
    kernels do not run on sm_103)."""
    need, with_128, with_130 = WHEELS[capability]
    assert setup_check.needed_cuda(capability) == need
    for driver, index in (((12, 8), with_128), ((13, 0), with_130)):
        got = setup_check.wheel_index(capability, driver)
        assert got == (None if index is None else f"{setup_check.INDEX_ROOT}/{index}"), (driver, got)
    note = setup_check.build_note(capability, (12, 8))
    assert (note is not None) == (capability == GB300), note
    assert note is None or ("CUDA 12.9" in note and "sm_103" in note)
    assert setup_check.build_note(capability, (13, 0)) is None
    blackwell = gpu_arch.arch_family(capability) in gpu_arch.BLACKWELL
    assert bool(setup_check.blackwell_note(capability)) == blackwell
    assert setup_check._arch_supported(["sm_80", "sm_90", "sm_100", "sm_120"], capability)  # a cu128+ wheel's list


# (Triton, the version of the ptxas it assembles with) -> capability -> a phrase of the one-line refusal, or
# None: Triton 3.5.0 crashes on every matmul on sm_103 (triton-lang/triton#8473, fixed in 3.5.1); a ptxas must
# be of the first CUDA that knows the GPU (12.8 for sm_100 and sm_120, 12.9 for sm_103).
TOOLCHAINS = {
    ("3.5.0", "12.8"): {GB300: "pip install -U 'triton>=3.5.1'"},
    ("3.5.1", "12.8"): {GB300: "set TRITON_PTXAS_PATH to the ptxas of CUDA 12.9 or newer"},
    ("3.9.0", "12.7"): {B200: "CUDA 12.8 or newer", GB300: "CUDA 12.9 or newer", RTX5090: "CUDA 12.8 or newer"},
    ("3.5.1", "12.9"): {},
    ("3.9.0", "13.4"): {},
    ("3.9.0", None): {},  # a ptxas whose version cannot be read: not refused
    (None, None): {},  # no Triton
}


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_set_up_refuses_a_triton_that_cannot_build_for_the_gpu(capability):
    for (triton_version, ptxas), refusals in TOOLCHAINS.items():
        said = setup_check.triton_problem(capability, triton_version, ptxas, "/opt/old/ptxas")
        want = refusals.get(capability)
        if want is None:
            assert said is None, (triton_version, ptxas, said)
        else:
            assert want in said and said.startswith("setup: ") and "\n" not in said, (triton_version, ptxas, said)
            assert f"sm_{capability[0]}{capability[1]}" in said, said


def _gb300_with(monkeypatch, toolchain):
    """A GB300 that torch can use (faked), with Triton and its ptxas as `toolchain` says."""
    as_gpu(monkeypatch, GB300)
    report = setup_check.SmiReport(True, gpus=[setup_check.Gpu("NVIDIA GB300", GB300, 284 * 1024)], driver="580.95",
                                   cuda=(13, 0))
    monkeypatch.setattr(setup_check, "nvidia_smi_report", lambda: report)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "sm_100", "sm_103", "sm_120"])
    real_ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *size, device=None, **kw: real_ones(*size, **kw))  # "runs on the GPU"
    monkeypatch.setattr(setup_check, "triton_toolchain", lambda capability: toolchain)
    monkeypatch.setattr(setup_check, "_cpu_note_printed", True)


def test_scripts_and_selfcheck_refuse_triton_350_on_a_gb300(monkeypatch, capsys):
    """The refusal is what `selfcheck.py --setup` prints (exit code 1) and what every script's start
    (`check_or_exit`) stops with, in one line; a good toolchain passes both."""
    _gb300_with(monkeypatch, ("3.5.0", "12.8", "/opt/triton/ptxas", "TRITON_PTXAS_PATH"))
    assert setup_check.main([]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Triton 3.5.0 cannot compile matmuls for sm_103" in err, err
    said = expect_error(SystemExit, setup_check.check_or_exit, [])
    assert said == err, said
    _gb300_with(monkeypatch, ("3.5.1", "12.9", "/opt/triton/ptxas", "TRITON_PTXAS_PATH"))
    assert setup_check.main([]) == 0
    setup_check.check_or_exit([])
    assert "setup: OK: NVIDIA GB300" in capsys.readouterr().out


def test_selfcheck_names_the_ptxas_triton_uses(monkeypatch):
    import selfcheck

    _gb300_with(monkeypatch, ("3.5.1", "12.9", "/opt/triton/ptxas", "TRITON_PTXAS_PATH"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    facts = dict(selfcheck.machine_facts(setup_check.nvidia_smi_report()))
    assert facts["Triton's ptxas"] == "CUDA 12.9 (/opt/triton/ptxas; TRITON_PTXAS_PATH chooses it)", facts


def test_the_installed_triton_is_not_refused_on_any_target():
    """This machine's Triton, with the ptxas its wheel carries (no TRITON_PTXAS_* override), builds for every
    GPU here (the wheel this project installs carries a Blackwell ptxas): the gate reads both versions and
    refuses none of the capabilities."""
    import os

    version = setup_check.triton_toolchain(GB300)[0]
    if version is None or any(v in os.environ for v in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")):
        pytest.skip("no Triton here, or its ptxas chosen by TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH")
    for capability in CAPABILITIES:
        _, ptxas, path, variable = setup_check.triton_toolchain(capability)
        assert ptxas is not None and variable in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"), path
        assert setup_check.triton_toolchain_problem(capability) is None, capability


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_benchmark_names_the_architecture(monkeypatch, capability):
    import benchmark_kernels

    as_gpu(monkeypatch, capability)
    want = {A100: "Ampere, sm_80", H100: "Hopper, sm_90", B200: "Blackwell, datacenter, sm_100",
            GB300: "Blackwell, datacenter, sm_103", RTX5090: "Blackwell, consumer, sm_120"}[capability]
    assert benchmark_kernels.gpu_arch() == want


# ------------------------------------------------------------------------------------------------ launch limits
# Resident warps and shared memory per SM (CUDA C++ Programming Guide, compute capabilities table):
# 64 warps and 228 KB (227 KB per block) on 9.0 and 10.x; 48 warps and 100 KB (99 KB per block) on 12.x.
MAX_WARPS = {"hopper": 64, "blackwell-datacenter": 64, "blackwell-consumer": 48}
SMEM_PER_BLOCK = {"hopper": 227 * 1024, "blackwell-datacenter": 227 * 1024, "blackwell-consumer": 99 * 1024}


def test_persistent_grids_fit_consumer_blackwell():
    """The persistent kernels launch a fixed number of programs per SM, tuned on Hopper; those programs
    must all be resident at once on every generation, or the grid runs in two waves."""
    import rmsnorm_kernel

    cpu = torch.device("cpu")
    sms = 4  # num_sms on the CPU
    for width in (1024, 2048, 4096, 6144, 8192, 14336, 28672, 65536):
        block = fp8.next_power_of_2(width)
        _, warps, programs = fp8.row_launch(block, sms)
        assert programs // sms * warps <= min(MAX_WARPS.values()), ("fp8 rows", width, warps, programs)
    for hidden in (896, 2048, 4096, 8192, 16384):
        _, _, warps, programs = rmsnorm_kernel._bwd_settings(hidden, cpu)
        assert programs // sms * warps <= min(MAX_WARPS.values()), ("rmsnorm backward", hidden, warps, programs)


def _shared_memory_of_largest_quantizer_for_sm120():
    """Bytes of shared memory per program of the transposing quantizer compiled for sm_120, as launched:
    16-byte aligned pointers and sizes, the launch's block and warps. Raises what Triton raises where it
    cannot compile for sm_120 (no bundled ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    # Under TRITON_INTERPRET the module's kernels are the interpreter's; compile their Python functions.
    fp8.quantize_block = JITFunction(getattr(fp8.quantize_block, "fn", fp8.quantize_block))
    fn = fp8._quantize_cols_transposed
    kernel = JITFunction(getattr(fn, "fn", fn))
    pointers = {"X": "*bf16", "QT": "*fp8e4nv", "Scale": "*fp32", "ColMax": "*fp32"}
    sizes = {"stride_x": "i32", "M": "i32", "M_pad": "i32", "K": "i32"}
    consts = {"BLOCK_M": fp8.COL_BLOCK_M, "BLOCK_K": fp8.COL_BLOCK_K, "ROUND_IN_SOFTWARE": False, "ROWS_TOO": False,
              "RowMax": None, "Q": None, "RowScale": None}
    index = kernel.arg_names.index
    source = ASTSource(fn=kernel, signature={**pointers, **sizes, **{n: "constexpr" for n in consts}},
                       constexprs={(index(n),): v for n, v in consts.items()},
                       attrs={(index(n),): [["tt.divisibility", 16]] for n in (*pointers, *sizes)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 120, 32),
                              options={"num_warps": fp8.COL_NUM_WARPS, "enable_fp_fusion": True})
    return compiled.metadata.shared


# Run in a process of its own: Triton's interpreter can leave triton.language patched after a kernel
# (a device function called through it patches the language without restoring it), and the real
# compiler then fails on the interpreter's objects ("'value' object has no attribute 'dtype'").
_COMPILE_IN_CHILD = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import blackwell_test
try:
    print("shared", blackwell_test._shared_memory_of_largest_quantizer_for_sm120())
except (RuntimeError, FileNotFoundError, OSError) as err:  # no bundled ptxas on this platform
    print("cannot", str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
"""


def test_largest_quantizer_fits_consumer_blackwell_shared_memory():
    """Triton's compiler (no GPU needed) compiles the transposing quantizer, the kernel with the most
    shared memory per program (fp8_linear_kernel.py: 32 KB at its 128 x 128 tile), for sm_120: it
    must fit the 99 KB per block of consumer Blackwell."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    out = subprocess.run([sys.executable, "-c", _COMPILE_IN_CHILD, str(HERE), str(HERE / "tests")], cwd=HERE,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said, _, value = out.stdout.strip().splitlines()[-1].partition(" ")
    if said == "cannot":
        pytest.skip(f"Triton cannot compile for sm_120 here: {value}")
    shared = int(value)
    family = gpu_arch.arch_family(RTX5090)
    record("transposing quantizer on sm_120: shared memory per program (KB)", shared / 1024, 99.0,
           0 < shared <= SMEM_PER_BLOCK[family])
    assert 0 < shared <= SMEM_PER_BLOCK[family], shared


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Blackwell gates: test report"))
