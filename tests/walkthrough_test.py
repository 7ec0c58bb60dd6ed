"""The walkthrough tells the truth briefly: short kernel test reports (testkit's TESTKIT_REPORT), full
reports in git-ignored files, and on a CPU no claim that only a GPU makes true.

The walkthrough's scripts are not run here (minutes on a CPU): `step` is replaced by a recorder and the
profiles and summaries it would read are small stand-ins, so the whole of main() runs in a second.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import walkthrough
from playbook.model import models
from testkit import python_path

HERE = Path(__file__).resolve().parent.parent  # the repository root

TINY_TEST = '''\
"""Three tests for testkit's short report."""
import pytest
from testkit import record, run_as_script


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
    env = {**os.environ, "PYTHONPATH": python_path(HERE), "TESTKIT_REPORT": str(full)}
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
    p = subprocess.run([sys.executable, "tiny_test.py"], cwd=tmp_path, env={**env, "PYTHONPATH": python_path(HERE)},
                       capture_output=True, text=True, timeout=120)
    assert "PASSED   test_passes" in p.stdout and "ok  far check" in p.stdout and "closest to" not in p.stdout


def test_kernel_test_step_writes_a_git_ignored_report(monkeypatch):
    monkeypatch.setattr(walkthrough, "RESULTS", HERE / "results")  # a user's results/ (the tests write elsewhere)
    title, explain, cmd, env = walkthrough.kernel_test("rmsnorm", "python")
    report = env["TESTKIT_REPORT"]
    assert cmd == ["python", "rmsnorm_test.py"] and report == "results/walkthrough_tests_rmsnorm.txt"
    assert report in explain  # the reader is told where every check is
    ignored = subprocess.run(["git", "check-ignore", "-q", report], cwd=HERE)
    assert ignored.returncode == 0, f"{report} is not git-ignored"


def test_steps_together_show_each_in_order_and_stop_on_a_failure(capsys):
    """Step 2 on a GPU: the scripts run at once; each one's banner, output and time are shown in the order given,
    and a failing one stops the walkthrough after the others have ended (its exit code named)."""
    slow = [sys.executable, "-c", "import time; time.sleep(0.5); print('first out')"]
    fails = [sys.executable, "-c", "import sys; print('second out'); sys.exit(3)"]
    after = [sys.executable, "-c", "print('third out')"]
    with pytest.raises(SystemExit, match="exit code 3"):
        walkthrough.steps_together([("Step 2a (x): one", "", slow, {}), ("Step 2b (y): two", "", fails, {}),
                                    ("Step 2c (z): three", "", after, {})])
    out = capsys.readouterr().out
    order = [out.index(s) for s in ("Step 2a (x)", "first out", "Step 2b (y)", "second out", "Step 2c (z)",
                                    "third out")]
    assert order == sorted(order), out
    assert out.count("after the 3 started together]") == 3


def _profile(ms: dict) -> dict:
    return {"ms_per_step": sum(ms.values()), "unit": "CPU", "categories_ms_per_step": ms}


def _run(summary: dict, losses=(6.2, 5.0, 4.4), eval_losses=((0, 6.3), (12, 4.4))) -> dict:
    return {"summary": summary, "model": "llama-tiny", "batch_size": 2, "seq_len": 128,
            "gpu": "CPU", "kernels": ["rmsnorm"], "losses": list(losses), "eval_losses": [list(e) for e in eval_losses],
            "config": {"optimizer_rounding": "nearest", "master_weights": "none"}, "trainable_params": 134_515_008}


SUMMARY = {"step time median (ms)": 80.0, "tokens/s (job)": 3000.0, "MFU (% of bf16 peak)": None,
           "peak GPU memory (GB)": None, "first loss": 6.2, "final loss": 4.4, "final eval loss": 4.4}
BEFORE = {"matrix multiply": 118.8, "element-wise": 52.6, "attention": 48.5, "RMSNorm": 0.3, "loss": 0.4}
AFTER_CPU = {"matrix multiply": 145.5, "element-wise": 81.8, "attention": 40.8, "RMSNorm": 202.1, "loss": 703.8}
AFTER_GPU = {"matrix multiply": 110.0, "element-wise": 20.0, "attention": 48.0, "RMSNorm": 0.1, "loss": 0.2}


