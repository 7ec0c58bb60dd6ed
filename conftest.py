"""Shared pytest fixtures (pytest loads this file for every test module, in script mode too)."""

import pytest


@pytest.fixture(autouse=True)
def _restore_hugging_face_rope():
    """The rope kernel swaps a module-level function of transformers; undo it after each test."""
    from playbook.model_families import SUPPORTED_MODEL_TYPES, family_module

    saved = {f: family_module(f).apply_rotary_pos_emb for f in SUPPORTED_MODEL_TYPES}
    yield
    for f, fn in saved.items():
        family_module(f).apply_rotary_pos_emb = fn


@pytest.fixture(scope="session", autouse=True)
def kernel_runs_in_background(request, tmp_path_factory):
    """finetune_test.py's loss-parity tests compare 12-step training runs with the project's kernels
    (one to two minutes each on a CPU) against baselines. When a session has any of those tests selected,
    their kernel runs start here, at the session's start, each in a child process
    (finetune_test.start_kernel_runs), and train on the spare cores while the other tests run; the
    tests collect them (finetune_test.parity_runs). Yields {run: (process, result file, log file)}."""
    items = [item for item in request.session.items if "parity_runs" in getattr(item, "fixturenames", ())]
    children = items[0].module.start_kernel_runs(items, tmp_path_factory.mktemp("parity_runs")) if items else {}
    try:
        yield children
    finally:
        for proc, _, _ in children.values():  # still running only when the session ended first (-x, Ctrl-C)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session", autouse=True)
def probe_runs_in_background(request, tmp_path_factory):
    """tests/probe_test.py's cases (about 50 child processes, four minutes of two cores' work) start
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
