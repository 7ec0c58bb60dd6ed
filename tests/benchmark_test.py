"""The benchmark harness: `--smoke` runs every kernel end to end (tiny sizes, CPU-friendly) and writes
its files; every byte count in them is the kernel module's own; bad command lines exit with code 2.

    $ PYTHONPATH=. python tests/benchmark_test.py  # a readable report
    $ pytest tests/benchmark_test.py  # the same tests under pytest

One `--smoke` run (a subprocess, ~20 s on two CPU cores) serves all the checks of its output.
"""

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import pytest
import torch

import benchmark_kernels as bk
from playbook.store.files import RESULTS_DIR
from playbook.model.registry import KERNEL_NAMES
from testkit import record, run_as_script

HERE = Path(__file__).resolve().parent.parent  # the repository root
RESULTS = RESULTS_DIR  # (the session's temporary folder: conftest.py)
# One worker runs this file under pytest -n: the smoke run's files in results/ have fixed names, and a second
# worker's copy of the module fixture would remove them while the first reads them.
pytestmark = pytest.mark.xdist_group("benchmark_smoke")


@pytest.fixture(scope="module")
def smoke():
    """The output of one `--smoke` run of every kernel: (stdout, JSON). Its files in results/ are the
    tests', removed after them."""
    out = subprocess.run([sys.executable, "benchmark_kernels.py", "--smoke"], cwd=HERE, capture_output=True,
                         text=True, timeout=300)
    try:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        yield out.stdout, json.loads((RESULTS / "benchmark_smoke.json").read_text())
    finally:
        for path in [*RESULTS.glob("benchmark_smoke.*"), *RESULTS.glob("benchmark_*_smoke.png")]:
            path.unlink(missing_ok=True)