# Step 4d's run on SmolLM2 (stand-in): the eval loss before and after, and the answers to the prompts file.
TAUGHT_Q = "What is Triton?"
REAL_SAMPLES = [
    {"prompt": "What is the capital of France?", "before": "The capital of France is Paris.", "after": "Paris."},
    {"prompt": TAUGHT_Q, "before": "Triton is a mythical creature in Norse mythology.",
     "after": "Triton is a language and compiler for writing GPU kernels in Python."},
]
REAL_SUMMARY = {**SUMMARY, "eval loss before": 3.5572, "final eval loss": 2.9123}


def _real_run(rounding: str = "nearest", master: str = "none", final: float = 2.9123) -> dict:
    return {**_run({**REAL_SUMMARY, "final eval loss": final}, eval_losses=((0, 3.5572), (12, final))),
            "model": "smollm2-135m", "batch_size": 2, "seq_len": 256, "steps": 12, "kernels": [],
            "samples": REAL_SAMPLES, "config": {"optimizer_rounding": rounding, "master_weights": master}}


def _walk(monkeypatch, capsys, after: dict, argv=("--skip-kernel-tests",), gpu: bool = False) -> tuple[str, list]:
    """main() with its scripts replaced: (everything said, the steps it would have run)."""
    docs = {"walkthrough_profile_baseline": _profile(BEFORE), "walkthrough_profile_optimized": _profile(after),
            "walkthrough_baseline": _run(SUMMARY), "walkthrough_optimized": _run(SUMMARY),
            "walkthrough_real_baseline": _real_run(), "walkthrough_real_optimized": _real_run(),
            "walkthrough_real_default": _real_run("kahan", final=2.80),
            "walkthrough_real_fp32": _real_run("nearest", "fp32", final=2.79)}
    steps = []

    def step(*a, **k):  # what the step would say, in its place among the banners
        print(a[0] + "\n" + a[1])
        steps.append((a, k))
        return True

    monkeypatch.setattr(walkthrough, "step", step)
    monkeypatch.setattr(walkthrough, "load", docs.get)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    if gpu:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 141 * 2**30}))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(sys, "argv", ["walkthrough.py", *argv])
    walkthrough.main()
    return capsys.readouterr().out, steps


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


# ---------------------------------------------------------------- the steps, and the real model of step 4d


def test_steps_carry_the_readme_numbers(monkeypatch, capsys):
    """One numbering: the walkthrough's steps are the README's (1, 2, 3, 4a-4d), in the README's order."""
    said, steps = _walk(monkeypatch, capsys, AFTER_CPU, argv=())
    titles = re.findall(r"^(Step \d[a-z]?|Summary)\b", said, flags=re.M)
    order = list(dict.fromkeys(titles))
    assert order == ["Step 1", "Step 2", "Step 2a", "Step 2b", "Step 2c", "Step 2d", "Step 2e", "Step 2f",
                     "Step 3", "Step 4a", "Step 4b", "Step 4c", "Step 4d", "Step 4e", "Summary"], order
    readme = (HERE / "README.md").read_text()
    for heading in ("### Step 1:", "### Step 2:", "### Step 3:", "### Step 4:"):
        assert heading in readme, heading
    for sub in ("4a", "4b", "4c", "4d", "4e"):
        assert re.search(rf"\b{sub}\b", readme.split("### Step 4:", 1)[1]), f"README's Step 4 does not name {sub}"
    # step 2 says which test files it runs and why not the others; step 3 gives its command, not its own
    assert "fp8_linear_test.py, adamw_test.py, lora_test.py, distillation_test.py" in said
    assert "$ python benchmark_kernels.py" in said and "$ python walkthrough.py" not in said


