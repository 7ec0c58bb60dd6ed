"""A new machine's first run: what is on it, and does the playbook work there? (`make selfcheck`)

    $ python selfcheck.py
    $ python selfcheck.py --setup       # only the set-up check: "OK: ..." and exit 0, or the fix and exit 1
    $ python selfcheck.py --index-url   # the PyTorch wheel index for this machine (`make` uses it): the one for
                                        # its GPU and driver, the CPU index on Linux without a GPU, else empty (PyPI)
    $ python selfcheck.py --reachable URL  # URL when the index answers within 5 s; else nothing (PyPI) and
                                           # one line saying so (`make` asks once before pip uses the index)

Prints the GPU (name, compute capability, memory), the driver and its CUDA version, the versions of
torch (and its CUDA), Triton and transformers, bf16 support, and whether results/ already holds
figures from this GPU family. Then runs three checks, each timed and marked PASS or FAIL:
  1. set-up        python selfcheck.py --setup (playbook/runtime/setup_check.py): torch can use the GPU (or there is none)
  2. kernel test   python -m pytest -q rmsnorm_test.py
  3. fine-tune     python finetune_optimized.py --model llama-3.1-8b --batch-size 1 --seq-len 1024 --steps 3
                   --timing-warmup-steps 1 (the LLaMA 3.1 8B architecture, random weights, all kernels)
and ends with a summary table; exit code 1 if any check failed. Without a GPU, the kernel test runs in
Triton's interpreter and the fine-tune uses the llama-tiny preset (a few minutes in all). The fine-tune's
summary goes to results/selfcheck_*smoke.json, which git ignores.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from playbook.runtime import signals
from playbook.startup import start  # imports no torch

if __name__ == "__main__":  # Ctrl-C while it starts: one line, exit code 130
    start("the self-check stopped before its verdict", kernels=False)

from playbook.runtime import setup_check  # noqa: E402
from core import gpu_arch  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TIMEOUT_S = 1800  # per check; the 8B fine-tune's first run compiles every kernel
OWN_PREFIX = "selfcheck"  # this script's own outputs under results/ are not results from the GPU


@dataclass
class Check:
    name: str
    cmd: list[str] | None = None  # None: runs in this process
    result: str = "not run"       # PASS, FAIL or "not run"
    seconds: float | None = None
    detail: str = ""


def plan(gpu: bool) -> list[Check]:
    """The checks, in order: the GPU versions, or the CPU versions where there is no GPU."""
    py = sys.executable
    if gpu:
        tune = [py, "finetune_optimized.py", "--model", "llama-3.1-8b", "--batch-size", "1", "--seq-len", "1024",
                "--steps", "3", "--timing-warmup-steps", "1", "--tag", "selfcheck_smoke", "--overwrite"]
        tune_name = "fine-tune: LLaMA 3.1 8B, 1 x 1024 tokens, 3 steps"
    else:
        tune = [py, "finetune_optimized.py", "--model", "llama-tiny", "--steps", "3",
                "--tag", "selfcheck_cpu_smoke", "--overwrite"]
        tune_name = "fine-tune: llama-tiny on the CPU, 3 steps"
    return [Check("set-up: torch can use the GPU" if gpu else "set-up: no GPU, CPU demo"),
            Check("kernel test: rmsnorm_test.py" + ("" if gpu else " (Triton interpreter)"),
                  [py, "-m", "pytest", "-q", "rmsnorm_test.py"]),
            Check(tune_name, tune)]


def gpu_family(gpu_name: str) -> str | None:
    """The model part of a GPU's name: "NVIDIA GB300" -> "GB300", "NVIDIA H100 80GB HBM3" -> "H100",
    "NVIDIA A100-SXM4-80GB" -> "A100"; None when the name has no such part."""
    for word in re.split(r"[\s\-_/]+", gpu_name):
        if re.fullmatch(r"[A-Za-z]{0,3}\d{2,4}[A-Za-z]?", word) and not re.fullmatch(r"\d+(GB|G|GiB)", word, re.I):
            return word.upper()
    return None


def _family_regex(family: str) -> re.Pattern:
    # H200 matches "benchmark_H200.csv", "2xH200" and "NVIDIA H200 (140 GiB)", but not "GH200" or "H2000"
    return re.compile(rf"(?<![A-WYZa-wyz0-9]){re.escape(family)}(?![0-9])", re.I)


def _gpu_fields(obj) -> list[str]:
    """Every string stored under a "gpu" key, at any depth of a JSON document."""
    found = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "gpu" and isinstance(v, str):
                    found.append(v)
                else:
                    stack.append(v)
        elif isinstance(o, list):
            stack.extend(o)
    return found


def results_from_family(gpu_name: str, results_dir: Path = RESULTS) -> list[Path]:
    """The files under results_dir from this GPU's family: by file name, or by a JSON "gpu" field."""
    family = gpu_family(gpu_name)
    if family is None or not results_dir.is_dir():
        return []
    pattern = _family_regex(family)
    hits = []
    for path in sorted(p for p in results_dir.rglob("*") if p.is_file()):
        if path.name.startswith(OWN_PREFIX):
            continue
        if pattern.search(path.name):
            hits.append(path)
        elif path.suffix == ".json" and path.stat().st_size < 50 * 2**20:
            try:
                doc = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            if any(pattern.search(v) for v in _gpu_fields(doc)):
                hits.append(path)
    return hits


