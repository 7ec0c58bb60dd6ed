"""The walkthrough tells the truth briefly: short kernel test reports (testkit's TESTKIT_REPORT), full
reports in git-ignored files, and on a CPU no claim that only a GPU makes true.

The walkthrough's scripts are not run here (minutes on a CPU): `step` is replaced by a recorder and the
profiles and summaries it would read are small stand-ins, so the whole of main() runs in a second.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import walkthrough
from playbook import models

HERE = Path(__file__).resolve().parent.parent  # the repository root

TINY_TEST = '''\
"""Three tests for testkit's short report."""
import pytest
from playbook.testkit import record, run_as_script


def test_passes():
    record("close check", 3e-3, 4e-3, True)
    record("far check", 1e-6, 4e-3, True)
    record("off as it must be", 5e-1, 1e-3, True)  # a check that passes by differing: not a margin


def test_fails():
    record("bad check", 9e-2, 4e-3, False)


@pytest.mark.skip(reason="needs a GPU")
def test_skipped():
    pass


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Tiny: test report"))
'''


def test_testkit_short_report_on_screen_full_report_in_the_file(tmp_path):
    (tmp_path / "tiny_test.py").write_text(TINY_TEST)
    full = tmp_path / "full.txt"
    env = {**os.environ, "PYTHONPATH": str(HERE), "TESTKIT_REPORT": str(full)}
    p = subprocess.run([sys.executable, "tiny_test.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr  # a test failed
    screen = p.stdout.splitlines()
    assert re.fullmatch(rf"Tiny: test report: 1 passed, 1 failed, 1 skipped in \d+\.\d s; 4 checks "
                        rf"\(full report: {re.escape(str(full))}\)", screen[0]), screen[0]
    assert screen[1].startswith("  FAILED   test_fails  -- ") and "bad check: max error 9.000e-02" in screen[1]
    assert screen[2] == "             BAD bad check: max err 9.00e-02 > tol 4.00e-03"
    assert screen[3] == "  skipped 1: needs a GPU"
    assert screen[4] == "  closest to its tolerance: close check: max err 3.00e-03, tol 4.00e-03 (75% of it)"
    assert len(screen) == 5 and "PASSED" not in p.stdout
    text = full.read_text()  # the full report: every test and every check
    for line in ("PASSED   test_passes", "ok  far check", "FAILED   test_fails", "BAD bad check", "SKIPPED  test_skipped",
                 "1 passed, 1 failed, 1 skipped in "):
        assert line in text, line


def test_testkit_without_the_variable_prints_the_full_report(tmp_path):
    (tmp_path / "tiny_test.py").write_text(TINY_TEST)
    env = {k: v for k, v in os.environ.items() if k != "TESTKIT_REPORT"}
    p = subprocess.run([sys.executable, "tiny_test.py"], cwd=tmp_path, env={**env, "PYTHONPATH": str(HERE)},
                       capture_output=True, text=True, timeout=120)
    assert "PASSED   test_passes" in p.stdout and "ok  far check" in p.stdout and "closest to" not in p.stdout


def test_kernel_test_step_writes_a_git_ignored_report(monkeypatch):
    calls = []
    monkeypatch.setattr(walkthrough, "step", lambda *a, **k: calls.append((a, k)) or True)
    walkthrough.kernel_test("rmsnorm", "python")
    (title, explain, cmd), kw = calls[0]
    report = kw["env"]["TESTKIT_REPORT"]
    assert cmd == ["python", "rmsnorm_test.py"] and report == "results/walkthrough_tests_rmsnorm.txt"
    assert report in explain  # the reader is told where every check is
    ignored = subprocess.run(["git", "check-ignore", "-q", report], cwd=HERE)
    assert ignored.returncode == 0, f"{report} is not git-ignored"


def _profile(ms: dict) -> dict:
    return {"ms_per_step": sum(ms.values()), "unit": "CPU", "categories_ms_per_step": ms}


def _run(summary: dict) -> dict:
    return {"summary": summary, "model": "llama-tiny", "batch_size": 2, "seq_len": 128,
            "gpu": "CPU (Triton interpreter)", "kernels": ["rmsnorm"]}


SUMMARY = {"step time median (ms)": 80.0, "tokens/s (job)": 3000.0, "MFU (% of bf16 peak)": None,
           "peak GPU memory (GB)": None, "first loss": 6.2, "final loss": 4.4, "final eval loss": 4.4}
BEFORE = {"matrix multiply": 118.8, "element-wise": 52.6, "attention": 48.5, "RMSNorm": 0.3, "loss": 0.4}
AFTER_CPU = {"matrix multiply": 145.5, "element-wise": 81.8, "attention": 40.8, "RMSNorm": 202.1, "loss": 703.8}
AFTER_GPU = {"matrix multiply": 110.0, "element-wise": 20.0, "attention": 48.0, "RMSNorm": 0.1, "loss": 0.2}


def _walk(monkeypatch, capsys, after: dict, argv=("--skip-kernel-tests",)) -> tuple[str, list]:
    """main() on a CPU with its scripts replaced: (everything said, the steps it would have run)."""
    docs = {"walkthrough_profile_baseline": _profile(BEFORE), "walkthrough_profile_optimized": _profile(after),
            "walkthrough_baseline": _run(SUMMARY), "walkthrough_optimized": _run(SUMMARY)}
    steps = []
    monkeypatch.setattr(walkthrough, "step", lambda *a, **k: steps.append((a, k)) or True)
    monkeypatch.setattr(walkthrough, "load", docs.get)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["walkthrough.py", *argv])
    walkthrough.main()
    said = capsys.readouterr().out + "\n".join(a[0] + "\n" + a[1] for a, _ in steps)
    return said, steps


def test_cpu_walkthrough_claims_only_what_is_true_there(monkeypatch, capsys):
    said, _ = _walk(monkeypatch, capsys, AFTER_CPU)
    for gpu_only in ("GPU time by category", "the times are the interpreter's", "tokens/s up, peak memory down",
                     "tokens/s and peak memory in the summary", "Compare with step 1: the RMSNorm"):
        assert gpu_only not in said, gpu_only
    assert said.count("rows shrink") == said.count("On a GPU\nthe RMSNorm, loss, SwiGLU and element-wise rows shrink")
    assert "CPU time by category" in said and "runs no Triton kernel" in said
    # step 5: the measured categories side by side, and the verdict follows the numbers
    assert "RMSNorm                   0.3        202.1" in said
    assert "(RMSNorm, loss, SwiGLU, RoPE, element-wise) grew: 53.3 -> 987.7 ms per step" in said


def test_step_5_verdict_follows_the_measurement(monkeypatch, capsys):
    said, _ = _walk(monkeypatch, capsys, AFTER_GPU)
    assert "element-wise) shrank: 53.3 -> 20.3 ms per step" in said and " grew:" not in said


def test_kernel_tests_option_picks_the_files(monkeypatch, capsys):
    _, steps = _walk(monkeypatch, capsys, AFTER_CPU, argv=("--kernel-tests", "rope,rmsnorm"))
    tests = [a[2][1] for a, _ in steps if a[0].startswith("Step 2")]
    assert tests == ["rope_test.py", "rmsnorm_test.py"]
    with pytest.raises(SystemExit):
        _walk(monkeypatch, capsys, AFTER_CPU, argv=("--kernel-tests", "nonesuch"))


def test_attention_line_on_a_cpu_names_the_kernel_that_runs():
    """The log line and the profiler agree: SDPA on a CPU runs its CPU flash-attention kernel."""
    line = models.prefer_fast_attention(torch.device("cpu"))
    assert "flash-attention" in line and "no GPU" in line
    q = torch.randn(2, 4, 64, 16, dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, sorted(names)
