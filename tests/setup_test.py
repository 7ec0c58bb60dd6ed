"""Set-up cannot degrade silently: playbook/runtime/setup_check.py (`selfcheck.py --setup`, `selfcheck.py --index-url`),
the Makefile's use of it, .ci/run, the container files, selfcheck.py.

A GPU is simulated by a fake `nvidia-smi` first on PATH, so these tests run on any machine. Tests that
need torch itself to be a CPU-only build (the real "GPU present, CPU torch" case) are skipped where the
installed torch has CUDA; the others stand a small stand-in for torch in sys.modules.
"""

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from playbook.runtime import setup_check
import selfcheck

HERE = Path(__file__).resolve().parent.parent  # the repository root
CU130 = "https://download.pytorch.org/whl/cu130"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SETUP = [sys.executable, "selfcheck.py", "--setup"]  # the quick set-up check
INDEX_URL = [sys.executable, "selfcheck.py", "--index-url"]
MAKE = shutil.which("make") or "make"  # by full path: some tests leave only a fake nvidia-smi on PATH

HEADER = """\
Sun Nov 23 08:44:00 2025
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: {cuda}     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  {name:<30} On  |   00000009:01:00.0 Off |                    0 |
| N/A   34C    P0            180W / 1400W |       0MiB / {mem}MiB |      0%      Default |
+-----------------------------------------+------------------------+----------------------+
"""
BROKEN = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
          "Make sure that the latest NVIDIA driver is installed and running.")


def _torch_is_cpu_build() -> bool:
    import torch

    return torch.version.cuda is None


needs_cpu_torch = pytest.mark.skipif(not _torch_is_cpu_build(),
                                     reason="simulates a GPU next to a CPU-only torch; this torch has CUDA")


def fake_smi(folder: Path, name="NVIDIA GB300", cc="10.3", mem=284208, cuda="13.0", broken=False) -> Path:
    """A folder holding an `nvidia-smi` that answers like the real one (or fails like one without a driver)."""
    folder.mkdir(parents=True, exist_ok=True)
    if broken:
        body = f'echo "{BROKEN}"\nexit 1\n'
    else:
        header = " ".join("'" + line + "'" for line in HEADER.format(name=name, cuda=cuda, mem=mem).splitlines())
        body = textwrap.dedent(f"""\
            case "$*" in
              *--query-gpu=name,compute_cap,memory.total*) echo "{name}, {cc}, {mem}" ;;
              "") printf '%s\\n' {header} ;;
              *) echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 2 ;;
            esac
            """)  # shell built-ins only: the tests may leave nothing else on PATH
    path = folder / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return folder


