"""What the kernel tests share: a tolerance rule, a check that records itself, and a report.

The tolerance rule (used by every numeric check unless a test says otherwise)
-----------------------------------------------------------------------------
Low-precision results can't be compared to a fixed atol without either hiding bugs (too loose) or
failing on honest rounding (too tight). So each check computes three things on the *same* inputs:

    ref    the operation in float64 (the "true" answer for these low-precision inputs)
    torch  PyTorch's own implementation in the tested dtype
    ours   the Triton kernel

and passes when

    max|ours - ref| <= FACTOR * max|torch - ref|  +  ulp(dtype) * scale  +  2^-23 * sqrt(n) * scale

- FACTOR = 2: the kernel may be at most twice as far from the truth as PyTorch itself is (as in
  quack's and cut-cross-entropy's tests).
- ulp(dtype) * scale: one unit in the last place of the output's scale (by default max|ref|).
  The kernel and PyTorch sum in different orders, so one may round up where the other rounds
  down; a single such flip must not fail the test.
- 2^-23 * sqrt(n) * scale: the typical error of an fp32 reduction over n terms (rounding errors
  of a sum grow like sqrt(n)). It matters only for fp32 inputs, where both implementations are
  pure rounding noise and "2x PyTorch's noise" alone would fail by luck. For bf16 it is ~100x
  smaller than the ulp term. `scale` is the size of the terms being combined; a test passes it
  when that is larger than the result (a gradient that cancels to ~0, for example).

Running `python rmsnorm_test.py` calls every test (expanding `pytest.mark.parametrize`) and prints
each check as a line of a report; `pytest` runs the same functions. With TESTKIT_REPORT set to a file
path, that full report goes to the file and the screen gets a short one: the counts, the failures with
their first error line, the skip reasons, and the check closest to its tolerance (walkthrough.py's step 2):

    $ TESTKIT_REPORT=results/rmsnorm_report.txt python rmsnorm_test.py
"""

import argparse
import contextlib
import os
import sys
import time

import pytest
import torch

from playbook.runtime import environment, signals

FACTOR = 2.0
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float64: 2.0**-52}

_records: list[dict] = []
REPORT_FILE_ENV = environment.REPORT_FILE  # run_as_script: the full report goes to this file, a short one to the screen


def _max_abs(t: torch.Tensor) -> float:
    t = t.double()
    return t.abs().max().item() if t.numel() else 0.0


