"""Every Triton kernel of the playbook compiles for sm_90 (H100, H200), sm_100 (B200) and sm_103 (GB300)
and fits each one's per-block limits, checked in CI on a machine without a GPU (testkit/kernel_builds.py
says how: launches recorded from the launchers on meta tensors, at LLaMA 3.1 8B's step and at the lesson
tests' shapes, then compiled ahead of time with the ptxas the Triton wheel carries).

    $ pytest tests/kernel_builds_test.py
    $ PYTHONPATH=. TRITON_INTERPRET=0 python tests/kernel_builds_test.py    # the table of every build (--help)

The builds run in a process of their own, with TRITON_INTERPRET=0: this process runs Triton's
interpreter, whose launch settings are not the GPU's, and which can leave `triton.language` patched for
the compiler. Building every launch for all three targets took too long for CI (60 launches x 3 targets:
143 s on a 2-core CPU shared with other jobs, Triton's cache empty), so every distinct launch of the 8B
step is compiled for all three targets and the launches only the lesson shapes make for sm_103 alone:
60 x 3 + 98 x 1 = 278 builds (with the MXFP8 and NVFP4 quantizers and the MXFP8 producers), ~180 s of
wall time on a 2-core CPU shared with other jobs, Triton's cache empty. Triton's on-disk cache makes a
second run take ~20 s.

What a pass guarantees: each kernel, at each launch configuration a training step or a lesson test uses,
compiles for each target, uses at most 227 KB of shared memory per block, fits the registers of a block
and spills nothing. It does not say a kernel is fast or right on Blackwell: that needs the GPU.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest (TRITON_INTERPRET=0 is kept)
    start()

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from playbook.runtime import setup_check
from testkit import kernel_builds as kb

HERE = Path(__file__).resolve().parent.parent
GB300 = (10, 3)
BUILDS = [sys.executable, str(HERE / "tests" / "kernel_builds_test.py")]  # the table of builds (module docstring)


def _child_env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(HERE))
    return env


def _needs_a_blackwell_ptxas():
    """Skip, saying exactly why, where this Triton cannot compile for sm_103 here."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA backend to compile with")
    from triton.runtime import jit

    version, ptxas, path, variable = setup_check.triton_toolchain(GB300)
    if not (hasattr(jit, "create_function_from_signature") and hasattr(jit.JITFunction, "_pack_args")):
        pytest.skip(f"Triton {version} binds a launch's arguments otherwise than the Triton 3.9 the recorder "
                    "follows (jit.create_function_from_signature, JITFunction._pack_args)")
    if ptxas is None:
        pytest.skip(f"Triton {version}: the version of its ptxas cannot be read ({path}), so sm_103 cannot be compiled")
    if setup_check._version_tuple(ptxas, 2) < setup_check.needed_cuda(GB300):
        pytest.skip(f"Triton {version} assembles with ptxas {ptxas} ({path}), older than CUDA 12.9, the first to "
                    f"know sm_103; set {variable} to a newer one")


def test_every_kernel_builds_for_hopper_and_blackwell():
    _needs_a_blackwell_ptxas()
    out = subprocess.run([*BUILDS, "--jobs", "2", "--lesson-targets", "sm_103"], cwd=HERE, env=_child_env(),
                         capture_output=True, text=True, timeout=900)
    problems = [line[len("PROBLEM "):] for line in out.stdout.splitlines() if line.startswith("PROBLEM ")]
    assert not problems, "\n".join(problems)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    # Not an empty pass: each file with a @triton.jit has at least one kernel, and every kernel found was
    # launched (a kernel nothing launches is a problem above)
    found = int(summary.split(" kernels in ")[0])
    jitted = [f for f in kb.kernel_files() if "@triton.jit" in (HERE / (f.replace(".", "/") + ".py")).read_text()]
    assert found >= len(jitted) > 0, summary
    for target in kb.TARGETS:
        assert f" {target} " in out.stdout, target


# A module of kernels that break the rules: one over the shared memory of a block (a pipelined matmul of
# 128 x 128 bf16 tiles: 64 KB a stage, six stages), one that does not compile (a block of 100: Triton's
# blocks are powers of two), one nothing launches, an autotuned one (two configs, both fine), and a device
# function that is not a kernel.
_BAD_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _deep_matmul(A, B, C, K, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(A + idx[:, None] * K + k + idx[None, :])
        b = tl.load(B + (k + idx[:, None]) * BLOCK + idx[None, :])
        acc += tl.dot(a, b)
    tl.store(C + idx[:, None] * BLOCK + idx[None, :], _twice(acc))


@triton.jit
def _odd_block(X, BLOCK: tl.constexpr):
    tl.store(X + tl.arange(0, BLOCK), 1.0)


@triton.jit
def _never_launched(X):
    tl.store(X, _twice(1.0))


@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 128}, num_warps=4)],
                 key=["n"])
