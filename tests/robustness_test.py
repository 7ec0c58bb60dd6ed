"""Bad or unusual input to the scripts: a clear one-line error (exit code 2 for a bad argument, 1 for a
failure at run time) or a correct result, never a traceback and never a silently wrong run.

    $ PYTHONPATH=. python tests/robustness_test.py     # the table below as a report
    $ pytest tests/robustness_test.py

The kernels' own bad-input tests (strided targets, expanded logits, second-order gradients, wrong
devices and dtypes) live in their `<kernel>_test.py` files.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from playbook.model import registry as ak
from playbook.runtime import common
from playbook.store.files import RESULTS_DIR
from playbook.config import make_parser, parse_config
from testkit import python_path, record, run_as_script

HERE = Path(__file__).resolve().parent.parent  # the repository root

BAD_ARGUMENTS = [  # (command-line words, what the one-line error must mention)
    (["--batch-size", "0"], "--batch-size"),
    (["--seq-len", "0"], "--seq-len"),
    (["--num-layers", "-1"], "--num-layers"),
    (["--num-layers", "0"], "--num-layers"),
    (["--steps", "0"], "--steps"),
    (["--log-every", "0"], "--log-every"),
    (["--timing-warmup-steps", "-1"], "--timing-warmup-steps"),
    (["--steps", "2", "--timing-warmup-steps", "2"], "no timed step"),
    (["--steps", "99999999999999999999"], "too large"),
    (["--batch-size", str(2**31)], "too large"),
    (["--lora-r", "8", "--lora-targets", "foo_proj"], "q_proj, k_proj"),
    (["--max-grad-norm", "-1"], "--max-grad-norm"),
    (["--max-grad-norm", "0"], "--max-grad-norm"),
    (["--lr", "0"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--grad-accum", "0"], "--grad-accum"),
    (["--eval-fraction", "1"], "--eval-fraction"),
    (["--tag", "../x"], "--tag"),
    (["--tag", "a/b"], "--tag"),
    (["--tag", ".."], "--tag"),
    (["--kernels", "rmsnorm,fast"], "unknown kernel"),
    (["--kernels", "cross_entropy,linear_cross_entropy"], "choose one"),
    (["--data", "no/such/file.txt"], "no such file"),
    (["--packing"], "need --dataset"),
    (["--lora-alpha", "16"], "needs --lora-r"),
    (["--load-in-4bit"], "needs --lora-r"),
    (["--lora-r", "8", "--load-in-4bit", "--merge-lora", "--output-dir", "x"], "4-bit weights"),
    (["--save-every", "5"], "needs --output-dir"),
    (["--resume", "no/such/dir"], "no such checkpoint"),
    (["--optimizer", "adamw-fused"], "CUDA"),
    (["--optimizer-in-backward", "--max-grad-norm", "1"], "--max-grad-norm"),
]


@pytest.mark.parametrize("argv, mentions", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_argument_exits_2_with_one_line(argv, mentions, capsys):
    if "adamw-fused" in argv and common.torch.cuda.is_available():
        pytest.skip("adamw-fused is valid on a GPU")
    with pytest.raises(SystemExit) as info:
        parse_config(make_parser("t", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized", argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, f"exit code {info.value.code}, expected 2"
    assert mentions in err, err
    assert "Traceback" not in err
    record(f"{' '.join(argv)} -> exit 2", 0.0, 0.0, True, note=err.strip().splitlines()[-1][:60])


def test_help_shows_real_defaults():
    text = " ".join(make_parser("t", kernels_default=ak.DEFAULT_KERNELS).format_help().split())  # unwrap lines
    assert "(default: None)" not in text
    assert "default 4 on a GPU, 2 on a CPU" in text and ", ".join(ak.DEFAULT_KERNELS) in text


def _script(*argv, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *argv], cwd=HERE, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_local_model_with_too_few_layers_names_the_option_that_asked(tmp_path, capsys):
    """A model directory has fewer layers than asked: the error names the option that asked for them, which
    for distill.py's teacher and student is --teacher-layers / --student-layers, not --num-layers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from playbook.model import models

    arch = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(arch).save_pretrained(tmp_path / "two_layers")
    model = str(tmp_path / "two_layers")
    cfg = parse_config(make_parser("test"), "test", ["--model", model, "--num-layers", "3"])
    capsys.readouterr()
    for flag, option in (("--model", "--num-layers"), ("--teacher", "--teacher-layers"),
                         ("--student", "--student-layers")):
        with pytest.raises(SystemExit) as err:
            models.load_model(cfg, torch.float32, flag=flag)
        said = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.value.code == 2 and said == f"error: {option} 3: {flag} {model} has only 2 layers", said