def close_to_reference(name: str, ours, torch_impl, ref, dtype: torch.dtype, n: int = 1,
                       scale: float | None = None, factor: float = FACTOR):
    """Check `ours` against the float64 `ref` with the tolerance rule above; record and assert.

    n: the length of the longest reduction behind each output value; scale: see the rule above.

    NaNs must sit exactly where the reference has them.
    """
    ours, torch_impl, ref = ours.detach().double().cpu(), torch_impl.detach().double().cpu(), ref.detach().double().cpu()
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    nan_ok = torch.equal(torch.isnan(ours), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    err = _max_abs((ours - ref)[finite])
    torch_err = _max_abs((torch_impl - ref)[finite])
    scale = max(_max_abs(ref[finite]), scale or 0.0)
    tol = factor * torch_err + ULP[dtype] * scale + 2.0**-23 * n**0.5 * scale
    record(name, err, tol, passed=nan_ok and err <= tol, note="" if nan_ok else "NaN positions differ")


def exactly(name: str, ours, expected):
    """Bitwise equality (NaN == NaN), for results that must not depend on rounding at all."""
    ours, expected = ours.detach().cpu(), expected.detach().cpu()
    same = ours.shape == expected.shape and torch.equal(torch.nan_to_num(ours, nan=7.0), torch.nan_to_num(expected, nan=7.0))
    same = same and torch.equal(torch.isnan(ours), torch.isnan(expected))
    err = 0.0 if same else (_max_abs(ours.double() - expected.double()) if ours.shape == expected.shape else float("inf"))
    record(name, err, 0.0, passed=same)


def record(name: str, err: float, tol: float, passed: bool, note: str = ""):
    _records.append(dict(name=name, err=err, tol=tol, passed=bool(passed), note=note))
    assert passed, f"{name}: max error {err:.3e} > tolerance {tol:.3e} {note}".rstrip()


def expect_error(error: type, call, *args) -> str:
    """`call(*args)` must raise `error` (a clear message, not a traceback deep inside); record it."""
    with pytest.raises(error) as info:
        call(*args)
    record(f"{error.__name__}: {str(info.value)[:40]}...", 0.0, 0.0, True)
    return str(info.value)


def random_like_grad(t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A random, non-uniform upstream gradient (a uniform one hides per-row scaling bugs)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(t.shape, generator=g, dtype=torch.float32).to(device=t.device, dtype=t.dtype)


# ------------------------------------------------------------------------------------------------
# Running a test file as a script: pytest runs it (fixtures and all), this plugin prints the report
# ------------------------------------------------------------------------------------------------
def readable_name(item) -> str:
    """A test as the report names it: `test_matches_reference(shape=(37, 1), dtype=float32)` for a parametrized
    one (its values, where pytest's id says `[shape0-dtype0]`), the id otherwise."""
    name = item.nodeid.split("::", 1)[-1]
    spec = getattr(item, "callspec", None)
    if spec is None or not spec.params:
        return name

    def show(v) -> str:
        if type(v).__module__ == "torch" and type(v).__name__ == "dtype":
            return str(v).removeprefix("torch.")
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."

    return name.split("[", 1)[0] + "(" + ", ".join(f"{k}={show(v)}" for k, v in spec.params.items()) + ")"


class _Report:
    """Prints each test's outcome and the checks it recorded, in file order."""

    def __init__(self):
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}
        self.first = 0
        self.failures: list[str] = []      # for the short report: each failure and its BAD checks
        self.skips: dict[str, int] = {}    # skip reason -> how many tests
        self.names: dict[str, str] = {}    # node id -> readable_name

    def pytest_itemcollected(self, item):
        self.names[item.nodeid] = readable_name(item)

    def pytest_runtest_setup(self, item):
        self.first = len(_records)

    # Ctrl-C raises KeyboardInterrupt wherever the test happens to be, and some code turns it into
    # another error (signals.started's note), so the run would go on: stop after this test.
    def pytest_runtest_teardown(self, item):
        if signals.interrupted():
            item.session.shouldstop = "interrupted (Ctrl-C)"

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.failed or report.skipped):
            return
        self.counts[report.outcome] += 1
        why = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            why = report.longrepr[2]  # (file, line, reason)
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)  # the exception's own message
            why = crash.message.splitlines()[0] if crash else report.longreprtext.strip()[-160:]
        name = self.names.get(report.nodeid) or report.nodeid.split("::", 1)[-1]
        print(f"{report.outcome.upper():8} {name}" + (f"  -- {why[:160]}" if why else ""), flush=True)
        for r in _records[self.first:]:
            mark = "ok " if r["passed"] else "BAD"
            print(f"           {mark} {r['name']:<44} max err {r['err']:.2e}  tol {r['tol']:.2e} {r['note']}")
        if report.failed:
            self.failures.append(f"FAILED   {name}  -- {why[:160]}")
            self.failures += [f"           BAD {r['name']}: max err {r['err']:.2e} > tol {r['tol']:.2e} {r['note']}"
                              .rstrip() for r in _records[self.first:] if not r["passed"]]
        elif report.skipped:
            why = why.removeprefix("Skipped: ")
            self.skips[why] = self.skips.get(why, 0) + 1
        self.first = len(_records)

    def pytest_collectreport(self, report):
        if report.failed:  # the file does not import: no test runs, and the reason would go unseen
            why = report.longreprtext.strip().splitlines()[-1] if report.longreprtext.strip() else "collection failed"
            self.counts["failed"] += 1
            self.failures.append(f"ERROR    collecting {report.nodeid or 'the file'}  -- {why[:160]}")
            print(self.failures[-1], flush=True)

    def short(self, title: str, seconds: float, full_report: str) -> str:
        """The report in a few lines: counts, failures, skip reasons, the check closest to its tolerance."""
        c = self.counts
        lines = [f"{title}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped in {seconds:.1f} s; "
                 f"{len(_records)} checks (full report: {full_report})"]
        lines += [f"  {f}" for f in self.failures]
        lines += [f"  skipped {n}: {why}" for why, n in self.skips.items()]
        # checks that passed by staying within tol (some pass by differing: err > tol on purpose)
        margins = [r for r in _records if r["passed"] and 0 < r["tol"] and r["err"] <= r["tol"]]
        if margins:
            r = max(margins, key=lambda r: r["err"] / r["tol"])
            lines.append(f"  closest to its tolerance: {r['name']}: max err {r['err']:.2e}, tol {r['tol']:.2e} "
                         f"({r['err'] / r['tol']:.0%} of it)")
        return "\n".join(lines)


def run_as_script(module_name: str, title: str) -> int:
    """Run the module's tests through pytest (fixtures and marks honoured); print a readable report.

    Returns the process exit code: 0 when every test passed or was skipped.
    """
    module = sys.modules[module_name]
    name = os.path.basename(module.__file__)
    # no options: an argument given is a mistake, refused (exit code 2), not silently ignored
    argparse.ArgumentParser(prog=name, description=f"{title}: runs every test of {name} through pytest and prints "
                            "a short report.", epilog=f"To run some of the tests: pytest {name} -k WORDS").parse_args()
    try:
        full_report = environment.report_file()  # a folder, or a file in no folder: one line, exit code 2
    except environment.BadValue as err:
        raise environment.refused(err) from None
    plugin = _Report()
    with contextlib.ExitStack() as stack:
        if full_report:  # everything below goes to the file; the short report follows on the screen
            try:
                report = stack.enter_context(open(full_report, "w"))
            except OSError as err:
                raise environment.refused(environment.BadValue(
                    REPORT_FILE_ENV, os.environ[REPORT_FILE_ENV], f"cannot be written ({err.strerror or err})",
                    "it takes a file this user may write, for the full report; unset it for the whole report on the "
                    "screen")) from None
            stack.enter_context(contextlib.redirect_stdout(report))
        print(f"{title}\n{'=' * len(title)}")
        doc = (module.__doc__ or "").strip().splitlines()
        print(doc[0] if doc else "", "\n", flush=True)
        start = time.perf_counter()
        signals.started()  # Ctrl-C from here on stops pytest, which reports it as INTERRUPTED
        code = pytest.main([module.__file__, "-s", "-p", "no:cacheprovider", "-p", "no:terminal"], plugins=[plugin])
        seconds = time.perf_counter() - start
        c = plugin.counts
        counts = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
        if code == pytest.ExitCode.INTERRUPTED or signals.interrupted():  # not a result: say so, on the screen
            print(f"\ninterrupted (Ctrl-C) after {seconds:.1f} s: {counts}; the other tests were not run",
                  file=sys.__stderr__, flush=True)
            return 130
        print(f"\n{counts} in {seconds:.1f} s")
    if full_report:
        print(plugin.short(title, seconds, full_report), flush=True)
    return 0 if code in (0, 5) and not c["failed"] else 1