def results_note(gpu_name: str, results_dir: Path = RESULTS) -> str:
    hits = results_from_family(gpu_name, results_dir)
    if not hits:
        return f"no results from an {gpu_name} in {results_dir.name}/ yet: these will be the first"
    family = gpu_family(gpu_name)
    shown = ", ".join(str(p.relative_to(results_dir.parent)) for p in hits[:3])
    return f"{len(hits)} file(s) from the {family} family in {results_dir.name}/ (e.g. {shown})"


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def machine_facts(report: setup_check.SmiReport) -> list[tuple[str, str]]:
    """(label, value) pairs describing this machine; torch's view of the GPU where it has one."""
    facts = []
    try:  # Ctrl-C during the import ends the process at once (no error to tell from a broken torch)
        with signals.exit_on_ctrl_c_while_importing("the self-check stopped before its verdict"):
            import torch
    except Exception as e:  # reported; the set-up check says what to do
        torch = None
        facts.append(("torch", f"cannot be imported: {setup_check.first_line(str(e))}"))
    on_gpu = torch is not None and torch.cuda.is_available()
    if on_gpu:
        p = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        facts += [("GPU", p.name + (f" (GPU 0 of {count})" if count > 1 else "")),
                  ("compute capability", f"{p.major}.{p.minor} ({gpu_arch.describe((p.major, p.minor))})"),
                  ("GPU memory", f"{p.total_memory / 2**30:.1f} GiB")]
    elif report.gpus:
        g = report.gpus[0]
        facts += [("GPU (nvidia-smi)", g.name),
                  ("compute capability", setup_check.capability_text(g.capability)
                   + (f" ({gpu_arch.FAMILY_NAMES[gpu_arch.arch_family(g.capability)]})" if g.capability else "")),
                  ("GPU memory", "unknown" if g.memory_mib is None else f"{g.memory_mib / 1024:.1f} GiB")]
    elif report.error is not None:
        facts.append(("GPU", f"unknown: {report.error}"))
    else:
        facts.append(("GPU", "none (" + ("nvidia-smi not found" if not report.found else "nvidia-smi lists no GPU")
                      + "): a CPU machine"))
    if report.found and report.error is None:
        facts.append(("driver", f"{report.driver or 'unknown'}, supports CUDA {setup_check.version_text(report.cuda)}"))
    if torch is not None:
        facts.append(("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: CPU-only build'})"))
    facts += [("Triton", _dist_version("triton", "pytorch-triton")),
              ("transformers", _dist_version("transformers")),
              ("bf16", ("supported" if torch.cuda.is_bf16_supported() else "NOT supported") if on_gpu
               else "n/a (no GPU in use)")]
    capability = (p.major, p.minor) if on_gpu else (report.gpus[0].capability if report.gpus else None)
    if capability is not None:  # the assembler Triton uses for this GPU (setup_check.triton_problem checks it)
        _, ptxas, path, variable = setup_check.triton_toolchain(capability)
        facts.append(("Triton's ptxas", f"CUDA {ptxas} ({path}; {variable} chooses it)" if ptxas else "unknown"))
    if on_gpu or report.gpus:
        facts.append(("results/", results_note(torch.cuda.get_device_name(0) if on_gpu else report.gpus[0].name)))
    return facts


def _tail_summary(lines: list[str]) -> str:
    """pytest's closing count ("35 passed, 2 skipped in 25.6s"), without its ===."""
    for line in reversed(lines):
        if re.search(r"\d+ (passed|failed|error)", line):
            return line.strip(" =\n")
    return ""


def _tune_summary(cmd: list[str], since: float) -> str:
    tag = cmd[cmd.index("--tag") + 1]
    path = RESULTS / f"{tag}.json"
    if not path.is_file() or path.stat().st_mtime < since:
        return "no summary JSON written"
    s = json.loads(path.read_text()).get("summary", {})
    parts = []
    if s.get("tokens/s (job)") is not None:
        parts.append(f"{s['tokens/s (job)']:,.0f} tokens/s")
    if s.get("peak GPU memory (GB)") is not None:
        parts.append(f"peak {s['peak GPU memory (GB)']:.1f} GB")
    if s.get("final loss") is not None:
        parts.append(f"final loss {s['final loss']:.3f}")
    return ", ".join(parts)