def test_errors_found_after_loading_the_model():
    """What only the model knows: its positions and layers. One line, exit code 2, before training."""
    longer = ["--model", "llama-tiny", "--seq-len", "2080", "--batch-size", "1", "--steps", "2", "--timing-warmup-steps", "1",  # 32 positions
              "--tag", "test_robust_longer", "--overwrite"]  # past the tiny preset's 2048
    cases = ((["--model", "llama-tiny", "--num-layers", "5", "--steps", "3"], "has only 2 layers"), (longer, None))
    # The two runs are independent, and each spends its ~7 s importing torch and transformers on one
    # core: run them at the same time. Each is still a process of its own, checked on its own below.
    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            outs = list(pool.map(lambda case: _script("finetune_baseline.py", *case[0]), cases))
    finally:  # the run's summary is the test's, not a result
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"test_robust_longer{suffix}").unlink(missing_ok=True)
    (argv, mentions), out = cases[0], outs[0]
    assert out.returncode == 2 and mentions in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    record(f"{' '.join(argv)} -> exit 2", 0.0, 0.0, True)
    # rows longer than the trained positions are context extension: a warning, and the run trains
    out = outs[1]
    assert out.returncode == 0, out.stderr[-2000:]
    assert "above the 2048 positions this model was trained on" in out.stdout + out.stderr, out.stdout[-2000:]
    record(f"{' '.join(longer)} (past 2048 positions) -> a warning, exit 0", 0.0, 0.0, True)


def test_too_short_text_file(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few bytes")  # 16 bytes, fewer than --seq-len 64 + 1
    out = _script("finetune_baseline.py", "--model", "llama-tiny", "--seq-len", "64", "--steps", "3", "--data", str(short))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]  # a bad input file
    # 16 bytes + the tokenizer's begin-of-text token; the message must state both counts
    assert re.search(r"has 17 tokens.*needs at least 64", out.stderr), out.stderr[-2000:]
    record("a text file shorter than one sequence -> exit 2, the counts stated", 0.0, 0.0, True)


def test_results_are_never_overwritten_silently():
    tag = "test_robust_tag"
    paths = [RESULTS_DIR / f"{tag}{s}" for s in ("", "-2")]
    try:
        for _ in range(2):
            out = _script("finetune_baseline.py", "--model", "llama-tiny", "--steps", "3", "--timing-warmup-steps", "1",
                          "--tag", tag)
            assert out.returncode == 0, out.stderr[-2000:]
        assert all(p.with_suffix(".json").is_file() for p in paths), "the second run must write <tag>-2.json"
        assert "exists" in out.stdout and "--overwrite" in out.stdout
    finally:
        for p in paths:
            for suffix in (".json", ".png", ".metrics.jsonl"):
                Path(f"{p}{suffix}").unlink(missing_ok=True)
    record("same --tag twice: the second run writes <tag>-2.json and says so", 0.0, 0.0, True)