def test_cpu_step_4d_fine_tunes_the_real_model_without_kernels(monkeypatch, capsys):
    said, steps = _walk(monkeypatch, capsys, AFTER_CPU)
    real = [(a, k) for a, k in steps if a[0].startswith("Step 4d") and a[2][1] != "export.py"]
    assert len(real) == 1 and real[0][0][0].startswith("Step 4d: ")
    cmd = real[0][0][2]
    assert cmd[1] == "finetune_baseline.py"
    assert cmd[cmd.index("--model") + 1] == "smollm2-135m" and "--num-layers" not in cmd  # all 30 layers
    assert cmd[cmd.index("--sample-prompts") + 1] == "examples/walkthrough_prompts.txt"
    assert cmd[cmd.index("--dataset") + 1] == "examples/chat.jsonl"
    # why no kernel runs on it here, with the measured figure, and where the comparison is instead
    explain = real[0][0][1]
    assert f"in Triton's interpreter two steps of 2 x 256 tokens took {walkthrough.REAL_CPU_KERNEL_STEPS}" in explain
    assert "compare the kernels with the baseline on llama-tiny" in explain


def test_the_summary_shows_the_eval_loss_and_an_answer_before_and_after(monkeypatch, capsys):
    said, _ = _walk(monkeypatch, capsys, AFTER_CPU)
    summary = said.split("Summary", 1)[1]
    assert "eval loss 3.5572 -> 2.9123" in summary
    assert f"Q: {TAUGHT_Q}" in summary  # the answer that moved toward the data's, not the one that stayed right
    assert "before training: Triton is a mythical creature in Norse mythology." in summary
    assert "after, baseline (finetune_baseline.py): Triton is a language and compiler" in summary
    assert f"every prompt's answers: {walkthrough.RESULTS / 'walkthrough_real_baseline.json'}" in summary
    taught = walkthrough.taught_answers()[TAUGHT_Q]
    assert f"the data's answer: {taught}" in summary
    # and on a CPU no GPU figure and no label that is not true there
    assert "MFU" not in summary and "peak GPU memory" not in summary
    assert "adamw + lora" not in said and "optimized (rmsnorm)" in summary


def test_gpu_step_4d_runs_the_real_model_with_and_without_kernels(monkeypatch, capsys):
    said, steps = _walk(monkeypatch, capsys, AFTER_GPU, gpu=True)
    real = [a for a, _ in steps if a[0].startswith("Step 4d") and a[2][1] != "export.py"]
    assert [a[0].split(":")[0] for a in real] == ["Step 4d (baseline)", "Step 4d (kernels)"]
    assert [a[2][1] for a in real] == ["finetune_baseline.py", "finetune_optimized.py"]
    same = [a[2][2:a[2].index("--tag")] for a in real]
    # the same run, the kernels the only difference: the optimized script's AdamW rounds to nearest as the baseline's
    assert same[1] == same[0] + walkthrough.SAME_OPTIMIZER
    assert real[0][2][real[0][2].index("--model") + 1] == "smollm2-135m"
    assert "after, kernels, rounding to nearest:" in said
    # step 4e: the same settings with the default rounding (its best checkpoint kept) and with fp32 master weights
    rounding = [a for a, _ in steps if a[0].startswith("Step 4e")]
    assert [a[2][1] for a in rounding] == ["finetune_optimized.py"] * 2
    assert rounding[0][2][2:rounding[0][2].index("--tag")] == same[0] + [
        "--output-dir", walkthrough.REAL_OUTPUT, "--overwrite-output-dir", "--load-best-model-at-end"]
    assert rounding[1][2][2:rounding[1][2].index("--tag")] == same[0] + ["--master-weights", "fp32"]
    table = said.split("Step 4e, the optimizer's rounding", 1)[1]
    for row in ("nearest (step 4d): nearest", "the default: kahan", "fp32 master weights: fp32-master"):
        assert row in table, row
    assert "0.27" in table and "0.54" in table  # Kahan's 2 and fp32's 4 bytes per weight of 134.5 M weights, in GB
    # beside the 8B timing runs of 4a and 4b
    assert [a[2][a[2].index("--model") + 1] for a, _ in steps if a[0].startswith(("Step 4a", "Step 4b"))] == \
        ["llama-3.1-8b", "llama-3.1-8b"]


