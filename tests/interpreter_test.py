"""A CPU run that uses the kernels on a real model (anything but the llama-tiny preset) is told, before its
first step, that the kernels run in Triton's interpreter, how long a step will take, and what to do
instead; a long step shows where it is (playbook/run/interpreter.py). The CPU output says only true things.

    $ pytest tests/interpreter_test.py
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from playbook.run import interpreter
from playbook.runtime import setup_check
from playbook.store.files import RESULTS_DIR
from playbook.model.models import preset_config
from testkit import python_path

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
    cfg = lambda model, gpu=False: SimpleNamespace(on_gpu=gpu, model=SimpleNamespace(model=model))  # noqa: E731
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


class _Tick(torch.autograd.Function):
    """Identity whose backward moves the stand-in clock."""

    @staticmethod
    def forward(ctx, x, clock, seconds):
        ctx.clock, ctx.seconds = clock, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.clock[0] += ctx.seconds
        return g, None, None


def _interpreter_costs(model, clock, layer_fwd, layer_bwd, rest_fwd, rest_bwd):
    """Make the model cost stand-in seconds as the interpreter does: per program, so per pass through a module
    whatever its rows (a decoder layer's forward and backward, the embedding and the rest's)."""
    def tick(seconds_fwd, seconds_bwd):
        def hook(module, args, out):
            clock[0] += seconds_fwd
            y = out[0] if isinstance(out, (tuple, list)) else out
            if torch.is_grad_enabled() and y.requires_grad:
                y = _Tick.apply(y, clock, seconds_bwd)
                return (y, *out[1:]) if isinstance(out, (tuple, list)) else y
            return out
        return hook

    for layer in model.model.layers:
        layer.register_forward_hook(tick(layer_fwd, layer_bwd))
    model.model.embed_tokens.register_forward_hook(tick(rest_fwd, rest_bwd))


def test_the_whole_run_estimate_is_within_2x_of_the_run_on_a_stand_in_clock(capsys):
    """Steps, eval passes and sample answers, estimated from the two probes, against the same work run on a
    clock that moves as the interpreter's costs do (per pass through a module, not per token). 2x: the goal's
    bound for a prediction a user plans by; the stand-in costs make the arithmetic exact up to what the probes
    cannot see (the answers' prompt forward, counted as one token more)."""
    from playbook.run.training import evaluate

    clock = [0.0]
    model = _tiny(4)
    _interpreter_costs(model, clock, layer_fwd=3.0, layer_bwd=6.0, rest_fwd=2.0, rest_bwd=1.0)
    now = lambda: clock[0]  # noqa: E731
    torch.manual_seed(0)
    train = [{"input_ids": (ids := torch.randint(0, 512, (2, 16))), "labels": ids} for _ in range(3)]
    held_out = [{"input_ids": (ids := torch.randint(0, 512, (2, 16))), "labels": ids} for _ in range(2)]
    data = SimpleNamespace(batch=lambda i, device: train[i % 3], eval_batches=lambda device: held_out)
    cfg = SimpleNamespace(on_gpu=False, run=SimpleNamespace(device="cpu"), model=SimpleNamespace(model="/some/model"),
                          training=SimpleNamespace(optimizer_in_backward=False, grad_accum=1),
                          data=SimpleNamespace(eval_every=2),
                          output=SimpleNamespace(sample_prompts=None, output_dir=None, save_every=0))
    steps, prompts, new_tokens = 4, 3, 5
    plan = interpreter.run_plan(cfg, data, 0, steps, prompts)
    assert (plan["steps"], plan["evals"], plan["eval_batches"], plan["answers"]) == (4, 3, 2, 6)  # evals: 0, 2, 4
    est = interpreter.estimate_step_seconds(model, train[0], 1, clock=now)
    token_s = interpreter.estimate_token_seconds(model, train[0], clock=now)
    predicted = interpreter.run_seconds(est, token_s, plan, new_tokens)

    t0 = now()  # the run, as training.py does it
    evaluate(model, held_out)
    for step in range(steps):
        model(**train[step % 3]).loss.backward()
        if (step + 1) % cfg.data.eval_every == 0 or step == steps - 1:
            evaluate(model, held_out)
    model.eval()
    for _ in range(plan["answers"]):  # the KV-cached decoding of generate.greedy, every token decoded
        model.generate(input_ids=train[0]["input_ids"][:1, :8], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, use_cache=True, pad_token_id=0)
    measured = now() - t0
    assert measured / 2 <= predicted["total"] <= 2 * measured, (predicted, measured)
    assert predicted["evals"] > 0 and predicted["answers"] > 0  # each part counted, not only the steps

    # and before_training says it before the first step, with each part
    interpreter.before_training(cfg, model, ("rmsnorm",), data, 1, steps, clock=now)
    out = capsys.readouterr().out
    assert "estimated time of the whole run here: ~" in out and "3 eval pass(es) of 2 batch(es)" in out


def test_checkpoint_size_is_said_before_the_first_save(tmp_path, capsys):
    """The size printed before the first save is within 2x of what save_checkpoint writes (2x: the files' own
    headers, the tokenizer-free folder, the random state; weights and optimizer state dominate)."""
    from playbook.store.checkpoint import save_checkpoint

    model = _tiny(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    cfg = SimpleNamespace(output=SimpleNamespace(output_dir=tmp_path / "out", save_every=0, save_total_limit=None))
    interpreter.saves_note(cfg, model, {"saves": 1})
    line = capsys.readouterr().out
    said = interpreter.checkpoint_bytes(model)
    assert line.startswith("Checkpoints: 1 to ") and "optimizer state" in line
    path = save_checkpoint(cfg.output.output_dir, 1, model, None, optimizer, None, {})
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    total = said["weights"] + said["optimizer"]
    assert written / 2 <= total <= 2 * written, (said, written)


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
    from playbook.memory.options import apply_gradient_checkpointing
    from playbook.model.models import decoder_layers

    model = _tiny(2)
    apply_gradient_checkpointing(model, decoder_layers(model), offload=True)
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
    env = {**os.environ, "PYTHONPATH": python_path(HERE)}
    tag = argv[list(argv).index("--tag") + 1]
    try:
        return subprocess.run([sys.executable, *argv], cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)


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


def test_a_loaded_scalar_is_a_loop_bound_in_older_interpreters(monkeypatch):
    """Triton 3.6's interpreter (the GPU machines' Triton, run with the GPU hidden) gave a scalar loaded from
    memory the shape (1,) and an `__index__` that fails on it under numpy 2, so `range(0, n // BLOCK)` in the
    Triton AdamW stopped; kernel_utils adds the squeeze later releases have, only where it is missing."""
    import types

    import numpy as np
    from triton.runtime import interpreter

    from core import kernel_utils

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    def old_patch(tensor, scope):  # as Triton 3.6 sets it
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    tensor = type("Tensor", (), {})
    loaded = tensor()
    loaded.handle = types.SimpleNamespace(data=np.array([7], dtype=np.int32))
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", old_patch)
    old_patch(tensor, Scope())
    with pytest.raises(TypeError):
        range(0, loaded)
    kernel_utils._interpret_loaded_scalars_as_indices()
    interpreter._patch_lang_tensor(tensor, Scope())
    assert list(range(0, loaded)) == list(range(7))
    patched = interpreter._patch_lang_tensor
    kernel_utils._interpret_loaded_scalars_as_indices()  # a release that squeezes (this one now) is left as it is
    assert interpreter._patch_lang_tensor is patched