@triton.jit
def _tuned(X, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offsets, _twice(1.0), mask=offsets < n)
'''

_CHECK_BAD_KERNELS = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch
import bad_kernels
from testkit import kernel_builds as kb

found = kb.discover_kernels(["bad_kernels"])
print("kernels", " ".join(sorted(found)))
meta = lambda *shape, dtype=torch.bfloat16: torch.empty(shape, dtype=dtype, device="meta")
calls = [("deep matmul", lambda: bad_kernels._deep_matmul[(1,)](meta(128, 4096), meta(4096, 128),
                                                                meta(128, 128, dtype=torch.float32), 4096,
                                                                BLOCK=128, num_warps=8, num_stages=6),
          ("sm_100", "sm_103")),
         ("odd block", lambda: bad_kernels._odd_block[(1,)](meta(100, dtype=torch.float32), BLOCK=100)),
         ("autotuned", lambda: bad_kernels._tuned[(4,)](meta(1000, dtype=torch.float32), 1000))]
launches = kb.record(calls, "test").values()
print("launched", " ".join(sorted(launch.name for launch in launches)))
print("only", " ".join(f"{launch.name}={','.join(launch.only)}" for launch in launches if launch.only))
print("tuned", " | ".join(sorted(launch.config for launch in launches if launch.name.endswith("_tuned"))))
for launch in launches:
    for line in kb.problems(launch, kb.build(launch, "sm_103")):
        print("PROBLEM", line)
"""


def test_a_kernel_over_a_limit_or_not_compiling_is_named(tmp_path):
    """The check can fail: a kernel over the 227 KB of shared memory and one that does not compile each
    give one line naming the kernel, its configuration and the target; discovery finds the kernels (not
    the device function they call) and sees which one nothing launched."""
    _needs_a_blackwell_ptxas()
    (tmp_path / "bad_kernels.py").write_text(textwrap.dedent(_BAD_KERNELS))
    out = subprocess.run([sys.executable, "-c", _CHECK_BAD_KERNELS, str(HERE), str(tmp_path)], cwd=HERE,
                         env=_child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    kernels = next(ln for ln in lines if ln.startswith("kernels ")).split()[1:]
    assert kernels == ["bad_kernels._deep_matmul", "bad_kernels._never_launched", "bad_kernels._odd_block",
                       "bad_kernels._tuned"], kernels
    launched = next(ln for ln in lines if ln.startswith("launched ")).split()[1:]
    assert set(kernels) - set(launched) == {"bad_kernels._never_launched"}
    only = next(ln for ln in lines if ln.startswith("only ")).split()[1:]
    assert only == ["bad_kernels._deep_matmul=sm_100,sm_103"], only  # the targets its call named
    # an autotuned kernel: every config it would time, each built (both fit: no problem line for them)
    tuned = next(ln for ln in lines if ln.startswith("tuned ")).split(" ", 1)[1]
    assert tuned == ("BLOCK=128 num_ctas=1 num_stages=3 num_warps=4 | "
                     "BLOCK=64 num_ctas=1 num_stages=3 num_warps=2"), tuned
    problems = sorted(ln[len("PROBLEM "):] for ln in lines if ln.startswith("PROBLEM "))
    assert len(problems) == 2, problems
    matmul, odd = problems
    assert matmul.startswith("bad_kernels._deep_matmul [BLOCK=128 num_stages=6 num_warps=8] for sm_103: "), matmul
    assert "KB of shared memory per block, over the target's 227 KB" in matmul, matmul
    assert odd.startswith("bad_kernels._odd_block [BLOCK=100] for sm_103: does not compile: "), odd
    assert "power of 2" in odd, odd


def _launch(**constexprs):
    kernel = SimpleNamespace(fn=SimpleNamespace(__module__="some_kernel", __name__="_rows"))
    names = list(constexprs)
    return kb.Launch(kernel, {n: "constexpr" for n in names}, {(i,): v for i, v in enumerate(constexprs.values())},
                     {}, {"num_warps": 32}, [])


@pytest.mark.parametrize("target", list(kb.TARGETS))
def test_limits_of_a_block(target):
    """Each limit on its own, at its edge: 227 KB of shared memory, 64 K registers a block (allocated in
    units of 8 a thread), 255 a thread, no spills."""
    launch = _launch(BLOCK=4096)
    fits = kb.Build(target, shared=227 * 1024, registers=64, threads=1024)
    assert kb.problems(launch, fits) == []
    over = {
        "shared": kb.Build(target, shared=227 * 1024 + 16, registers=64, threads=1024),
        "block registers": kb.Build(target, shared=0, registers=57, threads=1024),  # 57 -> 64: fits
        "thread registers": kb.Build(target, shared=0, registers=256, threads=128),
        "spills": kb.Build(target, shared=0, registers=64, spill_bytes=8, threads=1024),
        "rounded registers": kb.Build(target, shared=0, registers=65, threads=1024),  # 65 -> 72 x 1024 > 64 K
    }
    said = {what: kb.problems(launch, b) for what, b in over.items()}
    assert said["block registers"] == [], said
    for what in ("shared", "thread registers", "spills", "rounded registers"):
        assert len(said[what]) == 1 and said[what][0].startswith(f"some_kernel._rows [BLOCK=4096 num_warps=32] "
                                                                 f"for {target}: "), (what, said[what])


def test_a_blackwell_only_launch_is_built_for_blackwell_only():
    """A call may name its targets (a kernel of Blackwell's tensor cores has no sm_90 build); a launch that
    another call makes without naming any is built for every target; the lesson-only launches for
    --lesson-targets."""
    def launch(only, *where):
        found = _launch(BLOCK=64)
        found.only, found.where = only, list(where)
        return found

    everything = list(kb.TARGETS)
    assert kb.targets_of(launch(("sm_100", "sm_103"), "8b: mx"), everything) == ["sm_100", "sm_103"]
    assert kb.targets_of(launch((), "8b: rows"), everything) == everything
    assert kb.targets_of(launch((), "odd: rows"), everything, ["sm_103"]) == ["sm_103"]
    assert kb.targets_of(launch((), "odd: rows", "8b: rows"), everything, ["sm_103"]) == everything
    assert kb._merge_targets(None, ("sm_103",)) == ("sm_103",)
    assert kb._merge_targets(("sm_100",), ("sm_103",)) == ("sm_100", "sm_103")
    assert kb._merge_targets(("sm_100",), ()) == ()


def test_kernel_files_are_found_by_name():
    """Discovery reads the kernel files themselves: a new `<name>_kernel.py` is in the build with no list
    to edit (its launcher is one line of kernel_builds.step_calls, or the build fails naming the kernel)."""
    files = kb.kernel_files()
    lessons = sorted(p.stem for p in HERE.glob("*_kernel.py"))
    assert [f for f in files if "." not in f] == lessons
    assert "rmsnorm_kernel" in files and "fp8_linear_kernel" in files
    assert not any(f.startswith("tests") for f in files)


def test_bad_arguments_exit_2():
    out = subprocess.run([*BUILDS, "--targets", "sm_80"], cwd=HERE, env=_child_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "sm_80" in out.stderr, out.stderr
    out = subprocess.run(BUILDS, cwd=HERE, env={**_child_env(), "TRITON_INTERPRET": "1"}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "TRITON_INTERPRET=0" in out.stderr, out.stderr


_COMPARE_WITH_A_GPU_LAUNCH = """
import sys
sys.path[:0] = [sys.argv[1]]
import torch
import triton
from triton.compiler import ASTSource, make_backend
from triton.runtime import driver

import rmsnorm_kernel
from testkit import kernel_builds as kb

g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(37, 784, device="cuda", generator=g).to(torch.bfloat16)
w = torch.randn(784, device="cuda", generator=g).to(torch.bfloat16)
recorded = list(kb.record([("rmsnorm", lambda: rmsnorm_kernel.rmsnorm_forward(x.to("meta"), w.to("meta"), 1e-5))],
                          "gpu").values())
assert len(recorded) == 1, recorded
launch = recorded[0]
rmsnorm_kernel.rmsnorm_forward(x, w, 1e-5)
torch.cuda.synchronize()
kernel_cache = rmsnorm_kernel._rmsnorm_fwd.device_caches[torch.cuda.current_device()][0]
real = [k for k in kernel_cache.values()]
target = driver.active.get_current_target()
ours = triton.compile(ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs), target=target,
                      options=make_backend(target).parse_options(dict(launch.options)).__dict__)
properties = driver.active.utils.get_device_properties(torch.cuda.current_device())
print("limits", properties["max_shared_mem"], properties.get("max_num_regs"), torch.cuda.get_device_capability()[0])
print("kernels", len(real))
print("same", any(k.asm["ptx"] == ours.asm["ptx"] for k in real))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compares the recorded "
                    "launch with the one the GPU really compiles")
def test_a_recorded_launch_compiles_as_the_gpus_own():
    """On a GPU: the launch recorded from meta tensors compiles to the same PTX as the kernel Triton
    compiled for the real launch on that GPU (the same signature, constexprs, alignment and options), and
    the driver's limits for a block are the ones the builds are held against."""
    out = subprocess.run([sys.executable, "-c", _COMPARE_WITH_A_GPU_LAUNCH, str(HERE)], cwd=HERE, env=_child_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernels 1" in out.stdout and "same True" in out.stdout, out.stdout
    # The limits held against sm_90 and 10.x are what this GPU's driver reports (Triton checks the same
    # number when it loads a kernel), where the GPU is one of the targets
    shared, registers, major = next(ln for ln in out.stdout.splitlines() if ln.startswith("limits ")).split()[1:]
    if int(major) in (9, 10):
        assert int(shared) == kb.SHARED_PER_BLOCK, shared
        assert registers == "None" or int(registers) == kb.REGISTERS_PER_BLOCK, registers


if __name__ == "__main__":  # the table of every build, for a person (module docstring)
    raise SystemExit(kb.main())