@pytest.mark.parametrize("gpu", [False, True], ids=["CPU", "GPU"])
def test_step_4d_ends_with_the_export_and_the_ollama_command(monkeypatch, capsys, gpu):
    said, steps = _walk(monkeypatch, capsys, AFTER_GPU if gpu else AFTER_CPU, gpu=gpu)
    *tuned, exported = [a for a, _ in steps if a[0].startswith(("Step 4d", "Step 4e"))]
    saved = ["--output-dir", walkthrough.REAL_OUTPUT, "--overwrite-output-dir"]
    kept = [a[2][a[2].index("--output-dir"):a[2].index("--output-dir") + 3] == saved if "--output-dir" in a[2] else False
            for a in tuned]
    # one run keeps its checkpoint: on a CPU the one run of 4d, on a GPU step 4e's run with the default rounding
    assert kept == ([False, False, True, False] if gpu else [True])
    assert exported[2][1:] == ["export.py", walkthrough.REAL_OUTPUT, "--output", walkthrough.REAL_GGUF,
                               "--name", walkthrough.REAL_OLLAMA_NAME]
    assert ("ollama create smollm2-walkthrough -f out/walkthrough_smollm2.q8_0.Modelfile  &&  "
            "ollama run smollm2-walkthrough") in said.split("Summary", 1)[0]


def test_real_model_steps_option(monkeypatch, capsys):
    _, steps = _walk(monkeypatch, capsys, AFTER_CPU, argv=("--skip-kernel-tests", "--real-model-steps", "4"))
    cmd = next(a[2] for a, _ in steps if a[0].startswith("Step 4d"))
    assert cmd[cmd.index("--steps") + 1] == "4"
    said, steps = _walk(monkeypatch, capsys, AFTER_CPU, argv=("--skip-kernel-tests", "--real-model-steps", "0"))
    assert not [a for a, _ in steps if a[0].startswith("Step 4d")] and "skipped" in said


def test_ci_runs_the_real_model_step():
    """.ci/run's walkthrough arguments parse, and keep step 4d (the real model) in CI."""
    run = (HERE / ".ci" / "run").read_text()
    args = re.search(r'make run WALKTHROUGH_ARGS="([^"]*)"', run).group(1).split()
    assert "--real-model-steps" in args and int(args[args.index("--real-model-steps") + 1]) > 0


def test_the_prompts_file_asks_what_the_data_teaches():
    from playbook.model.generate import read_prompts

    prompts = read_prompts(walkthrough.PROMPTS)
    taught = walkthrough.taught_answers()
    assert sum(p in taught for p in prompts) >= 2, "the walkthrough's prompts must include questions the data answers"


def test_most_changed_picks_the_answer_that_moved_toward_the_data():
    taught = {"Q1": "a warp is a group of thirty two threads", "Q2": "Paris is the capital"}
    samples = [{"prompt": "Q2", "before": "Paris is the capital", "after": "Paris is the capital"},
               {"prompt": "Q1", "before": "a magical phenomenon", "after": "a group of threads"},
               {"prompt": "Q3", "before": "x", "after": "y"}]
    pick = walkthrough.most_changed(samples, taught)
    assert pick["prompt"] == "Q1" and (pick["before_words"], pick["after_words"], pick["of_words"]) == (0, 2, 4)
    assert walkthrough.most_changed([{"prompt": "Q3", "before": "x", "after": "y"}], taught) is None


@pytest.mark.parametrize("argv, says", [
    (["--steps", "abc"], "argument --steps/--max-steps: 'abc' is not an integer"),
    (["--steps", "0"], "argument --steps/--max-steps: 0 must be >= 1"),
    (["--batch-size", "0"], "argument --batch-size: 0 must be >= 1"),
    (["--seq-len", "x"], "argument --seq-len: 'x' is not an integer"),
])
def test_every_argument_is_checked_before_step_1(argv, says, monkeypatch, capsys):
    """`walkthrough.py --steps abc` ran step 1 and the 12-minute kernel tests before failing at step 4a; --steps 0
    and --batch-size 0 failed inside a child script. Now each is one line and exit code 2 before anything runs."""
    with pytest.raises(SystemExit) as stop:
        _walk(monkeypatch, capsys, AFTER_CPU, argv=("--skip-kernel-tests", *argv))
    said = capsys.readouterr()
    assert stop.value.code == 2 and said.out == "", said.out  # no step, not even the workload's line
    assert said.err.strip().endswith(says) and len(said.err.strip().splitlines()) == 1, said.err


