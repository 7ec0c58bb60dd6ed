"""The profile's categories: every GPU kernel a training step launches must land in the category a
reader expects, so that the breakdown in README Step 1 / Step 5 adds up to the step.

    $ python profile_test.py  # a readable report
    $ pytest profile_test.py  # the same tests under pytest

The library names below are copied from the H200 profile in results/runs/profile_H200_optimized.log
(cuBLAS's nvjet GEMMs, cuDNN's attention), except the FP8 GEMM's, which is illustrative (no FP8 step
has been profiled yet; cuBLASLt's Hopper GEMMs carry "gemm", "xmma" or "nvjet" in their names). Our
own kernels are read from the kernel files: every Triton kernel a file launches.
"""

import re
from pathlib import Path

import pytest

import adamw_kernel
import cross_entropy_kernel
import distillation_kernel
import fp8_linear_kernel
import rmsnorm_kernel
import rope_kernel
import swiglu_kernel
from profile_baseline import category
from testkit import record, run_as_script


def _triton_kernels(module):
    """The Triton kernels a module launches (`name[grid](...)` in its source), by the name the profiler
    shows; @triton.jit helpers that are only called from other kernels are left out."""
    source = Path(module.__file__).read_text()
    return sorted(name for name, obj in vars(module).items()
                  if type(obj).__name__ in ("JITFunction", "InterpretedFunction")
                  and re.search(rf"\b{re.escape(name)}\[", source))


@pytest.mark.parametrize("module, expected", [
    (rmsnorm_kernel, "RMSNorm"),
    (cross_entropy_kernel, "loss"),
    (distillation_kernel, "loss"),
    (swiglu_kernel, "SwiGLU"),
    (rope_kernel, "RoPE"),
    (adamw_kernel, "optimizer"),
    (fp8_linear_kernel, "FP8 casts"),
], ids=lambda v: getattr(v, "__name__", v))
def test_our_triton_kernels_have_their_category(module, expected):
    names = _triton_kernels(module)
    assert names, f"no launchable Triton kernel found in {module.__name__}"
    wrong = {n: category(n) for n in names if category(n) != expected}
    assert not wrong, f"{module.__name__}: {wrong} (expected {expected!r})"
    record(f"{module.__name__}: {', '.join(names)} -> {expected}", 0.0, 0.0, True)


@pytest.mark.parametrize("name, expected", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matrix multiply"),  # bf16 GEMM (cuBLAS, H200)
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1", "matrix multiply"),  # FP8, illustrative
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void cudnn::fusion::fmha_reduce_head<true>(void const*, void*, unsigned int)", "attention"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::Binar", "element-wise"),  # as the log truncates it
])
def test_library_kernels_have_their_category(name, expected):
    assert category(name) == expected, (name, category(name))
    record(f"{name[:40]}... -> {expected}", 0.0, 0.0, True)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Profile categories: test report"))