def test_smoke_measures_every_kernel(smoke):
    stdout, data = smoke
    assert "fwd+bwd us" in stdout and "TFLOP/s" in stdout  # the memory-bound tables and the compute-bound one
    impls = {(r["kernel"], r["impl"].split(" +")[0]) for r in data["rows"]}
    for kernel in KERNEL_NAMES:
        assert {(kernel, "ours"), (kernel, "eager"), (kernel, "torch.compile")} <= impls, kernel
    if hasattr(torch.nn.functional, "linear_cross_entropy"):  # PyTorch's own fused op is a peer where it exists
        assert ("linear_cross_entropy", "torch-chunked") in impls
    assert data["meta"]["kernels"] == list(KERNEL_NAMES)
    with open(RESULTS / "benchmark_smoke.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == len(data["rows"])
    record(f"{len(data['rows'])} rows, {len(KERNEL_NAMES)} kernels", 0.0, 0.0, True)


def test_byte_and_flop_counts_come_from_the_kernel_modules(smoke):
    _, data = smoke
    for r in data["rows"]:
        module, dtype = bk.SPECS[r["kernel"]].module, getattr(torch, r["dtype"])
        assert module.__name__ == f"{r['kernel']}_kernel"
        for phase, backward in (("fwd", False), ("fwdbwd", True)):
            expected = module.ideal_bytes(**r["shape"], dtype=dtype, backward=backward)
            assert r[f"{phase}_bytes"] == expected, (r["kernel"], r["shape"], phase)
            if bk.SPECS[r["kernel"]].compute_bound:  # matmul-bound: the floor is flops at the matmul rate
                assert r[f"{phase}_flops"] == module.flops(**r["shape"], backward=backward)
            else:
                assert r[f"{phase}_flops"] is None
    record("ideal bytes (and flops) of every row = the module's", 0.0, 0.0, True)


def test_host_time_per_call_is_measured_for_every_row(smoke):
    """Every implementation, ours and the peers, has its host microseconds per call: in the table
    (its header names the clock and the unit), in the JSON and in the CSV. The values are measured
    (positive, and not one number copied into every row) and the plain-launch time sits beside them."""
    stdout, data = smoke
    assert "host us/call (CPU clock, GPU kept busy)" in stdout and "fwd+bwd us launched (no graph)" in stdout
    hosts = [r["host_us"] for r in data["rows"]]
    assert all(isinstance(h, float) and h > 0 for h in hosts), hosts
    assert len(set(hosts)) > len(hosts) // 2, "host times look like a constant, not a measurement"
    assert all(r["fwdbwd_launched_us"][0] > 0 for r in data["rows"])
    with open(RESULTS / "benchmark_smoke.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert all(float(r["host_us"]) > 0 and float(r["fwdbwd_launched_us"]) > 0 for r in rows)
    record(f"host us/call in all {len(hosts)} rows: {min(hosts):.0f} to {max(hosts):.0f} us", 0.0, 0.0, True)


def test_host_time_measures_the_call(monkeypatch):
    """host_us_per_call times the call itself: a call that sleeps 20 ms on the host measures about
    20 ms, and a call that does nothing measures far less."""
    slow = bk.host_us_per_call(lambda: time.sleep(0.02))
    fast = bk.host_us_per_call(lambda: None)
    assert 15_000 < slow < 200_000 and fast < 1_000, (slow, fast)
    record(f"host_us_per_call: 20 ms sleep -> {slow / 1e3:.1f} ms, empty call -> {fast:.1f} us", 0.0, 0.0, True)


def test_smoke_draws_one_plot_per_kernel(smoke):
    for kernel in KERNEL_NAMES:
        assert (RESULTS / f"benchmark_{kernel}_smoke.png").stat().st_size > 10_000, kernel
    assert not list(RESULTS.glob(".benchmark_*.tmp*"))  # atomic writes leave no temporary files behind


def _main(monkeypatch, *args) -> int:
    """benchmark_kernels.main() on a command line, in this process (no second import of torch)."""
    monkeypatch.setattr(sys, "argv", ["benchmark_kernels.py", *args])
    try:
        return bk.main()
    except SystemExit as e:  # argparse's usage errors
        return e.code


def test_unknown_kernel_is_a_usage_error(monkeypatch, capsys):
    assert _main(monkeypatch, "--smoke", "--kernels", "bogus") == 2
    err = capsys.readouterr().err
    assert "bogus" in err and all(name in err for name in KERNEL_NAMES)
    record("--kernels bogus: exit 2, lists the valid names", 0.0, 0.0, True)


def test_mx_quant_rows_check_then_time(monkeypatch, capsys):
    """--mx-quant --smoke: every quantizer row (MXFP8 and NVFP4, one copy and both) checked against its
    reference bit for bit, and the MXFP8 RMSNorm and SwiGLU producers' copies against the quantizer's of
    their outputs, then run with the pairs they replace: on a CPU in the interpreter, on a GPU as CUDA graph
    replays against its copy bandwidth, and not saved there (the tiny shape's times would replace the 8B
    shapes' file); without --smoke on a CPU, exit 2 in one line."""
    assert _main(monkeypatch, "--mx-quant", "--smoke") == 0
    out = capsys.readouterr().out
    assert out.count("| 70 x 96 ") == 8 and out.count("] ") >= 8 and "nvfp4, both, SR + Hadamard" in out  # table, progress
    assert "rmsnorm writing mxfp8 (fused)" in out and "swiglu writing mxfp8 (fused)" in out
    if torch.cuda.is_available():
        assert "device-to-device copy" in out and "not saved" in out and "Saved" not in out, out
    else:
        assert "Triton's interpreter ran each quantizer once" in out, out
        assert _main(monkeypatch, "--mx-quant") == 2
        assert capsys.readouterr().err.count("\n") == 1
    record("--mx-quant --smoke: 4 quantizer rows and the MXFP8 producers with their pairs checked and run", 0.0,
           0.0, True)


def test_mx_quant_tune_checks_every_setting_then_names_the_fastest(monkeypatch, capsys):
    """--mx-quant --tune --smoke: the first and last launch settings of each quantizer (MXFP8 tiles of 32 and 128
    rows, NVFP4 tiles of 32 and 256 columns, one warp and eight) and of the SwiGLU producer write the reference's
    bytes and run; the fastest per quantizer is named; the settings in force are given back afterwards."""
    import fp8_producers_kernel as f8p
    import mx_quant_kernel as mq

    before = (dict(mq.MX_CONFIG), dict(mq.NV_CONFIG), f8p.SWIGLU_MX_CONFIG)
    assert _main(monkeypatch, "--mx-quant", "--tune", "--smoke") == 0
    out = capsys.readouterr().out
    assert "bytes differ" not in out and out.count("at 70 x 96, (") == 10, out
    assert "at 70 x 96, (32, 128, 1)" in out and "at 70 x 96, (128, 128, 8)" in out
    assert "at 70 x 96, (32, 1)" in out and "at 70 x 96, (256, 8)" in out
    assert out.count("Fastest setting") == 1 and out.split("Fastest setting")[1].count("70 x 96") == 5
    assert "swiglu writing mxfp8 (fused) at 70 x 96, (128, 128, 8)" in out
    assert (dict(mq.MX_CONFIG), dict(mq.NV_CONFIG), f8p.SWIGLU_MX_CONFIG) == before
    record("--mx-quant --tune --smoke: 10 settings checked and run, the fastest named", 0.0, 0.0, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("args", [(), ("--tune",)])
def test_timings_without_a_gpu_exit_2(monkeypatch, capsys, args):
    assert _main(monkeypatch, *args) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "--smoke" in out.err and "GPU" in out.err
    record(f"no GPU, {' '.join(args) or 'no --smoke'}: exit 2, one line", 0.0, 0.0, True)


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.92 GiB"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
], ids=["OutOfMemoryError", "cuBLAS alloc"])
def test_running_out_of_memory_skips_one_implementation(error, capsys):
    """Out of GPU memory (PyTorch's error, or cuBLAS failing to allocate) skips that implementation
    with a warning and the sweep goes on; any other error still stops the run."""
    def measure():
        raise error
    bk.guarded("eager", "8192 x 128256", measure)
    assert "WARNING: eager ran out of GPU memory at 8192 x 128256; skipped" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bk.guarded("ours", "8192 x 128256", lambda: (_ for _ in ()).throw(RuntimeError("an illegal memory access")))
    record(f"{type(error).__name__} ({str(error)[:30]}...): skipped with a warning", 0.0, 0.0, True)


def test_checks_survive_a_peer_that_writes_into_its_upstream_gradient():
    """Liger-Kernel's RoPE backward writes its result into the gradient it is given. The float64 check gives
    each implementation its own upstream gradients, so such a peer, right in value, passes, and the
    references after it see the gradients the peer saw (a shared tensor made Liger's dq 7.4 off in
    results/H100/kernels.log)."""
    from benchmarks import specs
    from rope_kernel import rope_ref

    class InPlaceRope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin):
            ctx.save_for_backward(cos, sin)
            return rope_ref(q, k, cos, sin)

        @staticmethod
        def backward(ctx, dq, dk):
            cos, sin = ctx.saved_tensors
            with torch.enable_grad():  # the exact inverse rotation, written over dq and dk
                q, k = dq.detach().requires_grad_(), dk.detach().requires_grad_()
                gq, gk = torch.autograd.grad(rope_ref(q, k, cos, sin), (q, k), (dq, dk))
            return dq.copy_(gq), dk.copy_(gk), None, None

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 16, 32, generator=g), torch.randn(1, 2, 16, 32, generator=g)
    ang = torch.arange(16.0)[:, None] * 0.1 * torch.arange(1, 17)[None, :]
    ang = torch.cat([ang, ang], dim=-1)[None]
    specs._check_rope("in place", InPlaceRope.apply, q, k, ang.cos(), ang.sin())
    record("an in-place RoPE peer passes the float64 check", 0.0, 0.0, True)


def test_kernel_list_and_run_tag():
    assert bk.kernel_list("all") == KERNEL_NAMES
    assert bk.kernel_list("rope, rmsnorm") == ("rmsnorm", "rope")  # the registry's order
    for bad in ("liger", "none", "", "rmsnorm,bogus"):  # a peer library is not a kernel here
        with pytest.raises(Exception, match="choose from"):
            bk.kernel_list(bad)
    assert set(KERNEL_NAMES) <= set(bk.SPECS)  # every registered kernel has a benchmark entry, and more
    gpu = "NVIDIA H200"
    assert bk.run_tag(gpu, False, KERNEL_NAMES, "bfloat16", None) == "H200"  # the names README.md links
    assert bk.run_tag(gpu, True, KERNEL_NAMES, "bfloat16", None) == "smoke"
    assert bk.run_tag(gpu, False, ("rope",), "bfloat16", None) == "H200_rope"  # never overwrites a full run
    assert bk.run_tag(gpu, False, KERNEL_NAMES, "float16", [8192]) == "H200_float16_sizes8192"


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Kernel benchmark harness: test report"))