def run_subprocess(check: Check, timeout_s: float = TIMEOUT_S) -> None:
    """Run check.cmd in the repository, its output shown as it comes; fill in result, seconds, detail."""
    start = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(check.cmd, cwd=HERE, stdout=subprocess.PIPE, text=True, bufsize=1)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines = (lines + [line])[-50:]
        rc = proc.wait()
    finally:
        timer.cancel()
    check.seconds = time.perf_counter() - t0
    timed_out = check.seconds >= timeout_s and rc != 0
    check.result = "PASS" if rc == 0 else "FAIL"
    if timed_out:
        check.detail = f"stopped after {timeout_s:g} s"
    elif rc != 0:
        check.detail = f"exit code {rc}"
    if "pytest" in check.cmd:
        check.detail = "; ".join(x for x in (_tail_summary(lines), check.detail) if x)
    elif rc == 0 and "--tag" in check.cmd:
        check.detail = _tune_summary(check.cmd, start)


def summary_table(checks: list[Check]) -> str:
    rows = [("check", "result", "time (s)", "detail")] + [
        (c.name, c.result, "-" if c.seconds is None else f"{c.seconds:.1f}", c.detail) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]

    def fmt(r):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |"
    return "\n".join([fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows[1:]])


def main() -> int:
    report = setup_check.nvidia_smi_report()
    gpu = report.error is not None or bool(report.gpus)  # a failing nvidia-smi: a GPU that cannot be used
    print("selfcheck: this machine")
    facts = machine_facts(report)
    width = max(len(k) for k, _ in facts)
    for k, v in facts:
        print(f"  {k.ljust(width)}  {v}")
    if not gpu:
        print("No NVIDIA GPU: this is a CPU machine. The checks run their CPU versions: the kernel test in "
              "Triton's interpreter and a 3-step fine-tune of the llama-tiny preset instead of LLaMA 3.1 8B "
              "(their times say nothing about a GPU).")
    checks = plan(gpu)
    for i, check in enumerate(checks, 1):
        shown = "python selfcheck.py --setup" if check.cmd is None else shlex.join(["python"] + check.cmd[1:])
        print(f"\n[{i}/{len(checks)}] {check.name}\n$ {shown}", flush=True)
        if i > 1 and checks[0].result != "PASS":
            check.detail = "set-up failed"
            print("not run: the set-up check failed")
            continue
        if check.cmd is None:
            t0 = time.perf_counter()
            problem = setup_check.diagnose(report)[1]
            check.seconds = time.perf_counter() - t0
            check.result = "FAIL" if problem else "PASS"
            check.detail = setup_check.first_line(problem)[len("setup: "):][:100] if problem else ""
            print(problem or ("torch can use the GPU" if gpu else setup_check.cpu_demo_note()))
        else:
            run_subprocess(check)
        print(f"{check.result} ({check.seconds:.1f} s)", flush=True)
    failed = [c for c in checks if c.result != "PASS"]
    print(f"\nselfcheck summary ({'GPU' if gpu else 'CPU'} machine):")
    print(summary_table(checks))
    if failed:
        print(f"selfcheck: {len(failed)} of {len(checks)} checks did not pass: {', '.join(c.name for c in failed)}")
        return 1
    print(f"selfcheck: all {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--setup", action="store_true",
                       help="only the set-up check `make` runs before each command: OK and exit 0, or the fix and exit 1")
    which.add_argument("--index-url", action="store_true",
                       help="print the PyTorch wheel index for this machine's GPU and driver (empty: PyPI)")
    which.add_argument("--reachable", metavar="URL",
                       help="print URL when this package index answers within 5 s; else print nothing (pip then "
                            "uses PyPI) and say so in one line on stderr")
    which.add_argument("--memory-table", nargs="+", metavar="RUN.json",
                       help="the memory plan's estimate against the peak each saved run measured (results/runs/*.json)")
    args = parser.parse_args()
    if args.memory_table:
        from playbook.plan import table

        print(table.table(args.memory_table))
        sys.exit(0)
    if args.reachable is not None:
        sys.exit(setup_check.main(["--reachable", args.reachable]))
    if args.setup or args.index_url:
        sys.exit(setup_check.main(["--index-url"] if args.index_url else []))
    sys.exit(signals.run_main(main, "the self-check stopped before its verdict"))