# A child process inherits its parent's blocked signals and ignored signals, and a Python started with
# SIGINT ignored never turns Ctrl-C into KeyboardInterrupt. A shell starts a script with neither; the
# test process may hold either (left by a library it loaded). So the child starts as from a shell: it
# unblocks SIGINT and SIGTERM and takes Python's default handlers before running the script, and says
# what it inherited (/proc/self/status, in hex masks) for the failure message.
_AS_FROM_A_SHELL = (
    "import runpy, signal, sys; "
    "status = open('/proc/self/status').read().splitlines() if sys.platform == 'linux' else []; "
    "print('inherited:', *[l for l in status if l.startswith(('SigBlk', 'SigIgn'))], file=sys.stderr); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM]); "
    "signal.signal(signal.SIGINT, signal.default_int_handler); signal.signal(signal.SIGTERM, signal.SIG_DFL); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def wait_for_startup_handler(pid: int, timeout: float = 30.0) -> None:
    """Until the child catches SIGTERM, which `startup.start` handles and _AS_FROM_A_SHELL leaves at its default:
    its start-up handler is then in place. A fixed delay alone raced it on a loaded machine (two test workers on
    two cores): the Ctrl-C landed while Python itself was still importing the script's first modules, before any
    script can handle it. Off Linux (no /proc), the fixed delay alone."""
    status = Path(f"/proc/{pid}/status")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            caught = next(int(ln.split()[1], 16) for ln in status.read_text().splitlines() if ln.startswith("SigCgt"))
        except (OSError, StopIteration):
            return  # no /proc, or the child already ended: the caller's wait says what happened
        if caught >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.01)


def interrupt(*argv, ready: str | None = None, timeout: float = 60, sig=signal.SIGINT,
              env: dict | None = None) -> tuple[int, str]:
    """Run `python *argv` as from a shell, press Ctrl-C (SIGINT; or send `sig`) and return (exit code, stderr).

    `ready`: Ctrl-C comes 0.5 s after the first stdout line that contains it (the run is under way);
    None: 0.5 s after the script's start-up handler is in place (`startup.start`), while it is still importing
    torch (start-up). stderr's first line is what the child inherited (_AS_FROM_A_SHELL); what the script
    printed follows."""
    proc = subprocess.Popen([sys.executable, "-c", _AS_FROM_A_SHELL, *argv], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        inherited = proc.stderr.readline()  # printed before the script runs
        if ready is not None:
            for line in proc.stdout:
                if ready in line:
                    break
        else:
            wait_for_startup_handler(proc.pid)
        time.sleep(0.5)
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"still running {timeout} s after Ctrl-C; its stderr: {err[-2000:]}")
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, inherited + err


def one_line_after_ctrl_c(err: str) -> bool:
    """stderr holds what the child inherited, then one line from the script, and no traceback."""
    return "Traceback" not in err and len([line for line in err.splitlines() if line.strip()]) == 2


# (script and arguments, the stdout text after which Ctrl-C comes; None: while it starts). Ctrl-C in
# distill.py and benchmark_kernels.py (mid-run and at start-up), in profile_baseline.py and in
# finetune_baseline.py mid-step are tests/probe_test.py's cases, the same check on the same runs.
CTRL_C = [
    (("finetune_optimized.py", "--tag", "test_robust_ctrl_c_distill"), None),
    (("profile_baseline.py", "--tag", "test_robust_ctrl_c_distill"), None),
    (("finetune_trainer.py", "--dataset", "examples/chat.jsonl"), None),
    (("walkthrough.py", "--skip-kernel-tests"), None),
    (("rmsnorm_test.py",), None),  # a lesson's test file, run as a script
    (("rmsnorm_test.py",), "PASSED"),
]


@pytest.mark.parametrize("argv, ready", CTRL_C, ids=[f"{a[0]} {'mid-run' if r else 'start-up'}" for a, r in CTRL_C])
def test_ctrl_c_is_one_line_exit_130(argv, ready):
    code, err = interrupt(*argv, ready=ready)
    assert code == 130 and "interrupted" in err and one_line_after_ctrl_c(err), (code, err[-2000:])
    assert not (RESULTS_DIR / "test_robust_ctrl_c_distill.json").exists()
    record(f"Ctrl-C in {argv[0]} {'mid-run' if ready else 'at start-up'} -> one line, exit 130", 0.0, 0.0, True)


