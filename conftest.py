"""Shared pytest fixtures (pytest loads this file for every test module, in script mode too).

The tests start as every script does (playbook.startup.start): the environment defaults and, without a
GPU, Triton's interpreter, before pytest imports a test module and with it the kernel files. Ctrl-C is
left to pytest.
"""

import os
import tempfile

# Every summary, metrics file, plot and trace a test's run writes goes to one temporary folder of this pytest
# session (its xdist workers and the scripts they start inherit the variable), never into the tree's results/,
# which holds evidence only (tests/layout_test.py reads it while other tests run).
os.environ.setdefault("PLAYBOOK_RESULTS_DIR", tempfile.mkdtemp(prefix="playbook-test-results-"))

from playbook import startup  # noqa: E402

startup.start()

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_hugging_face_rope():
    """The rope kernel swaps a module-level function of transformers; undo it after each test."""
    from core.model_families import SUPPORTED_MODEL_TYPES, family_module

    saved = {f: family_module(f).apply_rotary_pos_emb for f in SUPPORTED_MODEL_TYPES}
    yield
    for f, fn in saved.items():
        family_module(f).apply_rotary_pos_emb = fn


@pytest.fixture(autouse=True)
def _restore_hugging_face_masks():
    """`--compile` installs packed_attention.install_causal_skip for the rest of its process (transformers' SDPA mask
    function wrapped, its packed-sequence detection off); a test that compiles in-process must not change what
    the tests after it in the same worker see. Undo it after each test."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    mapping = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    saved = (dict(mapping), masking_utils.find_packed_sequence_indices)
    yield
    mapping.clear()
    mapping.update(saved[0])
    masking_utils.find_packed_sequence_indices = saved[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "big_gpu_memory: on a GPU, the test takes tens of GB; such tests run one "
                                       "at a time across pytest-xdist's workers (_gpu_memory_taken_in_turn)")
    config.addinivalue_line("markers", "xdist_group(name): under pytest-xdist with --dist loadgroup, the tests "
                                       "of one group run in one worker")
    # pytest -n N (xdist's default, --dist load) spreads tests one by one: send each xdist_group to one
    # worker instead (loadgroup is load for every unmarked test), so that the parity tests' kernel runs
    # are started by one worker only (kernel_runs_in_background).
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"
    # A worker reads --dist from the command line it was given, not from the controller's options: it
    # names its tests by group (test@group, which loadgroup schedules by) when told so here.
    if getattr(config, "workerinput", {}).get("dist") == "loadgroup":
        config.option.loadgroup = True


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, called on the controller for each worker it starts
def pytest_configure_node(node):
    node.workerinput["dist"] = node.config.getoption("dist")


@pytest.fixture(scope="session", autouse=True)
def kernel_runs_in_background(request, tmp_path_factory):
    """finetune_test.py's loss-parity tests compare 12-step training runs with the project's kernels
    (minutes each on a CPU: longer than any other test) against baselines. When a session has any of those tests selected,
    their kernel runs start here, at the session's start, each in a child process
    (finetune_test.start_kernel_runs), and train on the spare cores while the other tests run; the
    tests collect them (finetune_test.parity_runs).

    Under pytest-xdist every worker collects every test, but only one runs the parity tests (they share
    an xdist_group, which pytest_configure above makes count): there the runs start when the first parity
    test asks for them, and the other workers start none.

    Yields a function that starts the runs once and returns {run: (process, result file, log file)}."""
    items = [item for item in request.session.items if "parity_runs" in getattr(item, "fixturenames", ())]
    children = {}

    def start() -> dict:
        if items and not children:
            children.update(items[0].module.start_kernel_runs(items, tmp_path_factory.mktemp("parity_runs")))
        return children

    if not hasattr(request.config, "workerinput"):  # not an xdist worker: start now
        start()
    try:
        yield start
    finally:
        for proc, _, _ in children.values():  # still running only when the session ended first (-x, Ctrl-C)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session", autouse=True)
def probe_runs_in_background(request, tmp_path_factory):
    """tests/probe_test.py's cases (a child process each, minutes of work in all on a CPU) start
    here, at the session's start, when the session has any of them selected, in one child process at a
    lower priority that uses the cores the other tests leave idle (probe_test.start_in_background); the
    probe tests collect its outcomes (probe_test.outcomes). Yields (process, outcomes file, log file), or
    None when no probe test is selected."""
    items = [item for item in request.session.items if "outcomes" in getattr(item, "fixturenames", ())]
    if not items or items[0].module.SKIP:
        yield None
        return
    child = items[0].module.start_in_background(items, tmp_path_factory.mktemp("probe_cases"))
    try:
        yield child
    finally:
        if child[0].poll() is None:  # still running only when the session ended first (-x, Ctrl-C)
            child[0].kill()
            child[0].wait()


def pytest_runtest_logreport(report):
    """PYTEST_FAILURES_FILE=path: each failure's report is appended to that file as it happens (the end-of-run
    summary of a run stopped by a time limit, or of many worker processes, is never printed)."""
    import os

    path = os.environ.get("PYTEST_FAILURES_FILE")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
            for name, content in report.sections:  # what the test printed: its stdout, stderr and log
                f.write(f"---- {name}\n{content[-4000:]}\n")
            f.write("\n")


@pytest.fixture(autouse=True)
def _gpu_memory_taken_in_turn(request):
    """On a GPU shared by pytest-xdist's workers: a test marked big_gpu_memory (a 131,072-token row, a
    LLaMA-sized vocabulary, offsets past 2^31) waits for the others so marked to finish (a lock file), and
    every test gives its cached GPU memory back when it ends, so what one worker keeps cached is not what
    another's big test runs out of. Without a GPU (or before torch is imported) nothing happens."""
    import sys

    torch = sys.modules.get("torch")
    gpu = torch is not None and torch.cuda.is_available()
    lock = None
    if gpu and request.node.get_closest_marker("big_gpu_memory") is not None:
        import fcntl
        import tempfile
        from pathlib import Path

        lock = open(Path(tempfile.gettempdir()) / "playbook-big-gpu-memory-tests.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if gpu and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if lock is not None:
            lock.close()  # (closing the file releases the lock)