def _env(path_first: Path | None, keep_path=True, **extra) -> dict:
    drop = ("CPU_DEMO", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHON", "USE_VENV", "TORCH_INDEX", "TORCH_SPEC")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    parts = ([str(path_first)] if path_first else []) + ([os.environ.get("PATH", "")] if keep_path else [])
    env["PATH"] = os.pathsep.join(parts)
    env.update(extra)
    return env


def _run(cmd, env, cwd=HERE, timeout=120) -> subprocess.CompletedProcess:
    """Run cmd in its own process group; on timeout the whole group is stopped and the test fails."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"{cmd} ran past {timeout} s: the set-up check did not stop it")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


class StandInTorch(types.ModuleType):
    """Just enough of torch for setup: a build's CUDA version, whether CUDA starts, its code list."""

    def __init__(self, cuda=None, available=False, capability=(10, 3), arches=(), init_error=None, run_error=None):
        super().__init__("torch")
        self.__version__ = "2.13.0" + ("" if cuda else "+cpu")
        self.version = types.SimpleNamespace(cuda=cuda, hip=None)

        def init():
            if init_error:
                raise RuntimeError(init_error)

        def ones(*a, **k):
            if run_error:
                raise RuntimeError(run_error)
            return types.SimpleNamespace(add_=lambda x: types.SimpleNamespace(
                sum=lambda: types.SimpleNamespace(item=lambda: 8.0)))

        self.cuda = types.SimpleNamespace(is_available=lambda: available, init=init,
                                          get_device_capability=lambda i=0: capability,
                                          get_arch_list=lambda: list(arches))
        self.ones = ones


@pytest.fixture
def gpu_machine(tmp_path, monkeypatch):
    """This process sees a GB300 with a CUDA 13.0 driver; returns a function to put a stand-in torch in place."""
    monkeypatch.setenv("PATH", str(fake_smi(tmp_path / "bin")) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CPU_DEMO", raising=False)

    def with_torch(**kw):
        monkeypatch.setitem(sys.modules, "torch", StandInTorch(**kw))
    return with_torch


# ---------------------------------------------------------------- nvidia-smi


def test_fake_gb300_is_read_like_a_real_nvidia_smi(gpu_machine):
    r = setup_check.nvidia_smi_report()
    assert r.found and r.error is None
    assert [(g.name, g.capability, g.memory_mib) for g in r.gpus] == [("NVIDIA GB300", (10, 3), 284208)]
    assert (r.driver, r.cuda) == ("580.95.05", (13, 0))
    assert setup_check.gpu_present()


def test_parsers_on_real_output_shapes():
    assert setup_check.parse_header(HEADER.format(name="NVIDIA H200", cuda="12.8", mem=143771)) == \
        ("580.95.05", (12, 8))
    assert setup_check.parse_header("no table here") == (None, None)
    two = setup_check.parse_query("NVIDIA H100 80GB HBM3, 9.0, 81559\nNVIDIA H100 80GB HBM3, 9.0, 81559\n")
    assert [(g.capability, g.memory_mib) for g in two] == [((9, 0), 81559)] * 2
    # drivers that cannot report compute_cap: name and memory only, the capability taken from the name
    assert setup_check.parse_query("NVIDIA GB300, 284208")[0].capability == (10, 3)
    assert setup_check.parse_query("") == []


def test_no_nvidia_smi_is_ok_and_says_cpu_demo_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi anywhere
    assert not setup_check.gpu_present()
    assert setup_check.torch_gpu_problem() is None
    monkeypatch.setattr(setup_check, "_cpu_note_printed", False)
    setup_check.check_or_exit()
    setup_check.check_or_exit()
    out = capsys.readouterr().out
    assert out.count("this is the CPU demo") == 1, out
    assert "timings are not meaningful" in out


def test_cli_without_nvidia_smi_exits_0(tmp_path):
    p = _run(SETUP, _env(tmp_path, keep_path=False))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("setup: OK: no NVIDIA GPU found: this is the CPU demo"), p.stdout


def test_broken_nvidia_smi_is_said_clearly(tmp_path):
    p = _run(SETUP, _env(fake_smi(tmp_path, broken=True)))
    assert p.returncode == 1
    assert f"setup: nvidia-smi failed (exit code 1): {BROKEN}" in p.stderr
    assert "cannot talk to the NVIDIA driver" in p.stderr and "Traceback" not in p.stderr
    assert "CPU_DEMO=1" in p.stderr


def test_cpu_demo_1_goes_on_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(fake_smi(tmp_path, broken=True)))
    monkeypatch.setenv("CPU_DEMO", "1")
    monkeypatch.setattr(setup_check, "_cpu_note_printed", False)
    setup_check.check_or_exit()  # no SystemExit
    out = capsys.readouterr().out
    assert "CPU_DEMO=1 is set" in out and "nvidia-smi failed" in out and "CPU demo" in out


# ---------------------------------------------------------------- which wheels


@pytest.mark.parametrize("cc, driver, index", [
    ((10, 3), (13, 0), "cu130"),   # GB300, CUDA 13 driver
    ((10, 3), (12, 9), "cu129"),
    ((10, 0), (12, 8), "cu128"),   # B200: 12.8 is the first CUDA with Blackwell
    ((10, 3), (12, 6), None),      # driver too old for any Blackwell wheel
    ((9, 0), (12, 6), "cu126"),    # H100 / H200
    ((9, 0), (13, 1), "cu130"),    # the newest index the driver supports
    ((9, 0), (12, 4), None),
    ((10, 3), None, "cu130"),      # driver CUDA unknown: the newest
])
def test_wheel_index(cc, driver, index):
    got = setup_check.wheel_index(cc, driver)
    assert got == (None if index is None else f"https://download.pytorch.org/whl/{index}")


@pytest.mark.parametrize("system, machine, index", [
    ("Linux", "x86_64", CPU_INDEX),    # PyPI's torch is a CUDA build that pulls in the nvidia-* libraries
    ("Linux", "aarch64", CPU_INDEX),   # the same on ARM servers (torch 2.13: a cu13 build)
    ("Linux", "arm64", CPU_INDEX),     # the same machine, as some systems spell it
    ("Darwin", "arm64", None),         # PyPI's macOS torch has no CUDA (MPS on Apple silicon)
    ("Darwin", "x86_64", None),
    ("Windows", "AMD64", None),        # PyPI's Windows torch is CPU-only
    ("Linux", "ppc64le", None),        # no wheels on the CPU index: PyPI decides
])
def test_cpu_wheel_index(system, machine, index):
    assert setup_check.cpu_wheel_index(system, machine) == index


def test_index_url_for_each_kind_of_machine(monkeypatch):
    report = setup_check.SmiReport
    gb300 = [setup_check.Gpu("NVIDIA GB300", (10, 3), 284208)]
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert setup_check.index_url(report(found=True, gpus=gb300, cuda=(13, 0))) == CU130
    assert setup_check.index_url(report(found=True, gpus=gb300, cuda=(12, 4))) is None  # driver too old: it says so
    assert setup_check.index_url(report(found=False)) == CPU_INDEX
    assert setup_check.index_url(report(found=True)) == CPU_INDEX  # nvidia-smi there, no GPU listed
    assert setup_check.index_url(report(found=True, error="nvidia-smi failed")) is None  # a GPU, probably
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert setup_check.index_url(report(found=False)) is None


def test_index_url_option(tmp_path):
    p = _run(INDEX_URL, _env(fake_smi(tmp_path)))
    assert (p.returncode, p.stdout.strip()) == (0, CU130)
    p = _run(INDEX_URL, _env(tmp_path / "none", keep_path=False))  # no nvidia-smi
    assert (p.returncode, p.stdout.strip()) == (0, setup_check.cpu_wheel_index() or ""), p.stderr
    p = _run(INDEX_URL, _env(fake_smi(tmp_path / "broken", broken=True)))
    assert (p.returncode, p.stdout.strip()) == (0, ""), p.stderr


# ---------------------------------------------------------------- GPU present, torch cannot use it


@needs_cpu_torch
def test_cli_gpu_with_cpu_torch_exits_1_with_the_index(tmp_path):
    """The real case, with the real (CPU-only) torch: python selfcheck.py --setup on a 'GB300'."""
    p = _run(SETUP, _env(fake_smi(tmp_path)))
    assert p.returncode == 1, p.stdout + p.stderr
    first = p.stderr.splitlines()[0]
    assert first.startswith("setup: NVIDIA GB300 (compute capability 10.3 = sm_103; driver 580.95.05, "
                            "CUDA 13.0) is present, but torch ") and "is a CPU-only build" in first, first
    assert f"pip install torch --index-url {CU130}" in p.stderr
    assert f"make clean && make setup USE_VENV=1 TORCH_INDEX={CU130}" in p.stderr
    assert f"On {platform.machine()}" in p.stderr
    assert "docker build -t kernel-dev-ft ." in p.stderr and "docker run --gpus all" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("machine, says", [
    ("x86_64", "On x86_64, take the CUDA build from PyTorch's index (cu130: CUDA 13.0)"),
    ("aarch64", ("On aarch64 the torch wheel PyPI serves may be a CPU-only build; the CUDA builds come from PyTorch's own "
                 "index (cu130: CUDA 13.0)")),
])
def test_cpu_torch_message_per_architecture(gpu_machine, monkeypatch, machine, says):
    gpu_machine(cuda=None)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    msg = setup_check.torch_gpu_problem()
    assert msg is not None and "is a CPU-only build" in msg
    assert says in msg
    other = "aarch64" if machine == "x86_64" else "x86_64"
    assert f"On {other}" not in msg
    assert f"-m pip install torch --index-url {CU130}" in msg


def test_check_or_exit_stops_with_the_message(gpu_machine):
    gpu_machine(cuda=None)
    with pytest.raises(SystemExit) as e:
        setup_check.check_or_exit()
    assert isinstance(e.value.code, str) and "CPU-only build" in e.value.code and CU130 in e.value.code


def test_cuda_build_without_code_for_this_gpu(gpu_machine):
    gpu_machine(cuda="12.6", available=True, capability=(10, 3), arches=("sm_80", "sm_90"))
    msg = setup_check.torch_gpu_problem()
    assert msg is not None
    assert "has no code for compute capability 10.3 (it carries sm_80 sm_90)" in msg
    assert "Blackwell, datacenter (sm_103) needs PyTorch wheels for CUDA 12.9 or newer; cu130 serves it best" in msg
    assert f"--index-url {CU130}" in msg


def test_cuda_build_that_fits_is_ok(gpu_machine, capsys):
    gpu_machine(cuda="13.0", available=True, capability=(10, 3), arches=("sm_90", "sm_100", "sm_120"))
    assert setup_check.torch_gpu_problem() is None  # sm_100 code runs on sm_103
    setup_check.check_or_exit()
    assert capsys.readouterr().out == ""  # a usable GPU: nothing to say


def test_cuda_build_newer_than_the_driver(tmp_path, monkeypatch):
    # a B200: CUDA 12.8 is the first for sm_100 (a GB300, sm_103, needs 12.9: tests/blackwell_test.py)
    monkeypatch.setenv("PATH", str(fake_smi(tmp_path, name="NVIDIA B200", cc="10.0", cuda="12.8")))
    monkeypatch.setitem(sys.modules, "torch", StandInTorch(cuda="13.0", available=False))
    msg = setup_check.torch_gpu_problem()
    assert "is built for CUDA 13.0, newer than the driver supports (CUDA 12.8)" in msg
    assert "https://download.pytorch.org/whl/cu128" in msg


def test_driver_too_old_for_blackwell_says_update_the_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_smi(tmp_path, cuda="12.4")))
    monkeypatch.setitem(sys.modules, "torch", StandInTorch(cuda=None))
    msg = setup_check.torch_gpu_problem()
    assert "supports CUDA 12.4" in msg and "update the NVIDIA driver first" in msg