# What CPython's parser does with a Ctrl-C that lands inside it (Triton's JIT and its CPU interpreter
# parse kernel sources): the KeyboardInterrupt comes out as a SystemError. The loop must still end
# with the Ctrl-C line, not that error's traceback.
_CONVERTED_CTRL_C = """
from playbook.startup import start
start("nothing was run")
import time
from playbook.run import training

def _train(cfg, *started):
    print("ready", flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        raise SystemError("AST constructor recursion depth mismatch (before=147, after=164)")

training._train = _train
training.settle = lambda cfg: cfg  # (nothing to plan: the loop's answer to the error is what runs)
training.check_output_folders = lambda cfg: None  # (no folders: no config)
training.train(None)
"""


def test_ctrl_c_turned_into_another_error_is_still_ctrl_c(tmp_path):
    script = tmp_path / "converted_ctrl_c.py"
    script.write_text(_CONVERTED_CTRL_C)
    code, err = interrupt(str(script), ready="ready")
    assert code == 130 and "interrupted (Ctrl-C)" in err and one_line_after_ctrl_c(err), (code, err[-2000:])
    record("Ctrl-C that code turns into a SystemError -> still one line, exit 130", 0.0, 0.0, True)


CTRL_C_AROUND_OTHER_OUTPUT = [  # runs whose stderr holds more than the closing line (warnings, a child step's)
    (("finetune_trainer.py", "--model", "llama-tiny", "--dataset", "examples/chat.jsonl", "--steps", "100000",
      "--output-dir", "{tmp}"),
     "Trainer:"),  # (the Trainer makes its folder as it starts: one of the test's, not out/ in the clone)
    (("walkthrough.py", "--skip-kernel-tests", "--seq-len", "64"), "Step 1"),
    # selfcheck.py at start-up and once it runs (it imports torch then: under the import guard, since
    # torch's import can swallow a KeyboardInterrupt, after which selfcheck ran to the end and exited 0)
    (("selfcheck.py",), None),
    (("selfcheck.py",), "selfcheck: this machine"),
]


@pytest.mark.parametrize("argv, ready", CTRL_C_AROUND_OTHER_OUTPUT,
                         ids=[f"{a[0]} {'mid-run' if r else 'start-up'}" for a, r in CTRL_C_AROUND_OTHER_OUTPUT])
def test_ctrl_c_ends_with_one_closing_line_exit_130(argv, ready, tmp_path):
    """Ctrl-C: exit code 130 and a last line that says what was kept, no traceback (the Trainer's own
    warnings, or the walkthrough's running step and its own line, may come before it on stderr)."""
    code, err = interrupt(*[a.replace("{tmp}", str(tmp_path / "out")) for a in argv], ready=ready)
    last = err.strip().splitlines()[-1]
    assert code == 130 and "Traceback" not in err and last.startswith("interrupted (Ctrl-C)"), (code, err[-2000:])
    record(f"Ctrl-C in {argv[0]} {'mid-run' if ready else 'at start-up'} -> exit 130, one closing line, "
           "no traceback", 0.0, 0.0, True)


# A module whose import catches Ctrl-C and goes on, as torch's import sometimes does: pressed at a
# random moment of `import torch` in a handler that raises KeyboardInterrupt, 1 time in 40 here the import
# completed as if no key had been pressed.
_SWALLOWING_IMPORT = """
import time
print("importing", flush=True)
end = time.time() + 4
while time.time() < end:
    try:
        time.sleep(0.05)
    except BaseException:  # what the library does
        pass
"""
_RUNNING_SCRIPT = """
import sys
from playbook.runtime import signals

signals.started()  # as run_main does: Ctrl-C from here on raises KeyboardInterrupt
if sys.argv[1] == "guarded":
    with signals.exit_on_ctrl_c_while_importing("nothing was written"):
        import swallows_ctrl_c
else:
    import swallows_ctrl_c
print("went on after the import", flush=True)
"""