# Tiny models of every family the kernels know (2 layers, hidden 64, vocabulary 256, fp32, random
# RMSNorm weights), shared by tests/families_test.py and the kernel tests that patch whole models.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "phi3": "Phi3Config"}
FAMILY_OPTIONS = {  # what a family needs beyond the shared tiny shape (see the module docstring)
    "gemma2": {"final_logit_softcapping": 0.5},
    "phi3": {"partial_rotary_factor": 0.5},
}
VOCAB, HIDDEN, WIDTH, BATCH, SEQ = 256, 64, 96, 2, 12
# The longest sums behind a loss or gradient value: over the tokens, times over the widest dimension.
N_TERMS = BATCH * SEQ * max(VOCAB, HIDDEN, WIDTH)


def tiny_model(kind: str, seed: int = 0, **overrides):
    """A 2-layer random model of the family, built by transformers from its own config class."""
    import transformers

    options = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=WIDTH, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, bos_token_id=None,
                   eos_token_id=None, pad_token_id=None, **FAMILY_OPTIONS.get(kind, {}))
    options.update(overrides)
    config = getattr(transformers, CONFIGS[kind])(**options)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    from core.model_families import FAMILIES as TABLE

    offset = TABLE[kind].norm_offset
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF initialises (offset + weight) to ones: make the norms' weights random
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.copy_(torch.rand(m.weight.shape, generator=generator) + 0.5 - offset)
    return model.to(_device()).eval()


def batch(seed: int = 0):
    """Random token ids and labels with about a quarter -100 (ignored), the same for every model."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.25, -100, ids)
    return ids.to(_device()), labels.to(_device())


def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _device():
    from core.kernel_utils import DEVICE

    return DEVICE


# ------------------------------------------------------------------------------------------------
# Two processes under torchrun (the FSDP2 and data-parallel tests)
# ------------------------------------------------------------------------------------------------
def signals_as_from_a_shell() -> None:
    """A subprocess's preexec_fn: Ctrl-C and SIGTERM as a shell gives them to a script it starts. A child inherits
    its parent's ignored and blocked signals, and `make test &` (a background job) starts the suite with SIGINT
    ignored; a Python started so never turns Ctrl-C into KeyboardInterrupt, and a test of Ctrl-C then fails."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (Python installs its own handler at start where it is SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def python_path(*folders) -> str:
    """PYTHONPATH for a test's child process: `folders` first, then this process's PYTHONPATH, kept (packages
    installed there, as on a machine whose site-packages are read-only, must stay importable)."""
    return os.pathsep.join([*map(str, folders), *filter(None, [os.environ.get("PYTHONPATH")])])


def two_process_env(**extra: str) -> dict:
    """The environment for a test's `torchrun --nproc-per-node 2`: this process's, plus `extra`.

    With two GPUs or more, each process takes the GPU of its LOCAL_RANK and they meet through NCCL, as
    a run on a GPU machine does. With one GPU, NCCL cannot put two ranks on the one device, so the GPU
    is hidden from the two processes (CUDA_VISIBLE_DEVICES=""; CPU_DEMO=1 tells the scripts' set-up
    check that this is meant): they run as on a machine without a GPU, on the CPU through gloo, the
    kernels in Triton's interpreter; the same sharding code, as in CI. Without a GPU nothing changes."""
    env = {**os.environ, **extra}
    if torch.cuda.is_available() and not two_processes_on_gpus():
        env.update(CUDA_VISIBLE_DEVICES="", CPU_DEMO="1")
    return env


def torchrun(script: str, *args: str) -> list[str]:
    """The command line of `torchrun --nproc-per-node 2 SCRIPT ARGS`, its rendezvous on a port free now (tests
    running side by side, under pytest-xdist, would otherwise meet on torchrun's default 29500 and one fail)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), script, *args]


def two_processes_on_gpus() -> bool:
    """Whether the two processes of two_process_env run on GPUs (one each), not on the CPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def two_process_device() -> torch.device:
    """Inside one of those processes: its GPU (cuda:LOCAL_RANK) where it sees one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