def test_cuda_that_does_not_start_or_run_is_reported(gpu_machine):
    gpu_machine(cuda="13.0", available=False, init_error="Found no NVIDIA driver on your system.")
    assert "CUDA does not start: Found no NVIDIA driver on your system." in setup_check.torch_gpu_problem()
    gpu_machine(cuda="13.0", available=True, arches=("sm_100",),
                run_error="CUDA error: no kernel image is available for execution on the device\nmore")
    assert "fails to run on it: CUDA error: no kernel image" in setup_check.torch_gpu_problem()


def test_a_busy_gpu_is_not_called_a_broken_install(tmp_path, monkeypatch):
    """CUDA out of memory (or a GPU held in exclusive mode) at the first launch: the free and total memory and
    the processes holding it, from nvidia-smi, and no advice to reinstall torch. Only an error of the build
    itself (no kernel image) gets the reinstall advice (test_cuda_that_does_not_start_or_run_is_reported)."""
    folder = fake_smi(tmp_path / "bin")
    smi = folder / "nvidia-smi"
    smi.write_text(smi.read_text().replace(
        "  *) echo", "  *--query-gpu=memory.used,memory.total*) echo \"140800, 143771\" ;;\n"
        "  *--query-compute-apps=*) echo \"4242, python3, 98000\"; echo \"4343, /usr/bin/trainer, 42800\" ;;\n  *) echo", 1))
    monkeypatch.setenv("PATH", str(folder) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CPU_DEMO", raising=False)
    for error in ("CUDA error: out of memory\nCUDA kernel errors might be reported asynchronously",
                  "CUDA error: CUDA-capable device(s) is/are busy or unavailable"):
        monkeypatch.setitem(sys.modules, "torch", StandInTorch(cuda="13.0", available=True, arches=("sm_100",),
                                                               run_error=error))
        msg = setup_check.torch_gpu_problem()
        assert msg.startswith("setup: NVIDIA GB300") and "is busy: " + error.splitlines()[0] in msg, msg
        assert "2,971 MiB free of 143,771 MiB on GPU 0" in msg, msg
        assert "pid 4242 (python3): 98000 MiB; pid 4343 (/usr/bin/trainer): 42800 MiB" in msg, msg
        assert "pip uninstall" not in msg and "index-url" not in msg and "do not reinstall" in msg, msg
    # nvidia-smi that lists no processes (another container's): said so, still no reinstall advice
    smi.write_text(smi.read_text().replace('echo \"4242, python3, 98000\"; echo \"4343, /usr/bin/trainer, 42800\"', "true"))
    msg = setup_check.torch_gpu_problem()
    assert "lists no process holding it" in msg and "pip uninstall" not in msg, msg


def test_importing_setup_check_does_not_import_torch():
    p = _run([sys.executable, "-c", "import sys, selfcheck; from playbook.runtime import setup_check; print('torch' in sys.modules)"], _env(None))
    assert p.stdout.strip() == "False", p.stderr


# ---------------------------------------------------------------- the Makefile runs the check


@pytest.fixture
def sandbox(tmp_path):
    """A copy of the Makefile, selfcheck.py and playbook/runtime/setup_check.py (with gpu_arch.py) whose walkthrough and test suite only
    leave a marker, with set-up already done (nothing is installed), and a CPU-only stand-in for torch and
    triton on PYTHONPATH (importing them takes no time, whatever torch is installed)."""
    box = tmp_path / "box"
    box.mkdir()
    (box / "playbook" / "runtime").mkdir(parents=True)
    (box / "core").mkdir()
    for name in ("Makefile", "selfcheck.py", "playbook/__init__.py", "playbook/runtime/__init__.py",
                 "playbook/runtime/setup_check.py", "core/__init__.py",
                 "core/gpu_arch.py", "playbook/startup.py", "playbook/runtime/signals.py", "playbook/runtime/environment.py",
                 "playbook/runtime/output.py",
                 "requirements.txt", "pytest.ini"):
        shutil.copy(HERE / name, box / name)
    (box / "walkthrough.py").write_text("open('walkthrough.ran', 'w').close()\n")
    (box / "marker_test.py").write_text("def test_marker():\n    open('tests.ran', 'w').close()\n")
    later = time.time() + 60
    (box / ".deps-system").touch()
    os.utime(box / ".deps-system", (later, later))
    stand_in = tmp_path / "stand_in"
    (stand_in / "torch").mkdir(parents=True)
    (stand_in / "torch" / "__init__.py").write_text(
        '__version__ = "2.13.0+cpu"\n\n\nclass version:\n    cuda = None\n    hip = None\n')
    (stand_in / "triton").mkdir()
    (stand_in / "triton" / "__init__.py").write_text('__version__ = "3.9.0"\n')
    return box, str(stand_in)


def _venv(box: Path) -> None:
    """The .venv path: a finished .venv whose python is this one."""
    (box / ".venv" / "bin").mkdir(parents=True)
    py = box / ".venv" / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    later = time.time() + 60
    (box / ".venv" / ".done").touch()
    os.utime(box / ".venv" / ".done", (later, later))


def test_make_run_stops_on_the_system_python_path(sandbox, tmp_path):
    box, stand_in = sandbox
    p = _run([MAKE, "run", f"PYTHON={sys.executable}"], _env(fake_smi(tmp_path / "bin"), PYTHONPATH=stand_in),
             cwd=box)
    assert p.returncode != 0
    assert f"{sys.executable} selfcheck.py --setup" in p.stdout  # make chose this python, not a .venv
    assert "torch 2.13.0+cpu" in p.stderr and "is a CPU-only build" in p.stderr and CU130 in p.stderr
    assert not (box / "walkthrough.ran").exists()


def test_make_test_stops_on_the_venv_path(sandbox, tmp_path):
    box, stand_in = sandbox
    _venv(box)
    p = _run([MAKE, "test"], _env(fake_smi(tmp_path / "bin"), PYTHONPATH=stand_in), cwd=box)
    assert p.returncode != 0
    assert ".venv/bin/python selfcheck.py --setup" in p.stdout
    assert "is a CPU-only build" in p.stderr
    assert not (box / "tests.ran").exists()


def test_make_run_and_test_go_on_when_the_check_passes(sandbox, tmp_path):
    """The control for the two tests above: the same sandbox reaches the walkthrough and the tests when the
    check passes (here: no GPU)."""
    box, stand_in = sandbox
    _venv(box)
    p = _run([MAKE, "run", "test"], _env(tmp_path / "empty", keep_path=False, PYTHONPATH=stand_in), cwd=box)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "setup: OK: no NVIDIA GPU found" in p.stdout
    assert (box / "walkthrough.ran").exists() and (box / "tests.ran").exists()


def test_make_goes_on_with_cpu_demo_1(sandbox, tmp_path):
    box, stand_in = sandbox
    p = _run([MAKE, "run", f"PYTHON={sys.executable}"],
             _env(fake_smi(tmp_path / "bin"), PYTHONPATH=stand_in, CPU_DEMO="1"), cwd=box)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "setup: OK: CPU_DEMO=1 is set, so the GPU is left unused (NVIDIA GB300" in p.stdout
    assert (box / "walkthrough.ran").exists()


def _torch_install(make_n: str) -> tuple[str, str]:
    """(torch spec, index) of the torch install in `make -n` output: the index is asked once
    (`selfcheck.py --reachable '<index>'`, '' for PyPI), then pip uses whatever that printed."""
    index = re.search(r"selfcheck\.py --reachable '([^']*)'", make_n)
    spec = re.search(r"pip install -q (\S+) \$\{index:\+--index-url \"\$index\"\}\n", make_n)
    assert index and spec, make_n
    return spec.group(1), index.group(1)


def test_makefile_picks_the_index_for_the_gpu(sandbox, tmp_path):
    box, _ = sandbox
    setup = [MAKE, "-n", "-W", "requirements.txt", "setup", "USE_VENV=1", f"PYTHON={sys.executable}"]
    p = _run(setup, _env(fake_smi(tmp_path / "bin"), keep_path=False), cwd=box)
    assert p.returncode == 0, p.stderr
    assert _torch_install(p.stdout) == ("torch", CU130)
    assert p.stdout.splitlines()[-1] == ".venv/bin/python selfcheck.py --setup"  # set-up ends with the check
    p = _run(setup, _env(tmp_path / "empty", keep_path=False), cwd=box)  # no nvidia-smi
    assert p.returncode == 0, p.stderr
    cpu = setup_check.cpu_wheel_index()  # the CPU index on Linux x86_64 / aarch64, else PyPI
    assert _torch_install(p.stdout) == ("torch", cpu or ""), p.stdout


def test_makefile_keeps_an_explicit_torch_spec_and_index(sandbox, tmp_path):
    """TORCH_SPEC and TORCH_INDEX given on the command line or in the environment win over the machine's
    default, an empty TORCH_INDEX included (PyPI and pip's own find-links: what .ci/run relies on)."""
    box, _ = sandbox
    setup = [MAKE, "-n", "-W", "requirements.txt", "setup", "USE_VENV=1", f"PYTHON={sys.executable}"]
    gpu = _env(fake_smi(tmp_path / "bin"), keep_path=False)
    p = _run(setup + ["TORCH_SPEC=torch==2.13.0", "TORCH_INDEX="], gpu, cwd=box)
    assert _torch_install(p.stdout) == ("torch==2.13.0", ""), p.stdout + p.stderr
    p = _run(setup, {**gpu, "TORCH_SPEC": "torch==2.13.0", "TORCH_INDEX": "https://pypi.org/simple"}, cwd=box)
    assert _torch_install(p.stdout) == ("torch==2.13.0", "https://pypi.org/simple"), p.stdout + p.stderr
    no_gpu = _env(tmp_path / "empty", keep_path=False)
    p = _run(setup + ["TORCH_INDEX=https://download.pytorch.org/whl/cu128"], no_gpu, cwd=box)
    assert _torch_install(p.stdout) == ("torch", "https://download.pytorch.org/whl/cu128"), p.stdout


def test_ci_installs_torch_without_the_cpu_index():
    """CI reaches PyPI only: .ci/run must not leave TORCH_INDEX to the machine's default (PyTorch's CPU index
    on a Linux machine without a GPU); PyPI plus find-links gives it the local CPU wheel of TORCH_SPEC."""
    ci = (HERE / ".ci" / "run").read_text()
    spec = re.search(r'^export TORCH_SPEC="\$\{TORCH_SPEC:-(.+)\}"$', ci, re.M)
    index = re.search(r'^export TORCH_INDEX="\$\{TORCH_INDEX-(.*)\}"$', ci, re.M)
    assert spec and spec.group(1) == "torch==2.13.0"
    assert index and index.group(1) == "https://pypi.org/simple", "TORCH_INDEX must be set before make runs"
    assert ci.index("export TORCH_INDEX") < ci.index("make test")


# ---------------------------------------------------------------- container files


def _dockerfile() -> str:
    return (HERE / "Dockerfile").read_text()


def test_dockerfile_base_image_supports_gb300():
    text = _dockerfile()
    tag = re.search(r"^ARG NGC_TAG=(\d\d)\.(\d\d)-py3\s*$", text, re.M)
    assert tag, "Dockerfile: no `ARG NGC_TAG=<yy.mm>-py3` default"
    assert (int(tag.group(1)), int(tag.group(2))) >= (26, 1), "NGC PyTorch 26.01 or newer is needed for GB300"
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms == ["nvcr.io/nvidia/pytorch:${NGC_TAG}"], froms
    assert text.index("ARG NGC_TAG") < text.index("FROM "), "the ARG must come before FROM to be usable there"


def test_dockerfile_installs_requirements_and_runs_make():
    text = _dockerfile()
    assert re.search(r"^COPY requirements\.txt (\S+)$", text, re.M)
    dest = re.search(r"^COPY requirements\.txt (\S+)$", text, re.M).group(1)
    assert re.search(rf"^RUN pip install .*-r {re.escape(dest)}", text, re.M)
    assert re.search(r"^COPY \. /workspace$", text, re.M)
    assert re.search(r'^CMD \["make", "run"\]$', text, re.M)
    assert setup_check.DOCKER_BUILD in text  # the commands setup_check prints name this image
    assert "-v $(pwd)/results:/workspace/results" in setup_check.DOCKER_RUN and "WORKDIR /workspace" in text


def test_dockerignore_keeps_local_state_out():
    lines = {ln.strip() for ln in (HERE / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")}
    for needed in (".venv", ".git", "results/traces", "__pycache__", "*.pyc", ".whl", ".pytest_cache", "out",
                   "checkpoints"):
        assert needed in lines, f".dockerignore does not exclude {needed}"
    assert "results" not in lines and "requirements.txt" not in lines  # the image needs these


# ---------------------------------------------------------------- selfcheck.py


@pytest.mark.parametrize("name, family", [
    ("NVIDIA GB300", "GB300"), ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA B200", "B200"),
    ("CPU (Triton interpreter)", None),
])
def test_gpu_family(name, family):
    assert selfcheck.gpu_family(name) == family


def test_results_lookup_by_file_name_and_json_gpu_field(tmp_path):
    res = tmp_path / "results"
    (res / "runs").mkdir(parents=True)
    (res / "benchmark_H200.csv").write_text("x")
    (res / "runs" / "fsdp2_2xH200_baseline.log").write_text("x")
    (res / "runs" / "finetune_GH200_b4.log").write_text("x")           # another family
    (res / "runs" / "finetune_H2000.log").write_text("x")              # not H200
    (res / "a.json").write_text('{"gpu": "NVIDIA H200 (140 GiB)"}')
    (res / "b.json").write_text('{"meta": {"gpu": "NVIDIA H200"}, "rows": []}')
    (res / "c.json").write_text('{"gpu": "NVIDIA H100 80GB HBM3"}')
    (res / "d.json").write_text('{"gpu": ')                           # broken JSON is skipped
    (res / "selfcheck_smoke.json").write_text('{"gpu": "NVIDIA H200"}')  # this script's own output
    found = sorted(p.relative_to(res).as_posix() for p in selfcheck.results_from_family("NVIDIA H200", res))
    assert found == ["a.json", "b.json", "benchmark_H200.csv", "runs/fsdp2_2xH200_baseline.log"]
    assert selfcheck.results_note("NVIDIA H200", res).startswith("4 file(s) from the H200 family in results/")
    assert selfcheck.results_note("NVIDIA GB300", res) == \
        "no results from an NVIDIA GB300 in results/ yet: these will be the first"
    assert selfcheck.results_from_family("NVIDIA GB300", tmp_path / "missing") == []


def test_selfcheck_plans_the_commands_the_readme_gives():
    gpu = selfcheck.plan(gpu=True)
    assert gpu[0].cmd is None
    assert gpu[1].cmd[1:] == ["-m", "pytest", "-q", "rmsnorm_test.py"]
    assert gpu[2].cmd[1:10] == ["finetune_optimized.py", "--model", "llama-3.1-8b", "--batch-size", "1",
                                "--seq-len", "1024", "--steps", "3"] and "--timing-warmup-steps" in gpu[2].cmd
    cpu = selfcheck.plan(gpu=False)
    assert cpu[2].cmd[1:5] == ["finetune_optimized.py", "--model", "llama-tiny", "--steps"]
    assert "interpreter" in cpu[1].name
    from playbook.config import make_parser  # the flags still exist and parse

    for check in (gpu[2], cpu[2]):
        make_parser("x", kernels_default=("rmsnorm",)).parse_args(check.cmd[2:])
    assert all(c.cmd is None or c.cmd[0] == sys.executable for c in gpu + cpu)


def test_selfcheck_subprocess_pass_fail_and_timeout():
    ok = selfcheck.Check("t", [sys.executable, "-c", "print('===== 3 passed, 1 skipped in 0.10s =====')", "pytest"])
    selfcheck.run_subprocess(ok)
    assert (ok.result, ok.detail) == ("PASS", "3 passed, 1 skipped in 0.10s") and ok.seconds >= 0
    bad = selfcheck.Check("t", [sys.executable, "-c", "raise SystemExit(3)"])
    selfcheck.run_subprocess(bad)
    assert (bad.result, bad.detail) == ("FAIL", "exit code 3")
    slow = selfcheck.Check("t", [sys.executable, "-c", "import time; time.sleep(30)"])
    selfcheck.run_subprocess(slow, timeout_s=0.5)
    assert (slow.result, slow.detail) == ("FAIL", "stopped after 0.5 s") and slow.seconds < 10


def test_selfcheck_summary_table():
    checks = [selfcheck.Check("set-up", result="PASS", seconds=0.3),
              selfcheck.Check("kernel test", ["x"], result="FAIL", seconds=12.0, detail="1 failed, 3 passed"),
              selfcheck.Check("fine-tune", ["y"], detail="set-up failed")]
    table = selfcheck.summary_table(checks).splitlines()
    assert [c.strip() for c in table[0].split("|")[1:5]] == ["check", "result", "time (s)", "detail"]
    assert len({len(line) for line in table}) == 1  # aligned
    assert "| PASS    | 0.3      |" in table[2]
    assert "| not run | -        | set-up failed" in table[4]