def test_ctrl_c_inside_an_import_that_swallows_it_still_stops(tmp_path):
    """Ctrl-C while a running script imports a library that catches it: under
    exit_on_ctrl_c_while_importing the process ends at once with one line and exit code 130; without it
    (the control) the script goes on as if no key had been pressed."""
    (tmp_path / "swallows_ctrl_c.py").write_text(_SWALLOWING_IMPORT)
    script = tmp_path / "running.py"
    script.write_text(_RUNNING_SCRIPT)
    env = {"PYTHONPATH": python_path(tmp_path, HERE)}
    code, err = interrupt(str(script), "guarded", ready="importing", env=env)
    assert code == 130 and one_line_after_ctrl_c(err) and \
        err.strip().splitlines()[-1] == "interrupted (Ctrl-C) while starting: nothing was written", (code, err)
    code, err = interrupt(str(script), "unguarded", ready="importing", env=env)
    assert code == 0, (code, err)  # the control: the import swallowed the Ctrl-C
    record("Ctrl-C inside an import that swallows it: one line, exit 130 (unguarded: the script went on)",
           0.0, 0.0, True)


@pytest.mark.parametrize("argv", [("selfcheck.py",), ("chat.py", "--model", "llama-tiny", "Hello?")],
                         ids=["selfcheck.py", "chat.py"])
def test_scripts_that_import_torch_once_running_stop_on_ctrl_c_during_it(argv, tmp_path):
    """selfcheck.py and chat.py import torch after their Ctrl-C handling has started (selfcheck reports a
    torch that cannot be imported; chat parses its arguments first). A torch whose import swallows the
    Ctrl-C (a stand-in on PYTHONPATH) still ends them with one line and exit code 130."""
    (tmp_path / "torch.py").write_text(_SWALLOWING_IMPORT)
    code, err = interrupt(*argv, ready="importing", env={"PYTHONPATH": python_path(tmp_path, HERE)})
    last = err.strip().splitlines()[-1]
    assert code == 130 and "Traceback" not in err and last.startswith("interrupted (Ctrl-C) while starting"), \
        (code, err[-2000:])
    record(f"{argv[0]}: Ctrl-C inside a torch import that swallows it -> one line, exit 130", 0.0, 0.0, True)


def test_sigterm_saves_the_step_done_and_exits_143(tmp_path):
    """SIGTERM, a scheduler's pre-emption, is handled as Ctrl-C is, with exit code 143: at start-up one
    line; in the loop the step in progress ends, its checkpoint is written to --output-dir (so the job
    resumes from it), and one line names it."""
    code, err = interrupt("finetune_baseline.py", "--model", "llama-tiny", sig=signal.SIGTERM)
    assert code == 143 and "terminated (SIGTERM) while starting" in err and one_line_after_ctrl_c(err), (code, err)
    out = tmp_path / "out"
    code, err = interrupt("finetune_baseline.py", "--model", "llama-tiny", "--steps", "100000", "--log-every", "1",
                          "--output-dir", str(out),
                          "--tag", "test_robust_sigterm", ready="/100000 ", sig=signal.SIGTERM)  # a step's log line
    (RESULTS_DIR / "test_robust_sigterm.metrics.jsonl").unlink(missing_ok=True)
    lines = [line for line in err.splitlines()[1:] if line.strip() and not line.startswith("checkpoint: ")]
    assert code == 143 and "Traceback" not in err and len(lines) == 1, (code, err[-2000:])
    from playbook.store.checkpoint_load import read_checkpoint_info

    saved = read_checkpoint_info(out)  # what --resume reads: `latest` names the step the run stopped after
    assert lines[0].startswith(f"terminated (SIGTERM): stopped after step {saved['step']} of 100000") \
        and f"resume with --resume {out}" in lines[0], (lines, saved["step"])
    assert not (RESULTS_DIR / "test_robust_sigterm.json").exists()
    record(f"SIGTERM: one line, exit 143; checkpoint-{saved['step']} written, resumable", 0.0, 0.0, True)


