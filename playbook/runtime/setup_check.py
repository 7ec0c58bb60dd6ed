"""Is the torch in use able to drive this machine's NVIDIA GPU? Say so, or say exactly how to fix it.

    $ python selfcheck.py --setup       # "OK: ..." and exit code 0, or what is wrong and exit code 1
    $ python selfcheck.py --index-url   # the PyTorch wheel index for this machine (empty: PyPI's default)

The failure this guards against is a quiet one: `pip install torch` on a GPU machine can give a
CPU-only build (a wheel from the wrong index, or an older release on aarch64 such as a DGX Station
GB300, where PyPI's torch wheels were CPU-only), or a CUDA
build too old for the GPU. Every script of this playbook would then run its CPU demo (the tiny model,
Triton's interpreter) and print timings that mean nothing. The scripts call `check_or_exit()` first.

The GPU is found through `nvidia-smi` (driver version, its CUDA version, each GPU's name, compute
capability and memory); torch is imported only when a GPU is there. No GPU at all is fine: that is
the CPU demo, and it is announced once per process. CPU_DEMO=1 runs the CPU demo even where a GPU
cannot be used (the problem is still printed).
"""

from __future__ import annotations

import inspect
import os
import platform
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from core import gpu_arch
from playbook.runtime import environment

SMI_TIMEOUT_S = 15
IMAGE = "kernel-dev-ft"
DOCKER_BUILD = f"docker build -t {IMAGE} ."
DOCKER_RUN = (f"docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 -e HF_TOKEN "
              f"-v $HOME/.cache/huggingface:/root/.cache/huggingface -v $(pwd)/results:/workspace/results "
              f"-it {IMAGE} make run")
# PyTorch's CUDA wheel indexes, oldest first: https://download.pytorch.org/whl/<tag>.
# A wheel runs where the driver supports at least its CUDA version.
WHEEL_INDEXES = (("cu126", (12, 6)), ("cu128", (12, 8)), ("cu129", (12, 9)), ("cu130", (13, 0)))
INDEX_ROOT = "https://download.pytorch.org/whl"
# Without an NVIDIA GPU: PyTorch's CPU index where PyPI's torch is a CUDA build, on Linux x86_64 and
# aarch64 (torch 2.13 from PyPI pulls in the nvidia-* libraries: a .venv of ~6 GB on x86_64, against a
# 0.2 GB CPU wheel). On macOS and Windows PyPI's torch is already CPU-only (MPS on Apple silicon): PyPI.
CPU_INDEX = f"{INDEX_ROOT}/cpu"
CPU_INDEX_PLATFORMS = (("Linux", "x86_64"), ("Linux", "aarch64"))
# The first CUDA release that compiles for each Blackwell GPU (CUDA 12.8: sm_100 and sm_120; 12.9 added
# sm_103 and sm_121). A wheel built with an older CUDA can still run its generic sm_100 code on a
# 10.3 GPU (machine code runs on later minor versions of its major), but not its architecture-specific
# sm_100a kernels (PyTorch builds some CUTLASS kernels, its FP8 matmuls among them, that way): code
# built for an 'a' target runs on that exact architecture only. A GPU of another Blackwell minor
# version, or of a family this playbook does not know, is sent to the newest wheels.
FIRST_CUDA = {(10, 0): (12, 8), (12, 0): (12, 8), (10, 3): (12, 9), (12, 1): (12, 9)}
# Triton's own toolchain on Blackwell. Triton 3.5.0 crashes on every matmul and attention kernel on sm_103 (a
# GB300): its LLVM lowering of tcgen05.wait is not what the sm_103 ptxas accepts (triton-lang/triton#8473); 3.5.1
# went back to 3.4's inline assembly (triton-lang/triton#8485). And Triton assembles with the ptxas it ships,
# or the one TRITON_PTXAS_PATH (from Triton 3.6 on, for sm_90 and newer, TRITON_PTXAS_BLACKWELL_PATH) names:
# that ptxas must know the GPU, which for sm_103 means CUDA 12.9 or newer (FIRST_CUDA).
BROKEN_TRITON = {(10, 3): {(3, 5, 0): "triton-lang/triton#8473"}}
FIXED_TRITON = "3.5.1"