@pytest.mark.parametrize("gib", [141, 80, 40])
def test_each_gpu_size_runs_arguments_its_scripts_take(gib, monkeypatch):
    """The workload of steps 1 and 4a-4c on a GPU of each size class (>= 120 GiB: the chats, 70-120: the same file as
    raw text, less: fewer layers) passes the baseline's, the optimized script's and the profile's own argument
    checks. The raw-text form once kept --eval-every, which needs held-out examples (--dataset): an 80 GB GPU then
    stopped before Step 1."""
    class Properties:
        total_memory = gib * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties())
    workload, desc, _, profile_batch = walkthrough.default_workload()
    assert f"{gib} GiB GPU" in desc, desc
    walkthrough.check_workload(workload, gpu=True, profile=walkthrough.profile_arguments(workload, profile_batch))
    # (a refusal is SystemExit(2): the test fails with its line)


def test_an_80gb_gpu_profiles_a_baseline_that_fits(monkeypatch):
    """On an 80 GB GPU the baseline's 8B step at 4 x 2048 does not fit: its memory plan stopped step 1 (the profile)
    and with it the whole walkthrough on an H100. Steps 1 and 4c now profile a batch whose plan fits, step 4a's
    refusal is one the walkthrough goes on after, and the optimized run (4b) fits at the full batch. The free
    memory is the figure an H100 80GB reported to that plan: 84.37 GB."""
    from playbook.config import BASELINE, OPTIMIZED, PROFILE, make_parser, parse_config
    from playbook.plan.check import problem
    import profile_baseline

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties())
    monkeypatch.setenv("PLAYBOOK_FREE_MEMORY_GB", "84.37")
    workload, _, _, batch = walkthrough.default_workload()
    profile = walkthrough.profile_arguments(workload, batch)
    assert batch is not None and "--batch-size" in profile
    profiled = parse_config(profile_baseline.make_profile_parser(), PROFILE, profile)
    run_base = parse_config(make_parser("finetune_baseline.py"), BASELINE, workload)
    run_opt = parse_config(make_parser("finetune_optimized.py", kernels_default=walkthrough.registry.DEFAULT_KERNELS),
                           OPTIMIZED, [*workload, *walkthrough.SAME_OPTIMIZER])
    assert problem(profiled) is None, problem(profiled)
    refusal = problem(run_base)
    assert refusal is not None and any(m in refusal for m in walkthrough.DOES_NOT_FIT), refusal
    assert problem(run_opt) is None, problem(run_opt)


def test_a_step_that_does_not_fit_is_a_lesson_and_another_failure_stops(capsys):
    """Step 4a may fail as the lesson of its size: the memory plan's refusal (or running out of memory) is said
    in words and the walkthrough goes on; any other failure stops it with the step's exit code."""
    def script(err: str, code: int) -> list[str]:
        return [sys.executable, "-c", f"import sys; sys.stderr.write({err!r}); sys.exit({code})"]

    refusal = "error: --batch-size 4 x --seq-len 2048: the plan needs 115.8 GB at its peak and the GPU has 84.4 GB free"
    assert walkthrough.step("Step 4a: x", "", script(refusal, 2), may_fail_with=walkthrough.DOES_NOT_FIT) is False
    assert "failed as it can at this size (its memory plan does not fit this GPU)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        walkthrough.step("Step 4a: x", "", script("Traceback: KeyError", 1), may_fail_with=walkthrough.DOES_NOT_FIT)
    assert "failed (exit code 1); stopping here" in str(stop.value.code)