# A step of minutes in one call that Python cannot interrupt (the attention of a 2-million-token sequence on a
# CPU): Python runs a signal's handler in the main thread once the call returns, so the first SIGTERM waited
# 707 s for the step to end, saying nothing. The stand-in: the step's main thread takes no signal while it
# sleeps (as inside a long call into C); the run's other threads still see them arrive. The progress line's
# thresholds are made short (10 s of silence in a real run).
_LONG_STEP = """
from playbook.startup import start
start("nothing was run")
import signal, sys, threading, time
from playbook.model import registry
from playbook.run import training
from playbook.runtime import time_left
from playbook.config import make_parser, parse_config

time_left.SILENT_S = time_left.EVERY_S = 1.0
time_left.POLL_S = 0.1

def training_step(*args, **kwargs):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    threading.Timer(0.5, print, args=("in the long step",), kwargs={"flush": True}).start()  # (once inside the call)
    time.sleep(300)

training.training_step = training_step
training.train(parse_config(make_parser("t", kernels_default=registry.DEFAULT_KERNELS), "finetune_optimized",
                            sys.argv[1:]))
"""
# The same with no training loop and no torch: the main thread in a call that takes no signal, Ctrl-C or a
# SIGTERM that nothing defers.
_LONG_CALL = """
import signal, sys, threading, time
from playbook.runtime import signals
signals.started("what the script kept")
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
threading.Timer(0.5, print, args=("in the long call",), kwargs={"flush": True}).start()  # (once inside the call)
time.sleep(300)
"""