# Compute capabilities when `nvidia-smi` cannot report them (drivers before compute_cap was a field).
KNOWN_CAPABILITIES = (("GB300", (10, 3)), ("B300", (10, 3)), ("GB200", (10, 0)), ("B200", (10, 0)),
                      ("GH200", (9, 0)), ("H200", (9, 0)), ("H100", (9, 0)), ("H800", (9, 0)),
                      ("A100", (8, 0)), ("A800", (8, 0)))


@dataclass
class Gpu:
    name: str
    capability: tuple[int, int] | None  # (major, minor), e.g. (10, 3) for sm_103
    memory_mib: int | None


@dataclass
class SmiReport:
    """What `nvidia-smi` says about this machine."""
    found: bool                                # nvidia-smi is on PATH
    error: str | None = None                   # it is there but failed: why, in one line
    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None                  # e.g. "580.95.05"
    cuda: tuple[int, int] | None = None        # the newest CUDA the driver supports, e.g. (13, 0)


def _run_smi(args: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, f"no answer within {SMI_TIMEOUT_S} s"
    except OSError as e:
        return -1, f"cannot be started ({e.strerror or e})"
    return p.returncode, (p.stdout + p.stderr).strip()


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "no output"


def parse_header(text: str) -> tuple[str | None, tuple[int, int] | None]:
    """(driver version, CUDA version) from `nvidia-smi`'s table header; None where absent."""
    drv = re.search(r"Driver Version:\s*([0-9][0-9.]*)", text)
    cuda = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", text)
    return (drv.group(1) if drv else None), ((int(cuda.group(1)), int(cuda.group(2))) if cuda else None)


def parse_query(text: str) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits`
    (or `name,memory.total` from drivers that cannot report compute_cap; the capability then comes
    from the name where it is known)."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) not in (2, 3) or not parts[0]:
            continue
        cc = re.fullmatch(r"(\d+)\.(\d+)", parts[1]) if len(parts) == 3 else None
        mem = parts[-1]
        gpus.append(Gpu(parts[0], (int(cc.group(1)), int(cc.group(2))) if cc else _known_capability(parts[0]),
                        int(mem) if mem.isdigit() else None))
    return gpus


def _known_capability(name: str) -> tuple[int, int] | None:
    for key, cc in KNOWN_CAPABILITIES:
        if key in name:
            return cc
    return None


def nvidia_smi_report() -> SmiReport:
    """Ask `nvidia-smi` (a few seconds at most). Not found, failing and listing no GPU are all told apart."""
    if shutil.which("nvidia-smi") is None:
        return SmiReport(found=False)
    rc, out = _run_smi(["--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"])
    if rc > 0 and "compute_cap" in out:  # a driver too old to report compute_cap
        rc, out = _run_smi(["--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    if rc != 0:
        return SmiReport(found=True, error=f"nvidia-smi failed ({_exit_text(rc)}): {first_line(out)}")
    gpus = parse_query(out)
    rc, header = _run_smi([])
    driver, cuda = parse_header(header) if rc == 0 else (None, None)
    return SmiReport(found=True, gpus=gpus, driver=driver, cuda=cuda)


def _exit_text(rc: int) -> str:
    return "timed out" if rc == -1 else f"exit code {rc}"


def gpu_present() -> bool:
    """True when `nvidia-smi` is on PATH, runs, and lists at least one GPU."""
    r = nvidia_smi_report()
    return r.error is None and bool(r.gpus)


def needed_cuda(capability: tuple[int, int] | None) -> tuple[int, int]:
    """The oldest CUDA whose PyTorch wheels fully support a GPU of this compute capability: the first
    CUDA that compiles for it (`FIRST_CUDA`); before Blackwell, the oldest wheels offered."""
    if capability is None or gpu_arch.arch_family(capability) in (gpu_arch.OLDER, gpu_arch.HOPPER):
        return WHEEL_INDEXES[0][1]
    return FIRST_CUDA.get(tuple(capability), WHEEL_INDEXES[-1][1])


def blackwell_note(capability: tuple[int, int]) -> str:
    """' Blackwell, datacenter (sm_103) needs PyTorch wheels for CUDA 12.9 or newer; cu130 serves it best.'
    for a GPU from Blackwell on, '' before."""
    if gpu_arch.arch_family(capability) in (gpu_arch.OLDER, gpu_arch.HOPPER):
        return ""
    name = gpu_arch.FAMILY_NAMES[gpu_arch.arch_family(capability)]
    return (f" {name} (sm_{capability[0]}{capability[1]}) needs PyTorch wheels for CUDA "
            f"{version_text(needed_cuda(capability))} or newer; {WHEEL_INDEXES[-1][0]} serves it best.")


def build_note(capability: tuple[int, int] | None, torch_cuda: tuple[int, int] | None) -> str | None:
    """A line for a torch that runs on this GPU but was built with a CUDA older than the first one that
    compiles for it (a cu128 wheel on a GB300): its generic code runs, its architecture-specific
    kernels may not (FIRST_CUDA). None when the build is recent enough, or either version is unknown."""
    if capability is None or torch_cuda is None or torch_cuda >= needed_cuda(capability):
        return None
    return (f"note: torch was built with CUDA {version_text(torch_cuda)}, older than CUDA "
            f"{version_text(needed_cuda(capability))}, the first to compile for sm_{capability[0]}{capability[1]}: "
            f"kernels PyTorch builds for one exact architecture (some FP8 matmuls) may not run here;"
            f"{blackwell_note(capability)}")


def wheel_index(capability: tuple[int, int] | None, driver_cuda: tuple[int, int] | None) -> str | None:
    """The PyTorch wheel index URL for this GPU and driver: the newest CUDA the driver supports
    (a GB300 with a CUDA 13.0 driver gets cu130). None when the driver is too old for any wheel
    that supports the GPU. An unknown driver CUDA version gets the newest index."""
    fits = [tag for tag, cuda in WHEEL_INDEXES
            if cuda >= needed_cuda(capability) and (driver_cuda is None or cuda <= driver_cuda)]
    return f"{INDEX_ROOT}/{fits[-1]}" if fits else None


def cpu_wheel_index(system: str | None = None, machine: str | None = None) -> str | None:
    """The index for a machine without an NVIDIA GPU: PyTorch's CPU index on Linux x86_64 and aarch64,
    None (PyPI) elsewhere. Defaults to this machine's platform.system() and platform.machine()."""
    system = platform.system() if system is None else system
    machine = platform.machine() if machine is None else machine
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine.lower())
    return CPU_INDEX if (system, machine) in CPU_INDEX_PLATFORMS else None


def index_url(report: SmiReport) -> str | None:
    """What `selfcheck.py --index-url` prints (None: print nothing, pip uses PyPI):
    - a GPU listed: wheel_index for it (None when the driver is too old for any wheel: the set-up check
      then says to update the driver);
    - nvidia-smi present but failing: None, the default build, since a GPU is probably there;
    - no nvidia-smi, or one that lists no GPU: cpu_wheel_index()."""
    if report.error is None and report.gpus:
        return wheel_index(report.gpus[0].capability, report.cuda)
    if report.error is not None:
        return None
    return cpu_wheel_index()


REACH_TIMEOUT_S = 5


def index_reachable(url: str, timeout: float = REACH_TIMEOUT_S) -> str | None:
    """None when the package index at `url` answers (any HTTP status: the server is there), else why not in
    a few words. One request, so that a machine that cannot reach the index falls back at once instead of
    letting pip retry every download (on such a machine pip printed 116 warnings before giving up)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as err:
        why = getattr(err, "reason", None) or err
        return " ".join(str(why).split())[:120] or type(err).__name__
    return None


def reachable_index(url: str) -> str:
    """What `selfcheck.py --reachable URL` prints: URL when it answers, else "" (pip's default, PyPI), with one
    line on stderr saying what happened."""
    if not url:
        return ""
    why = index_reachable(url)
    if why is None:
        return url
    if url.rstrip("/").endswith("/cpu"):  # no CPU build on PyPI for Linux: say what comes instead, and its size
        print(f"setup: {url}, the index of torch's CPU build, does not answer ({why}): installing torch from PyPI "
              "instead, on Linux x86_64 its CUDA build with the nvidia-* libraries (.venv ~6 GB instead of ~2.5 GB, "
              "and a CUDA warning at each start); TORCH_INDEX=<a CPU index you can reach> avoids it",
              file=sys.stderr, flush=True)
    else:
        print(f"setup: {url} does not answer ({why}): installing torch from PyPI instead (on Linux x86_64 its CUDA "
              "build; TORCH_INDEX=... chooses another index)", file=sys.stderr, flush=True)
    return ""


def capability_text(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]} = sm_{capability[0]}{capability[1]}"


def version_text(v: tuple[int, int] | None) -> str:
    return "unknown" if v is None else f"{v[0]}.{v[1]}"


def _python_name() -> str:
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def _fixes(report: SmiReport, gpu: Gpu) -> str:
    """The three ways out, with the commands for this architecture, GPU and driver."""
    machine = platform.machine() or "unknown"
    index = wheel_index(gpu.capability, report.cuda)
    need = needed_cuda(gpu.capability)
    lines = []
    if index is None:
        best = " (CUDA 13.0 for the best support of Blackwell)" if need >= (12, 8) else ""
        lines.append(f"The driver ({report.driver or 'version unknown'}) supports CUDA {version_text(report.cuda)}; "
                     f"PyTorch wheels for this GPU need a driver for CUDA {version_text(need)} or newer{best}: "
                     "update the NVIDIA driver first.")
        index = f"{INDEX_ROOT}/{WHEEL_INDEXES[-1][0]}"
    cu = index.rsplit("/", 1)[1]
    if machine == "aarch64":
        lines.append("On aarch64 the torch wheel PyPI serves may be a CPU-only build; the CUDA builds come from "
                     "PyTorch's own "
                     f"index ({cu}: CUDA {cu[2:-1]}.{cu[-1]}).")
    else:
        lines.append(f"On {machine}, take the CUDA build from PyTorch's index ({cu}: CUDA {cu[2:-1]}.{cu[-1]}).")
    py = _python_name()
    lines += [
        "Fix it in one of three ways:",
        f"  1. replace torch in this Python ({py}):",
        f"       {py} -m pip uninstall -y torch && {py} -m pip install torch --index-url {index}",
        "  2. or let make build the project's own environment with it:",
        f"       make clean && make setup USE_VENV=1 TORCH_INDEX={index}",
        "  3. or use the container (NGC PyTorch: torch, Triton and CUDA built for Hopper and Blackwell):",
        f"       {DOCKER_BUILD}",
        f"       {DOCKER_RUN}",
        "(CPU_DEMO=1 runs the CPU demo on this machine anyway.)",
    ]
    return "\n".join(lines)


def _arch_supported(arch_list: list[str], cc: tuple[int, int]) -> bool:
    """Whether torch carries code for a GPU of compute capability cc: machine code (sm_XY) of the same
    major version and a minor version no newer than the GPU's, or PTX (compute_XY) no newer than it."""
    for arch in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)[af]?", arch)
        if not m:
            continue
        major, minor = int(m.group(2)), int(m.group(3))
        if m.group(1) == "sm" and major == cc[0] and minor <= cc[1]:
            return True
        if m.group(1) == "compute" and (major, minor) <= cc:
            return True
    return False


def torch_gpu_problem() -> str | None:
    """None when there is no NVIDIA GPU, or when torch can use it; otherwise what is wrong and what to do."""
    return diagnose()[1]


def diagnose(report: SmiReport | None = None) -> tuple[SmiReport, str | None]:
    """(what nvidia-smi says, torch_gpu_problem's answer); pass a report to skip asking nvidia-smi again."""
    report = nvidia_smi_report() if report is None else report
    return report, _problem(report)


def _problem(report: SmiReport) -> str | None:
    if not report.found:
        return None
    if report.error is not None:
        return (f"setup: {report.error}\n"
                "nvidia-smi is installed but cannot talk to the NVIDIA driver, so no GPU can be used: the driver "
                "is not loaded, or does not match the installed utilities (common after a driver or kernel "
                "update; a reboot usually fixes it). Check with `nvidia-smi`; in a container, start it with "
                "--gpus all.\n(CPU_DEMO=1 runs the CPU demo on this machine anyway.)")
    if not report.gpus:
        return None
    gpu = report.gpus[0]
    where = (f"{gpu.name} (compute capability {capability_text(gpu.capability)}; driver {report.driver or 'unknown'}, "
             f"CUDA {version_text(report.cuda)})")
    try:
        import torch
    except Exception as e:  # not installed, or installed but broken (a missing CUDA library)
        return (f"setup: {where} is present, but torch cannot be imported by {sys.executable} ({e}).\n"
                + _fixes(report, gpu))
    build = f"torch {torch.__version__} ({sys.executable})"
    if getattr(torch.version, "cuda", None) is None:
        kind = "a ROCm build" if getattr(torch.version, "hip", None) else "a CPU-only build"
        return (f"setup: {where} is present, but {build} is {kind}: every script would run the tiny CPU "
                f"demo instead of using the GPU.\n" + _fixes(report, gpu))
    torch_cuda = tuple(int(x) for x in re.findall(r"\d+", torch.version.cuda)[:2])
    if not torch.cuda.is_available():
        if report.cuda is not None and torch_cuda > report.cuda:
            return (f"setup: {where} is present, but {build} is built for CUDA {torch.version.cuda}, newer "
                    f"than the driver supports (CUDA {version_text(report.cuda)}): torch cannot use the GPU.\n"
                    + _fixes(report, gpu))
        try:
            torch.cuda.init()
            why = "torch.cuda.is_available() is False"
        except Exception as e:
            why = f"CUDA does not start: {first_line(str(e))}"
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if hidden is not None:
            why += f" (CUDA_VISIBLE_DEVICES={hidden!r} chooses which GPUs torch sees)"
        return (f"setup: {where} is present and {build} is built for CUDA {torch.version.cuda}, but "
                f"{why}.\n" + _fixes(report, gpu))
    major, minor = torch.cuda.get_device_capability(0)
    arch_list = list(torch.cuda.get_arch_list())
    if arch_list and not _arch_supported(arch_list, (major, minor)):
        return (f"setup: {where} is present, but {build}, built with CUDA {torch.version.cuda}, has no code "
                f"for compute capability {major}.{minor} (it carries {' '.join(arch_list)}): its CUDA version is "
                f"too old for this GPU.{blackwell_note((major, minor))}\n" + _fixes(report, gpu))
    try:
        torch.ones(4, device="cuda").add_(1).sum().item()
    except RuntimeError as e:
        if any(s in str(e).lower() for s in BUSY_ERRORS):  # the GPU is full or held: torch is fine
            return busy_gpu_message(where, first_line(str(e)))
        return (f"setup: {where} is present, but {build} (CUDA {torch.version.cuda}) fails to run on it: "
                f"{first_line(str(e))}\n" + _fixes(report, gpu))
    return triton_toolchain_problem((major, minor))


def _version_tuple(text: str | None, parts: int) -> tuple | None:
    """'3.5.0+git1234' -> (3, 5, 0); None for None or text without a version."""
    numbers = re.findall(r"\d+", (text or "").split("+")[0])
    return tuple(int(n) for n in numbers[:parts]) if len(numbers) >= parts else None


def triton_problem(capability: tuple[int, int], triton_version: str | None, ptxas_version: str | None,
                   ptxas_path: str = "its ptxas", variable: str = "TRITON_PTXAS_PATH") -> str | None:
    """One line when this Triton, or the ptxas it assembles with (at `ptxas_path`, chosen by the environment
    variable `variable`), cannot build kernels for a GPU of this compute capability (the comment at
    BROKEN_TRITON); None when it can, or a version is unknown."""
    cc = tuple(capability)
    broken = BROKEN_TRITON.get(cc, {}).get(_version_tuple(triton_version, 3))
    if broken:
        return (f"setup: Triton {triton_version} cannot compile matmuls for sm_{cc[0]}{cc[1]} ({broken}): "
                f"pip install -U 'triton>={FIXED_TRITON}' (with a torch that accepts it)")
    ptxas = _version_tuple(ptxas_version, 2)
    if gpu_arch.arch_family(cc) in (gpu_arch.OLDER, gpu_arch.HOPPER) or ptxas is None:
        return None
    need = needed_cuda(cc)
    if ptxas < need:
        return (f"setup: Triton {triton_version} assembles with ptxas {version_text(ptxas)} ({ptxas_path}), which "
                f"cannot compile for sm_{cc[0]}{cc[1]}: set {variable} to the ptxas of CUDA {version_text(need)} or "
                f"newer, e.g. /usr/local/cuda/bin/ptxas")
    return None


def triton_toolchain(capability: tuple[int, int]) -> tuple[str | None, str | None, str, str]:
    """(Triton's version, the version of the ptxas it uses for a GPU of this capability, that ptxas's path,
    the variable that chooses it); the versions None where they cannot be told (no Triton, or a layout this
    does not know)."""
    unknown = "its ptxas", "TRITON_PTXAS_PATH"
    try:
        import triton
        from triton import knobs
        from triton.backends.nvidia import compiler
    except Exception:  # no Triton, no NVIDIA backend, or one older than triton.knobs (3.4): nothing to check
        return None, None, *unknown
    try:
        arch = int(capability[0]) * 10 + int(capability[1])
        takes_arch = bool(inspect.signature(compiler.get_ptxas).parameters)  # Triton 3.6 on: per architecture
        tool = compiler.get_ptxas(arch) if takes_arch else compiler.get_ptxas()
        blackwell = getattr(knobs.nvidia, "ptxas_blackwell", None)
        variable = ("TRITON_PTXAS_BLACKWELL_PATH" if blackwell is not None and blackwell.path == tool.path
                    else "TRITON_PTXAS_PATH")
        return triton.__version__, str(tool.version), str(tool.path), variable
    except Exception:  # a ptxas that does not run, or a Triton laid out otherwise: not refused here
        return triton.__version__, None, *unknown


def triton_toolchain_problem(capability: tuple[int, int]) -> str | None:
    """`triton_problem` for the Triton installed here and a GPU of this compute capability."""
    version, ptxas, path, variable = triton_toolchain(capability)
    return triton_problem(capability, version, ptxas, path, variable)


# What CUDA says when the GPU works but has no room for this process (its memory taken by others), or is
# held by another process in exclusive compute mode: nothing a reinstall of torch changes.
BUSY_ERRORS = ("out of memory", "busy or unavailable", "cudaerrordevicesunavailable")


def gpu_memory_and_holders() -> tuple[str | None, list[str]]:
    """('used X of Y MiB on GPU 0', ['pid 123 python 70000 MiB', ...]) from nvidia-smi; None / [] where it
    cannot say (inside a container nvidia-smi often lists no processes of other containers)."""
    rc, out = _run_smi(["--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"])
    memory = None
    parts = [p.strip() for p in out.splitlines()[0].split(",")] if rc == 0 and out else []
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        used, total = int(parts[0]), int(parts[1])
        memory = f"{total - used:,} MiB free of {total:,} MiB on GPU 0"
    rc, out = _run_smi(["--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"])
    holders = []
    for line in out.splitlines() if rc == 0 else []:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0].isdigit():
            holders.append(f"pid {fields[0]} ({fields[1]}): {fields[2]} MiB")
    return memory, holders


def busy_gpu_message(where: str, error: str) -> str:
    """The GPU works, but other processes hold its memory (or hold it in exclusive mode): who, and how much."""
    memory, holders = gpu_memory_and_holders()
    lines = [f"setup: {where} is present and torch can use it, but it is busy: {error}"]
    if memory:
        lines.append(f"  memory: {memory}")
    if holders:
        lines.append("  held by: " + "; ".join(holders))
    else:
        lines.append("  nvidia-smi lists no process holding it here (processes of other containers are not listed)")
    lines.append("Wait for those processes to end, or stop them (nvidia-smi lists them), or choose another GPU with "
                 "CUDA_VISIBLE_DEVICES. torch itself is installed correctly: do not reinstall it.")
    return "\n".join(lines)


_cpu_note_printed = False


def model_named(argv: list[str]) -> str | None:
    """--model's value in a script's arguments, read before they are parsed (None when not given)."""
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return None


def cpu_demo_note(reason: str = "no NVIDIA GPU found", model: str | None = None) -> str:
    """The one line that says this run is on the CPU: the CPU demo (llama-tiny, the scripts' default there), or
    the model --model names."""
    if model and model != "llama-tiny":
        note = (f"{reason}: this run is on the CPU (--model {model}; any Triton kernel runs in Triton's "
                "interpreter); its timings are not meaningful.")
    else:
        note = (f"{reason}: this is the CPU demo (the tiny llama-tiny model; any Triton kernel runs in Triton's "
                "interpreter); its timings are not meaningful.")
    if Path("/.dockerenv").exists() or os.environ.get("NVIDIA_PYTORCH_VERSION"):
        note += " Inside a container, the GPU is visible only when it was started with --gpus all."
    return note


def check_or_exit(argv: list[str] | None = None) -> None:
    """Call at the start of a script: exit with code 1 and the fix when an NVIDIA GPU is present but the
    torch in use cannot use it; on a machine without a GPU, say once per process that this run is on the CPU
    (the CPU demo, or the model --model names in `argv`, by default the script's arguments)."""
    global _cpu_note_printed
    report, problem = diagnose()
    if problem is not None and not _cpu_demo():
        raise SystemExit(problem)
    if problem is None and report.gpus:
        return
    if not _cpu_note_printed:
        _cpu_note_printed = True
        print(cpu_demo_note(_reason(problem), model_named(sys.argv[1:] if argv is None else argv)), flush=True)


def _cpu_demo() -> bool:
    """CPU_DEMO=1 (environment.cpu_demo); a value other than 1 or 0 ends the check with one line, exit code 2."""
    try:
        return environment.cpu_demo()
    except environment.BadValue as err:
        raise environment.refused(err) from None


def _reason(problem: str | None) -> str:
    if problem is None:
        return "no NVIDIA GPU found"
    return "CPU_DEMO=1 is set, so the GPU is left unused (" + first_line(problem)[len("setup: "):] + ")"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--index-url"]:
        print(index_url(nvidia_smi_report()) or "")
        return 0
    if len(args) == 2 and args[0] == "--reachable":
        print(reachable_index(args[1]))
        return 0
    if args:
        print("usage: python selfcheck.py --setup | --index-url | --reachable URL", file=sys.stderr)
        return 2
    report, problem = diagnose()
    if problem is not None:
        print(problem, file=sys.stderr, flush=True)
        if not _cpu_demo():
            return 1
        print(f"setup: OK: {cpu_demo_note(_reason(problem))}")
        return 0
    if report.gpus:
        import torch

        gpu = report.gpus[0]
        more = f" (and {len(report.gpus) - 1} more)" if len(report.gpus) > 1 else ""
        print(f"setup: OK: {gpu.name}{more}, compute capability {capability_text(gpu.capability)}, driver "
              f"{report.driver or 'unknown'} (CUDA {version_text(report.cuda)}); torch {torch.__version__} "
              f"(CUDA {torch.version.cuda}) uses it.")
        built = tuple(int(x) for x in re.findall(r"\d+", torch.version.cuda or "")[:2]) or None
        note = build_note(gpu.capability, built)
        if note:
            print(note)
    else:
        print(f"setup: OK: {cpu_demo_note()}")
    return 0

