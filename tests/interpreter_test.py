"""A CPU run that uses the kernels on a real model (anything but the llama-tiny preset) is told, before its
first step, that the kernels run in Triton's interpreter, how long a step will take, and what to do
instead; a long step shows where it is (playbook/interpreter.py). The CPU output says only true things.

    $ pytest tests/interpreter_test.py
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from playbook import kernel_utils  # noqa: F401  (before anything imports triton: the CPU interpreter)
from playbook import interpreter, setup_check
from playbook.models import preset_config

HERE = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU run says")


def _tiny(layers: int = 3):
    """The llama-tiny architecture with `layers` decoder layers: a model that is not the preset."""
    from transformers import LlamaForCausalLM

    config = preset_config("llama-tiny")
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_applies_to_a_cpu_run_with_kernels_on_any_model_but_the_cpu_demo():
    cfg = lambda model, gpu=False: SimpleNamespace(on_gpu=gpu, model=model)  # noqa: E731
    assert interpreter.applies(cfg("smollm2-135m"), ("rmsnorm",))
    assert interpreter.applies(cfg("/some/dir"), ("rmsnorm",))
    assert not interpreter.applies(cfg("llama-tiny"), ("rmsnorm",))  # the CPU demo: sized for the interpreter
    assert not interpreter.applies(cfg("smollm2-135m"), ())  # --kernels none
    assert not interpreter.applies(cfg("smollm2-135m", gpu=True), ("rmsnorm",))


def test_estimate_times_one_layer_and_leaves_the_model_as_it_was():
    model = _tiny(3)
    layers = model.model.layers
    ids = torch.randint(0, 512, (2, 32))
    state = torch.random.get_rng_state()
    est = interpreter.estimate_step_seconds(model, {"input_ids": ids, "labels": ids}, grad_accum=2)
    assert est["layers"] == 3 and est["tokens"] == 2 * 2 * 32
    assert est["layer_s"] > 0 and est["rest_s"] >= 0
    assert est["step_s"] == pytest.approx(2 * (est["rest_s"] + 3 * est["layer_s"]))
    assert model.model.layers is layers and len(layers) == 3  # every layer back in place
    assert all(p.grad is None for p in model.parameters())  # no gradient left for the first step to add to
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's random numbers are untouched


def test_heartbeat_says_where_the_step_is(capsys):
    model = _tiny(3)
    ticks = iter(range(0, 10_000, 100))  # a clock that moves 100 s per reading
    beat = interpreter.Heartbeat(model, grad_accum=1, first_step=5, every_s=30, clock=lambda: next(ticks))
    ids = torch.randint(0, 512, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        model(input_ids=ids)
    beat.remove()
    out = capsys.readouterr().out
    assert "step 5, forward: decoder layer 1 of 3" in out and "step 5, forward: decoder layer 3 of 3" in out
    assert "step 5, backward: decoder layer 3 of 3" in out and "step 5, backward: decoder layer 1 of 3" in out
    assert "into the step" in out
    assert "forward without gradients (eval loss or answers): decoder layer 2 of 3" in out
    model(input_ids=ids)  # removed: silent
    assert capsys.readouterr().out == ""


def test_offload_activations_on_a_cpu_says_what_it_does_there(capsys):
    from playbook.models import apply_gradient_checkpointing

    apply_gradient_checkpointing(_tiny(2), offload=True)
    line = capsys.readouterr().out
    assert "side stream" not in line and "pinned" not in line, line  # a GPU's words
    assert "saves nothing there" in line


def test_the_cpu_note_names_the_model_it_runs():
    assert setup_check.model_named(["--steps", "2", "--model", "smollm2-135m"]) == "smollm2-135m"
    assert setup_check.model_named(["--model=x.gguf"]) == "x.gguf" and setup_check.model_named([]) is None
    note = setup_check.cpu_demo_note(model="smollm2-135m")
    assert "llama-tiny" not in note and "--model smollm2-135m" in note and "CPU demo" not in note
    assert "CPU demo" in setup_check.cpu_demo_note() and "CPU demo" in setup_check.cpu_demo_note(model="llama-tiny")


def _run(*argv) -> subprocess.CompletedProcess:
    """A script as a user runs it; the summary it writes under results/ (its --tag) is removed afterwards."""
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    tag = argv[list(argv).index("--tag") + 1]
    try:
        return subprocess.run([sys.executable, *argv], cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (HERE / "results" / f"{tag}{suffix}").unlink(missing_ok=True)


def test_a_real_model_with_kernels_on_a_cpu_is_told_before_the_first_step(tmp_path):
    """finetune_optimized.py on a local model directory (not the llama-tiny preset): the notice, the estimate
    and the way out come before the first step; the summary shows no GPU row and no label not in use."""
    model_dir = tmp_path / "tiny-llama"
    _tiny(2).save_pretrained(model_dir)
    p = _run("finetune_optimized.py", "--model", str(model_dir), "--steps", "2", "--timing-warmup-steps", "1",
             "--batch-size", "1", "--seq-len", "32", "--tag", "cpu_words_probe", "--overwrite")
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    assert f"this run is on the CPU (--model {model_dir}" in out and "CPU demo" not in out
    first_step = out.index("Training: steps 1-2")
    notice = out.index("run in Triton's interpreter")
    estimate = out.index("estimated time per training step here: ~")
    assert notice < estimate < first_step
    assert "an extrapolation" in out and "--kernels none" in out and "use a GPU" in out
    assert "(micro-batches x sequences x tokens each)" in out
    table = out[out.index("| finetune_optimized:"):]
    for gpu_only in ("per GPU", "MFU", "peak GPU memory", "host queue"):
        assert gpu_only not in table, gpu_only
    assert "adamw" not in out.split("Model:", 1)[1].split("\n")[0] and "the kernels in Triton's interpreter" in out
    assert "the kernels ran in Triton's interpreter" in table


def test_the_baseline_on_a_cpu_claims_no_interpreter():
    p = _run("finetune_baseline.py", "--model", "llama-tiny", "--steps", "2", "--timing-warmup-steps", "1",
             "--seq-len", "32", "--tag", "cpu_words_base", "--overwrite")
    assert p.returncode == 0, p.stderr[-2000:]
    note, rest = p.stdout.split("\n", 1)
    assert "this is the CPU demo" in note and "interpreter" not in rest, p.stdout  # the run uses no Triton kernel
    assert "(CPU run: the timings say nothing about a GPU)" in p.stdout
