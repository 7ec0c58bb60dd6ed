"""The profile's categories: every GPU kernel a training step launches must land in the category a
reader expects, so that the breakdown in README Step 1 / Step 5 adds up to the step.

    $ PYTHONPATH=. python tests/profile_test.py  # a readable report
    $ pytest tests/profile_test.py  # the same tests under pytest

The library names below are copied from the H200 profile in results/runs/profile_H200_optimized.log
(cuBLAS's nvjet GEMMs, cuDNN's attention), except the FP8 GEMM's, which is illustrative (no FP8 step
has been profiled yet; cuBLASLt's Hopper GEMMs carry "gemm", "xmma" or "nvjet" in their names). Our
own kernels are read from the kernel files: every Triton kernel a file launches.
"""

import re
from pathlib import Path

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import pytest

import adamw_kernel
import cross_entropy_kernel
import distillation_kernel
import fp8_linear_kernel
import fp8_lora_kernel
import fp8_producers_kernel
import fp8_recipes_kernel
import mx_quant_kernel
import rmsnorm_kernel
import rope_kernel
import swiglu_kernel
from profile_baseline import category, launch_gaps, project
from testkit import record, run_as_script


def _triton_kernels(module):
    """The Triton kernels a module launches (`name[grid](...)` in its source), by the name the profiler
    shows; @triton.jit helpers that are only called from other kernels are left out."""
    source = Path(module.__file__).read_text()
    return sorted(name for name, obj in vars(module).items()
                  if type(obj).__name__ in ("JITFunction", "InterpretedFunction")
                  and re.search(rf"\b{re.escape(name)}\[", source))


# A kernel filed apart from the rest of its module: the SwiGLU backward that also takes the maxima the
# FP8 casts need lives in fp8_producers_kernel.py and is SwiGLU work in a profile.
# Kernels of fp8_producers_kernel.py that are another kernel's work with an FP8 cast folded in: counted as
# that work (the cast they save shows as "FP8 casts" shrinking)
OWN_CATEGORY = {"_swiglu_joined_bwd_maxima": "SwiGLU", "_rmsnorm_quantize_rows": "RMSNorm",
                "_swiglu_quantize_rows": "SwiGLU", "_rmsnorm_quantize_mxfp8": "RMSNorm",
                "_swiglu_quantize_mxfp8": "SwiGLU"}


@pytest.mark.parametrize("module, expected", [
    (rmsnorm_kernel, "RMSNorm"),
    (cross_entropy_kernel, "loss"),
    (distillation_kernel, "loss"),
    (swiglu_kernel, "SwiGLU"),
    (rope_kernel, "RoPE"),
    (adamw_kernel, "optimizer"),
    (fp8_linear_kernel, "FP8 casts"),
    (fp8_recipes_kernel, "FP8 casts"),
    (fp8_producers_kernel, "FP8 casts"),
    (fp8_lora_kernel, "FP8 casts"),
    (mx_quant_kernel, "FP8 casts"),  # MXFP8's and NVFP4's quantizers are the same casts in a finer format
], ids=lambda v: getattr(v, "__name__", v))
def test_our_triton_kernels_have_their_category(module, expected):
    names = _triton_kernels(module)
    assert names, f"no launchable Triton kernel found in {module.__name__}"
    wrong = {n: category(n) for n in names if category(n) != OWN_CATEGORY.get(n, expected)}
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



def _span(cat, name, ts, dur, tid=1, correlation=None):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1,
            "args": {} if correlation is None else {"correlation": correlation}}


def test_the_faster_gpu_projection_scales_each_category_by_its_limit():
    """Matmuls and attention by the compute ratio, the rest by the bandwidth ratio; the host queue as is."""
    cats = {"matrix multiply": 250.0, "attention": 50.0, "optimizer": 30.0, "element-wise": 15.0}
    out = project(cats, host_ms=100.0, matmul_x=2.5, bandwidth_x=1.5)
    assert out["gpu_ms"] == pytest.approx(300.0 / 2.5 + 45.0 / 1.5)  # 120 + 30 ms
    assert out["host_queue_share"] == pytest.approx(100.0 / 150.0) and out["gpu_bound"]
    slow_host = project(cats, host_ms=200.0, matmul_x=2.5, bandwidth_x=1.5)
    assert not slow_host["gpu_bound"]
    assert "gpu_bound" not in project(cats, None, 2.5, 1.5)  # no host figure (CPU run): no verdict
    record(f"345 ms of H200 work -> {out['gpu_ms']:.0f} ms at 2.5x/1.5x; a 100 ms host queue keeps up, 200 ms does not",
           0.0, 0.0, True)


def test_launch_gaps_split_late_launches_from_other_gaps():
    """A two-step trace laid out by hand (times in us): in step 1 kernel 2 is launched after kernel 1
    ended (a 130 us gap while the host ran Float8LinearFunction) and kernel 3 was queued in time (a 10 us
    gap); in step 2 a 50 us late gap under aten::mm and a 20 us queued one. A kernel outside any step
    does not count."""
    spans = [_span("user_annotation", "ProfilerStep#1", 0, 1000), _span("user_annotation", "ProfilerStep#2", 1000, 1000)]

    def kernel(n, ts, dur, launch_ts, op_start, op_name, op_dur=100):
        return [_span("cpu_op", op_name, op_start, op_dur), _span("cuda_runtime", "cudaLaunchKernel", launch_ts, 5, correlation=n),
                _span("kernel", f"k{n}", ts, dur, tid=7, correlation=n)]

    spans += kernel(1, 30, 100, 20, 10, "aten::mm", op_dur=15)
    spans += kernel(2, 260, 100, 250, 200, "Float8LinearFunction")  # k1 ended at 130: late by 130
    spans += [_span("cuda_runtime", "cudaLaunchKernel", 290, 5, correlation=3), _span("kernel", "k3", 370, 100, tid=7, correlation=3)]
    spans += kernel(4, 1030, 100, 1020, 1010, "aten::add", op_dur=15)
    spans += kernel(5, 1180, 100, 1170, 1160, "aten::mm")  # k4 ended at 1130: late by 50
    spans += [_span("cuda_runtime", "cudaLaunchKernel", 1200, 5, correlation=6), _span("kernel", "k6", 1300, 10, tid=7, correlation=6)]
    spans += [_span("kernel", "outside", 2500, 10, tid=7)]
    gaps = launch_gaps({"traceEvents": spans})
    assert gaps["late_ms"] == pytest.approx((130 + 50) / 2 / 1e3)
    assert gaps["other_ms"] == pytest.approx((10 + 20) / 2 / 1e3)
    assert [(op, round(ms * 1e3, 6), n) for op, ms, n in gaps["late_by_op"]] == [
        ("Float8LinearFunction", 65.0, 0.5), ("aten::mm", 25.0, 0.5)]
    assert launch_gaps({"traceEvents": spans[:2]}) is None  # no kernel inside a step
    record("late launches 0.09 ms/step (Float8LinearFunction 0.065, aten::mm 0.025), other gaps 0.015 ms/step",
           0.0, 0.0, True)

if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Profile categories: test report"))