class Lines:
    """A child process's stdout and stderr, read line by line as they come (a thread each)."""

    def __init__(self, argv, env=None):
        import queue
        import threading

        self.proc = subprocess.Popen([sys.executable, "-c", _AS_FROM_A_SHELL, *argv], cwd=HERE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines, self.seen = queue.Queue(), []
        for name in ("stdout", "stderr"):
            threading.Thread(target=self._read, args=(name,), daemon=True).start()

    def _read(self, name):
        for line in getattr(self.proc, name):
            self.lines.put((name, line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> str:
        """The first line holding `text`, within `timeout` seconds (else the test fails, showing what came)."""
        import queue

        end = time.monotonic() + timeout
        while True:
            try:
                name, line = self.lines.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                self.proc.kill()
                pytest.fail(f"no line with {text!r} within {timeout} s; the lines: {self.seen[-20:]}")
            self.seen.append((name, line))
            if text in line:
                return line

    def end(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running {timeout} s after the signal; the lines: {self.seen[-20:]}")


def test_a_long_step_says_what_sigterm_waits_for_and_a_second_signal_stops_at_once(tmp_path):
    """In a step that takes minutes: a progress line names the step while it runs; a SIGTERM (deferred to the
    end of the step, whose checkpoint --output-dir asks for) says within seconds what it waits for, and that a
    second SIGTERM or Ctrl-C stops at once; Ctrl-C then ends the run within seconds, exit code 130, one line."""
    script = tmp_path / "long_step.py"
    script.write_text(_LONG_STEP)
    child = Lines([str(script), "--model", "llama-tiny", "--kernels", "none", "--batch-size", "1", "--seq-len", "32",
                   "--steps", "3", "--timing-warmup-steps", "1", "--output-dir", str(tmp_path / "out"), "--tag",
                   "test_robust_long_step", "--overwrite"])
    try:
        child.wait_for("in the long step", timeout=120)
        progress = child.wait_for("... step 1 of 3: ", timeout=10)
        child.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        said = child.wait_for("SIGTERM: ", timeout=10)
        announced = time.monotonic() - t0
        child.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        code = child.end(timeout=15)
        stopped = time.monotonic() - t0
    finally:
        child.proc.kill()
        (RESULTS_DIR / "test_robust_long_step.metrics.jsonl").unlink(missing_ok=True)
    last = child.wait_for("interrupted (Ctrl-C)", timeout=5)
    assert progress.strip().endswith("so far, no step time measured yet"), progress
    assert re.fullmatch(r"SIGTERM: the run stops after the step in progress \(step 1 of 3: \d+ s so far, no step time "
                        rf"measured yet\) and saves its checkpoint to {re.escape(str(tmp_path / 'out'))}; a second "
                        r"SIGTERM or Ctrl-C stops at once", said), said
    assert code == 130 and last == "interrupted (Ctrl-C): the run stopped before its summary; checkpoints already " \
                                   "written under --output-dir are complete", (code, child.seen[-5:])
    assert "Traceback" not in " ".join(line for _, line in child.seen)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("checkpoint-*"))  # no step ended
    record(f"a step of minutes: a progress line; SIGTERM said what it waits for in {announced:.1f} s; Ctrl-C ended "
           f"it in {stopped:.1f} s, exit 130", 0, 0, True)


def test_sigterm_waits_for_the_step_only_when_it_has_a_checkpoint_to_write(monkeypatch, tmp_path):
    """What waiting for the step buys is its checkpoint: with --output-dir a SIGTERM is deferred to the end of the
    step; without one it stops the run at once, as Ctrl-C does (it waited for a step of 707 s for nothing). Each
    step is a pass in progress whose words a waiting SIGTERM says."""
    from playbook.run import training
    from playbook.runtime import signals, time_left

    seen = []
    real = training.training_step

    def step(*args, **kwargs):
        seen.append((signals._SIGTERM["defer"], time_left.in_progress()))
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "training_step", step)
    # (--cuda-graphs off: on a GPU the graph's capture calls training_step once more)
    base = ["--model", "llama-tiny", "--kernels", "none", "--batch-size", "1", "--seq-len", "32", "--steps", "2",
            "--timing-warmup-steps", "1", "--tag", "test_robust_defer", "--overwrite", "--cuda-graphs", "off"]
    try:
        for more in ([], ["--output-dir", str(tmp_path / "out")]):
            training.train(parse_config(make_parser("t", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized",
                                        base + more))
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"test_robust_defer{suffix}").unlink(missing_ok=True)
    assert [defer for defer, _ in seen] == [False, False, True, True], seen
    assert seen[0][1].startswith("step 1 of 2: ") and seen[0][1].endswith("no step time measured yet"), seen
    assert seen[1][1].startswith("step 2 of 2: ") and ", left ~" in seen[1][1], seen
    record("SIGTERM deferred to the step's end with --output-dir only; each step a pass in progress", 0, 0, True)


@pytest.mark.parametrize("sig, code, line", [(signal.SIGINT, 130, "interrupted (Ctrl-C)"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")], ids=["Ctrl-C", "SIGTERM"])
def test_a_signal_during_a_call_that_takes_none_stops_within_seconds(sig, code, line, tmp_path):
    """Ctrl-C and an undeferred SIGTERM while the main thread is in a call that does not return for them: the
    process ends GRACE_S later with the line the script's own handling prints, and its exit code."""
    script = tmp_path / "long_call.py"
    script.write_text(_LONG_CALL)
    child = Lines([str(script)], env={"PYTHONPATH": str(HERE)})
    try:
        child.wait_for("in the long call", timeout=60)
        child.proc.send_signal(sig)
        t0 = time.monotonic()
        got = child.end(timeout=15)
        stopped = time.monotonic() - t0
    finally:
        child.proc.kill()
    said = child.wait_for(line, timeout=5)
    assert got == code and said == f"{line}: what the script kept", (got, child.seen)
    record(f"{line} in a call that takes no signal: exit {code} {stopped:.1f} s later, one line", 0, 0, True)


def test_environment_that_contradicts_the_run_is_one_line(monkeypatch, capsys):
    """WORLD_SIZE without torchrun's rendezvous, and TRITON_INTERPRET=0 on a machine without a GPU: refused
    with what to do (exit code 2) before anything is built."""
    if common.torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 is the GPU's normal setting")
    parser = make_parser("t", kernels_default=ak.DEFAULT_KERNELS)
    for env, mentions in (({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "start the run with torchrun"),
                          ({"TRITON_INTERPRET": "0"}, "unset TRITON_INTERPRET")):
        with monkeypatch.context() as m:
            m.delenv("MASTER_ADDR", raising=False)
            for key, value in env.items():
                m.setenv(key, value)
            with pytest.raises(SystemExit) as info:
                parse_config(parser, "finetune_optimized", [])
        err = capsys.readouterr().err
        assert info.value.code == 2 and mentions in err and len(err.strip().splitlines()) == 1, err
        record(f"{' '.join(f'{k}={v}' for k, v in env.items())} -> exit 2, one line", 0.0, 0.0, True)


def test_models_refused_before_they_are_built(monkeypatch, capsys):
    """Names that are no model here (a preset in capitals, a data file) and the 8B preset on a CPU whose
    memory cannot hold it (the memory plan, as the command line is read): one line, exit code 2, before
    anything is built or fetched. (The 8B shapes still build on the meta device: finetune_test.py's preset
    and fallback tests.)"""
    from playbook.model import models
    from playbook.plan import check

    monkeypatch.setattr(common, "host_memory_limit", lambda: 16 * 10**9)  # the 16 GB a container allowed
    monkeypatch.delenv("PLAYBOOK_FREE_MEMORY_GB", raising=False)
    for argv, mentions in ((["--model", "llama-TINY"], "spelled --model llama-tiny"),
                           (["--model", str(HERE / "examples" / "chat.jsonl")], "is a file, not a model"),
                           (["--model", "llama-3.1-8b"], "the plan needs 80.3 GB"),
                           (["--model", "llama-3.1-8b", "--lora-r", "16"], "the plan needs 17.2 GB")):
        if common.torch.cuda.is_available() and "llama-3.1-8b" in argv:
            continue  # the 8B trains on a GPU: the host-memory check is the CPU's
        with pytest.raises(SystemExit) as info:
            cfg = parse_config(make_parser("t", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized",
                               [*argv, "--batch-size", "2", "--seq-len", "64"])
            check.check(cfg)  # as a run starts, before the model is built
            models.load_model(cfg)
        err = capsys.readouterr().err
        assert info.value.code == 2 and mentions in err and len(err.strip().splitlines()) == 1, err
        if "llama-3.1-8b" in argv:  # the way out: the tiny preset, and the memory this machine allows
            assert "--model llama-tiny" in err and "16.0 GB" in err, err
        record(f"{' '.join(argv)} -> exit 2 before building", 0.0, 0.0, True)



def test_ctrl_c_during_a_finalizer_still_stops_the_run():
    """A signal that arrives while the garbage collector runs a finalizer (`__del__`): an exception raised
    there is printed and dropped by Python, and the run went on (a Trainer run on a GPU machine, still running
    60 s after Ctrl-C). The handler delivers it again outside the finalizer: KeyboardInterrupt in the main
    thread, and interrupted() says so."""
    import signal as sig
    import time

    from playbook.runtime import signals

    class Held:
        def __del__(self):  # the handler as Python calls it, with the frame it interrupted
            signals._on_ctrl_c(sig.SIGINT, sys._getframe())

    before, pressed = sig.getsignal(sig.SIGINT), dict(signals._CTRL_C)
    sig.signal(sig.SIGINT, signals._on_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            held = Held()
            del held  # the finalizer runs here: no exception comes out of it
            assert not signals._in_finalizer(sys._getframe())
            time.sleep(5)  # the signal, delivered again a moment later, ends this wait
        assert signals.interrupted()
    finally:
        sig.signal(sig.SIGINT, before)
        signals._CTRL_C.update(pressed)
    record("Ctrl-C inside a finalizer: delivered again outside it, KeyboardInterrupt", 0.0, 0.0, True)

if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "Bad input to the scripts: test report"))
