"""Tests of checkpoint.py: an exact round trip, Hugging Face loading with no project code, atomic saves.

    $ PYTHONPATH=. python tests/checkpoint_test.py     # a readable report
    $ pytest tests/checkpoint_test.py

On a tiny LLaMA (fp32, sdpa) trained a few AdamW steps on random tokens: after load_checkpoint the
weights, the optimizer state, the scheduler state and the random number generators are bitwise what
they were at the save, so one more training step gives bitwise the same weights. The saved directory
loads with AutoModelForCausalLM.from_pretrained (also after the model's modules were patched in place)
and gives identical logits. A save that dies part-way leaves the previous checkpoint and `latest` as
they were; keep_last deletes old checkpoints; bad input gets a one-line error naming the path.

Under torchrun (two CPU processes, gloo, the model sharded by FSDP2; one launch of this file as a
worker): 4 steps straight and 2 steps + save + resume + 2 steps give bitwise the same losses,
weights and optimizer state, for full fine-tuning (PyTorch's AdamW, the Triton AdamW on the shards, and
that with fp32 master weights, saved whole and in fp32) and for LoRA; each rank's random state comes back;
the directory is laid out as one process lays it out and AutoModelForCausalLM.from_pretrained gives
bitwise the sharded model's logits; a checkpoint of 1 process loads exactly into 2 and one of 2 into 1;
an error on one rank is raised on both.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import copy
import os
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from playbook.store import checkpoint, checkpoint_load
from playbook.store.checkpoint import list_checkpoints, save_checkpoint
from playbook.store.checkpoint_load import load_checkpoint
import testkit
from testkit import (exactly, expect_error, record, run_as_script, two_process_device, two_process_env,
                              two_processes_on_gpus)
from playbook.optim.optimizer import make_optimizer
from playbook.optim.schedule import LRSchedule

VOCAB = 512


def tiny_config(num_layers=2):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def tiny(seed=0, num_layers=2):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(num_layers))


def tokens(seed, shape=(2, 24)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, shape, generator=g)


def lr_factor(step):
    return min(1.0, (step + 1) / 3) * 0.9 ** step  # warm-up then decay: the state changes every step


def make_training(model):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=False)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def train(model, optimizer, scheduler, steps, seed):
    for i in range(steps):
        x = tokens(seed + i)
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def same_tree(name, a, b):
    """Bitwise equality of nested state (dicts, lists, tensors, numbers)."""
    if isinstance(a, torch.Tensor):
        exactly(name, b, a)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{name}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            same_tree(f"{name}.{k}", a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{name}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same_tree(f"{name}[{i}]", x, y)
    else:
        assert a == b, f"{name}: {a!r} != {b!r}"


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_round_trip_is_exact(tmp_path):
    """Weights, AdamW state, LambdaLR state, extra and RNG come back bitwise; training continues identically."""
    model = tiny(seed=0)
    optimizer, scheduler = make_training(model)
    train(model, optimizer, scheduler, 3, seed=10)
    extra = {"micro_batch": 6, "losses": [3.5, 3.25], "config": {"lr": 1e-2, "data": "random", "seq": (2, 24)}}
    path = save_checkpoint(tmp_path, 3, model, None, optimizer, scheduler, extra)
    assert path == tmp_path / "checkpoint-3" and (tmp_path / "latest").read_text().strip() == "checkpoint-3"
    saved_weights = weights(model)
    saved_opt, saved_sched = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(scheduler.state_dict())
    next_torch, next_python = torch.rand(8), random.random()  # what the generators give right after the save
    # what one more step gives from the saved state
    train(model, optimizer, scheduler, 1, seed=50)
    after_step = weights(model)

    other = tiny(seed=1)  # different weights, a fresh optimizer and schedule
    opt2, sched2 = make_training(other)
    torch.manual_seed(1234), random.seed(1234)  # move the generators away from the saved state
    got = load_checkpoint(tmp_path, other, opt2, sched2)  # output_dir: follows `latest`
    assert got == {**extra, "step": 3}, got
    exactly("next torch.rand after load", torch.rand(8), next_torch)
    assert random.random() == next_python, "python random state not restored"
    record("python random.random() after load", 0.0, 0.0, True)
    same_tree("weights", weights(other), saved_weights)
    same_tree("optimizer", opt2.state_dict(), saved_opt)
    same_tree("scheduler", sched2.state_dict(), saved_sched)
    train(other, opt2, sched2, 1, seed=50)
    same_tree("weights one step later", weights(other), after_step)


def test_reads_format_1(tmp_path):
    """A checkpoint of the first format (one process: one RNG state, the optimizer keyed by position)
    still resumes exactly."""
    model = tiny(seed=0)
    optimizer, scheduler = make_training(model)
    train(model, optimizer, scheduler, 2, seed=10)
    path = save_checkpoint(tmp_path, 2, model, None, optimizer, scheduler, {"n": 2})
    state = torch.load(path / checkpoint.STATE_FILE, weights_only=True)
    assert state["format"] == checkpoint.FORMAT == 2 and len(state["rng"]) == 1
    state = {**state, "format": 1, "rng": state["rng"][0]}
    del state["optimizer_keys"]
    torch.save(state, path / checkpoint.STATE_FILE)
    next_torch = torch.rand(8)
    other = tiny(seed=1)
    opt2, sched2 = make_training(other)
    assert load_checkpoint(path, other, opt2, sched2) == {"n": 2, "step": 2}
    exactly("format 1: next torch.rand after load", torch.rand(8), next_torch)
    same_tree("format 1: weights", weights(other), weights(model))
    same_tree("format 1: optimizer", opt2.state_dict(), optimizer.state_dict())


def test_hugging_face_loads_it(tmp_path):
    """AutoModelForCausalLM.from_pretrained(checkpoint) alone: Hugging Face key names, identical logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = tiny(seed=2)
    optimizer, scheduler = make_training(model)
    train(model, optimizer, scheduler, 2, seed=20)
    path = save_checkpoint(tmp_path / "out", 2, model, None, optimizer, scheduler, {})
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert keys == set(tiny(seed=0).state_dict()), sorted(keys ^ set(tiny(seed=0).state_dict()))
    loaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    x = tokens(99)
    with torch.no_grad():
        exactly("logits of from_pretrained(checkpoint)", loaded(x).logits, model(x).logits)


class StandInRMSNorm(nn.Module):
    """Another RMSNorm class with the same parameter name, as a kernel's drop-in module is."""

    def __init__(self, norm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _mlp_forward(self, x):
    return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _patch_by_hand(model):
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__ == "LlamaRMSNorm":
                setattr(module, child_name, StandInRMSNorm(child))
            if type(child).__name__ == "LlamaMLP":
                child.forward = types.MethodType(_mlp_forward, child)
    assert sum(isinstance(m, StandInRMSNorm) for m in model.modules()) == 5  # 2 per layer + final


def _patch_with_kernels(model):
    from playbook.model import registry

    registry.apply_kernels(model, "rmsnorm,swiglu,linear_cross_entropy")
    assert not any(type(m).__name__ == "LlamaRMSNorm" for m in model.modules())


@pytest.mark.parametrize("patch", ["by hand", "project kernels"])
def test_patched_model_saves_hugging_face_checkpoint(tmp_path, patch):
    """Modules replaced or re-bound in place: still Hugging Face keys, loadable without project code."""
    from transformers import AutoModelForCausalLM

    model = tiny(seed=3)
    x = tokens(7)
    with torch.no_grad():
        reference = model(x).logits
    (_patch_by_hand if patch == "by hand" else _patch_with_kernels)(model)
    path = save_checkpoint(tmp_path, 0, model, None, None, None, None)
    loaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    assert all(type(m).__name__ != "StandInRMSNorm" for m in loaded.modules())
    with torch.no_grad():
        exactly(f"logits after a save of the model patched {patch}", loaded(x).logits, reference)
    # and back into the patched model, strictly
    again = tiny(seed=4)
    (_patch_by_hand if patch == "by hand" else _patch_with_kernels)(again)
    load_checkpoint(path, again)
    same_tree("patched weights reloaded", weights(again), weights(model))


class Killed(BaseException):
    """Stands for the process dying mid-save (not an Exception: nothing may swallow it)."""


def _die(*args, **kwargs):
    raise Killed()


def test_a_save_killed_half_way_changes_nothing(tmp_path, monkeypatch):
    """Dying after the weights are written (trainer state, latest) leaves the previous state intact."""
    model = tiny(seed=5)
    optimizer, scheduler = make_training(model)
    train(model, optimizer, scheduler, 1, seed=30)
    save_checkpoint(tmp_path, 1, model, None, optimizer, scheduler, {"n": 1})
    saved = weights(model)
    before = sorted(p.name for p in tmp_path.iterdir())
    train(model, optimizer, scheduler, 1, seed=31)

    with monkeypatch.context() as m:  # dies while writing trainer_state.pt: the weights are already there
        m.setattr(checkpoint.torch, "save", _die)
        with pytest.raises(Killed):
            save_checkpoint(tmp_path, 2, model, None, optimizer, scheduler, {"n": 2})
        with pytest.raises(Killed):  # re-saving step 1 and dying: the old checkpoint-1 stays
            save_checkpoint(tmp_path, 1, model, None, optimizer, scheduler, {"n": 99})
    assert sorted(p.name for p in tmp_path.iterdir()) == before, sorted(p.name for p in tmp_path.iterdir())
    assert (tmp_path / "latest").read_text() == "checkpoint-1\n"

    real_replace = checkpoint.os.replace

    def replace_but_not_latest(src, dst):
        if Path(dst).name == "latest":
            raise Killed()
        return real_replace(src, dst)

    with monkeypatch.context() as m:  # dies after checkpoint-2 is in place, before `latest` moves
        m.setattr(checkpoint.os, "replace", replace_but_not_latest)
        with pytest.raises(Killed):
            save_checkpoint(tmp_path, 2, model, None, optimizer, scheduler, {"n": 2})
    assert (tmp_path / "latest").read_text() == "checkpoint-1\n"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary file was left"

    fresh = tiny(seed=6)
    opt2, sched2 = make_training(fresh)
    assert load_checkpoint(tmp_path, fresh, opt2, sched2) == {"n": 1, "step": 1}
    same_tree("weights of the checkpoint that survived", weights(fresh), saved)


def test_leftovers_of_a_hard_kill_are_cleaned(tmp_path):
    """A SIGKILL leaves a temporary directory (deleted by the next save) or, between the two renames of a
    re-save, the old checkpoint aside (renamed back by the next save)."""
    model = tiny(seed=7)
    save_checkpoint(tmp_path, 1, model, None, None, None, {"n": 1})
    (tmp_path / ".checkpoint-2.tmp-123-abcd").mkdir()
    (tmp_path / ".checkpoint-2.tmp-123-abcd" / "model.safetensors").write_bytes(b"half")
    (tmp_path / "checkpoint-1").rename(tmp_path / ".checkpoint-1.old-123-abcd")
    save_checkpoint(tmp_path, 3, model, None, None, None, {"n": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-3", "latest"]
    assert load_checkpoint(tmp_path / "checkpoint-1", model) == {"n": 1, "step": 1}
    record("leftovers removed, aside checkpoint restored", 0.0, 0.0, True)


def test_keep_last(tmp_path):
    """keep_last=2 keeps the two newest by step, and never deletes the checkpoint just written."""
    model = tiny(seed=8)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, None, None, None, {}, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    save_checkpoint(tmp_path, 2, model, None, None, None, {}, keep_last=2)  # a resumed run saving an older step
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-2"
    save_checkpoint(tmp_path, 5, model, None, None, None, {}, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5]
    record("keep_last 2, then 1", 0.0, 0.0, True)


def test_tokenizer_and_extra_types(tmp_path):
    """The tokenizer is saved beside the weights; `extra` refuses what weights_only loading cannot return."""
    from transformers import AutoTokenizer

    from playbook.model import tokenizer

    model = tiny(seed=9)
    tok = tokenizer.byte_tokenizer()
    path = save_checkpoint(tmp_path, 1, model, tok, None, None, {"config": {"output_dir": "out"}})
    again = AutoTokenizer.from_pretrained(path)
    assert again("héllo")["input_ids"] == tok("héllo")["input_ids"]
    msg = expect_error(ValueError, save_checkpoint, tmp_path, 2, model, None, None, None,
                       {"config": {"output_dir": Path("out")}})
    assert "extra['config']['output_dir']" in msg and "PosixPath" in msg, msg
    assert not (tmp_path / "checkpoint-2").exists()


def test_errors(tmp_path):
    """Bad arguments and missing, corrupt or mismatched checkpoints: one clear error naming the path."""
    model = tiny(seed=11)
    optimizer, scheduler = make_training(model)
    file = tmp_path / "a_file"
    file.write_text("x")
    msg = expect_error(NotADirectoryError, save_checkpoint, file, 1, model, None, None, None, {})
    assert str(file) in msg
    expect_error(NotADirectoryError, save_checkpoint, file / "sub", 1, model, None, None, None, {})
    expect_error(ValueError, save_checkpoint, tmp_path, -1, model, None, None, None, {})
    expect_error(ValueError, save_checkpoint, tmp_path, 1, model, None, None, None, {}, 0)
    expect_error(ValueError, save_checkpoint, tmp_path, 1, model, None, None, None, {"step": 2})

    missing = tmp_path / "nowhere"
    assert str(missing) in expect_error(FileNotFoundError, load_checkpoint, missing, model)
    assert str(tmp_path) in expect_error(FileNotFoundError, load_checkpoint, tmp_path, model)  # no latest yet

    out = tmp_path / "out"
    path = save_checkpoint(out, 1, model, None, optimizer, scheduler, {})
    (out / "latest").write_text("checkpoint-7\n")
    assert "checkpoint-7" in expect_error(FileNotFoundError, load_checkpoint, out, model)
    (out / "latest").write_text("checkpoint-1\n")

    three_layers = tiny(seed=11, num_layers=3)
    msg = expect_error(RuntimeError, load_checkpoint, path, three_layers)
    assert "missing" in msg and "model.layers.2" in msg, msg
    one_layer = tiny(seed=11, num_layers=1)
    assert "unexpected" in expect_error(RuntimeError, load_checkpoint, path, one_layer)
    half = tiny(seed=11).to(torch.bfloat16)
    assert "bfloat16" in expect_error(RuntimeError, load_checkpoint, path, half)
    opt_other = torch.optim.AdamW([nn.Parameter(torch.randn(3))], fused=False)
    assert str(path) in expect_error(RuntimeError, load_checkpoint, path, model, opt_other)
    bare = save_checkpoint(tmp_path / "bare", 1, model, None, None, None, {})
    assert "optimizer" in expect_error(RuntimeError, load_checkpoint, bare, model, optimizer)

    weights_file = path / "model.safetensors"
    good = weights_file.read_bytes()
    weights_file.write_bytes(good[: len(good) // 2])  # truncated
    assert str(weights_file) in expect_error(RuntimeError, load_checkpoint, path, model)
    weights_file.write_bytes(good)
    state_file = path / checkpoint.STATE_FILE
    state_file.write_bytes(state_file.read_bytes()[:100])
    assert str(state_file) in expect_error(RuntimeError, load_checkpoint, path, model)


def test_read_checkpoint_info(tmp_path):
    """What resuming checks first (step, kind of weights, schedule, extra), without reading the weights."""
    model = tiny()
    optimizer, scheduler = make_training(model)
    save_checkpoint(tmp_path, 3, model, None, optimizer, None, {"settings": {"batch_size": 2}})
    info = checkpoint_load.read_checkpoint_info(tmp_path)  # follows `latest`
    assert info["path"] == tmp_path / "checkpoint-3" and info["step"] == 3 and info["weights"] == "full"
    assert info["scheduler"] is None and info["extra"] == {"settings": {"batch_size": 2}}
    (tmp_path / "checkpoint-3" / checkpoint.STATE_FILE).write_bytes(b"not a zip")
    assert "cannot be read" in expect_error(RuntimeError, checkpoint_load.read_checkpoint_info, tmp_path)
    record("read_checkpoint_info: step, weights, extra; a corrupt state is one clear error", 0.0, 0.0, True)


def test_several_processes_need_a_process_group(tmp_path, monkeypatch):
    """WORLD_SIZE > 1 without torch.distributed initialised: both functions refuse, naming the fix,
    instead of writing (or reading) one process's view of a sharded model."""
    model = tiny(seed=12)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "init_process_group" in expect_error(RuntimeError, save_checkpoint, tmp_path, 1, model, None, None, None, {})
    assert "init_process_group" in expect_error(RuntimeError, load_checkpoint, tmp_path, model)
    assert not list(tmp_path.iterdir())


def test_torchrun_command_line(monkeypatch, capsys):
    """Under torchrun --output-dir, --save-every and --resume are accepted; --merge-lora is refused
    (exit code 2, one line): merging needs each whole weight in one process."""
    from playbook.model import registry as ak
    from playbook.config import make_parser, parse_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # as torchrun sets them (parse_config checks)
    monkeypatch.setenv("MASTER_PORT", "29500")
    parser = make_parser("t", kernels_default=ak.DEFAULT_KERNELS)
    cfg = parse_config(parser, "finetune_optimized", ["--output-dir", "out", "--save-every", "2", "--resume", "."])
    assert cfg.output.output_dir == Path("out") and cfg.output.save_every == 2 and cfg.output.resume == Path(".")
    with pytest.raises(SystemExit) as info:
        parse_config(parser, "finetune_optimized", ["--lora-r", "4", "--merge-lora", "--output-dir", "out"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--merge-lora works in one process" in err and "Traceback" not in err, err
    record("torchrun: --output-dir / --resume accepted, --merge-lora refused", 0.0, 0.0, True)


def _lora_run(seed_base, r=4):
    from playbook.model.lora import apply_lora

    model = apply_lora(tiny(seed=seed_base), r=r)
    optimizer, scheduler = make_training(model)
    return model, optimizer, scheduler


def test_lora_checkpoint(tmp_path):
    """A peft model saves its adapter (not the frozen base) and resumes exactly; the wrong base or LoRA
    settings, or a full checkpoint into a LoRA model, are refused."""
    model, optimizer, scheduler = _lora_run(seed_base=13)
    train(model, optimizer, scheduler, 2, seed=40)
    path = save_checkpoint(tmp_path, 2, model, None, optimizer, scheduler, {"micro_batch": 2})
    files = sorted(p.name for p in path.iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files and "model.safetensors" not in files
    saved, saved_opt = weights(model), copy.deepcopy(optimizer.state_dict())

    again, opt2, sched2 = _lora_run(seed_base=13)  # same base, fresh adapter
    assert load_checkpoint(path, again, opt2, sched2) == {"micro_batch": 2, "step": 2}
    same_tree("LoRA model weights", weights(again), saved)
    same_tree("LoRA optimizer", opt2.state_dict(), saved_opt)

    other_base, *_ = _lora_run(seed_base=14)
    assert "base weight" in expect_error(RuntimeError, load_checkpoint, path, other_base)
    other_rank, *_ = _lora_run(seed_base=13, r=2)
    assert "r = 4" in expect_error(RuntimeError, load_checkpoint, path, other_rank)
    assert "LoRA" in expect_error(RuntimeError, load_checkpoint, path, tiny(seed=13))
    full = save_checkpoint(tmp_path / "full", 1, tiny(seed=13), None, None, None, {})
    assert "full weights" in expect_error(RuntimeError, load_checkpoint, full, again)


def test_adapter_config_names_the_base(tmp_path):
    """adapter_config.json names the base (AutoPeftModelForCausalLM loads it first): a local directory as
    its absolute path; a preset by name, with a note that AutoPeft cannot fetch it."""
    import json

    from playbook.model import lora

    model, optimizer, scheduler = _lora_run(seed_base=13)
    base = tmp_path / "base"
    base.mkdir()
    lora.name_base_model(model, str(base))
    saved = json.loads((lora.save_adapter(model, tmp_path / "adapter") / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(base.resolve()) and "base_model_note" not in saved
    lora.name_base_model(model, "llama-tiny", note="a preset: not on the Hub")
    path = save_checkpoint(tmp_path / "out", 1, model, None, optimizer, scheduler, {})
    saved = json.loads((path / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "llama-tiny" and saved["base_model_note"] == "a preset: not on the Hub"
    again, *_ = _lora_run(seed_base=13)
    load_checkpoint(path, again)  # the extra key is no obstacle to resuming
    record("adapter_config.json names the base (and a preset's note)", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# Two processes (torchrun, FSDP2, gloo on the CPU)
# ------------------------------------------------------------------------------------------------
HERE = Path(__file__).resolve().parent.parent  # the repository root
# the model, batch and optimizer named: the defaults differ on a GPU (the 8B, batch 4, adamw-fused), and a
# checkpoint's optimizer state crosses between one process and two only into the same kind of AdamW
RUN = ["--model", "llama-tiny", "--batch-size", "2", "--steps", "4", "--timing-warmup-steps", "1", "--seq-len", "32",
       "--kernels", "none", "--lr", "1e-3", "--lr-schedule", "cosine", "--lr-warmup-steps", "2", "--weight-decay", "0.1",
       "--log-every", "100", "--overwrite"]
TORCH_ADAMW = ["--optimizer", "adamw-foreach"]  # PyTorch's AdamW, on the CPU and on a GPU
TRITON_NEAREST = ["--optimizer", "adamw-triton", "--optimizer-rounding", "nearest"]
PHASES = {  # the worker's runs, in order: name -> command-line words after RUN (SCRATCH: the test's folder)
    "straight": [*TORCH_ADAMW, "--output-dir", "SCRATCH/straight", "--save-every", "2"],
    "resumed": [*TORCH_ADAMW, "--output-dir", "SCRATCH/resumed", "--resume", "SCRATCH/straight/checkpoint-2"],
    "from_one": [*TORCH_ADAMW, "--output-dir", "SCRATCH/from_one", "--resume", "SCRATCH/one/checkpoint-2"],
    "lora_straight": [*TORCH_ADAMW, "--lora-r", "4", "--output-dir", "SCRATCH/lora_straight", "--save-every", "2"],
    "lora_resumed": [*TORCH_ADAMW, "--lora-r", "4", "--output-dir", "SCRATCH/lora_resumed",
                     "--resume", "SCRATCH/lora_straight/checkpoint-2"],
    # The Triton AdamW on the shards (adamw_kernel.py), rounding to nearest (named: without it the run starts by
    # choosing kahan or stochastic, plan/rounding.choose_rounding), and with an fp32 master weight, the state that
    # torch's loader would cast to the parameter's dtype (TritonAdamW.load_state_dict keeps it fp32)
    "triton_straight": [*TRITON_NEAREST, "--output-dir", "SCRATCH/triton_straight", "--save-every", "2"],
    "triton_resumed": [*TRITON_NEAREST, "--output-dir", "SCRATCH/triton_resumed",
                       "--resume", "SCRATCH/triton_straight/checkpoint-2"],
    "master_straight": ["--master-weights", "fp32", "--output-dir", "SCRATCH/master_straight", "--save-every", "2"],
    "master_resumed": ["--master-weights", "fp32", "--output-dir", "SCRATCH/master_resumed",
                       "--resume", "SCRATCH/master_straight/checkpoint-2"],
}
PROBE = tokens(99)  # the input whose logits are compared


def _config(*argv):
    from playbook.model import registry as ak
    from playbook.config import make_parser, parse_config

    return parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized", list(argv))


def _phase_config(name, scratch):
    return _config(*RUN, "--tag", f"test_ckpt_{name}", *[w.replace("SCRATCH", str(scratch)) for w in PHASES[name]])


def _full_state(model, optimizer):
    """The whole weights (trainable only, for LoRA) and optimizer state, keyed by name, on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=checkpoint._is_peft(model))
    return {"weights": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def _fsdp2_worker(scratch: Path) -> int:
    """Runs under torchrun, called by test_fsdp2_save_and_resume: the PHASES through training.train,
    recording what the test compares (rank 0 writes it into `scratch`)."""
    import json

    from playbook.model import models
    from playbook.run import training

    rank = int(os.environ["RANK"])
    device = two_process_device()
    real_save, real_load = training.save, checkpoint_load.load_checkpoint
    phase = None

    def save_and_record(cfg, step, model, *rest, **kw):
        if phase == "straight":  # each rank its own generator state (training draws none: this changes nothing else)
            torch.manual_seed(1000 * step + rank)
            random.seed(1000 * step + rank)
        real_save(cfg, step, model, *rest, **kw)
        draws = {"torch": torch.rand(4), "python": random.random()}  # what the generators give right after the save
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=PROBE.to(device)).logits  # the sharded model's own forward
        model.train()
        torch.save({"logits": logits, "draws": draws}, scratch / f"{phase}-saved-{step}-rank{rank}.pt")

    def load_and_record(path, model, optimizer=None, scheduler=None):
        got = real_load(path, model, optimizer, scheduler)
        draws = {"torch": torch.rand(4), "python": random.random()}
        state = _full_state(model, optimizer)
        if rank == 0:
            torch.save(state, scratch / f"{phase}-loaded.pt")
        torch.save({"draws": draws}, scratch / f"{phase}-loaded-rank{rank}.pt")
        return got

    # One process group for all the runs: each run ends by destroying it, and a new one cannot be
    # created reliably in the same torchrun job (a rank still in the old one meets the new one's keys).
    real_destroy = torch.distributed.destroy_process_group
    training.save, checkpoint_load.load_checkpoint = save_and_record, load_and_record
    torch.distributed.destroy_process_group = lambda *args, **kwargs: None
    losses, optimizers = {}, {}
    for phase in PHASES:
        summary = training.train(_phase_config(phase, scratch))
        losses[phase], optimizers[phase] = summary["losses"], summary["optimizer"]
    training.save, checkpoint_load.load_checkpoint = real_save, real_load
    torch.distributed.destroy_process_group = real_destroy

    # An error on one rank reaches every rank: disagreeing arguments, then rank 0 failing to write.
    model = models.shard_model(models.build_preset("llama-tiny", None, device, torch.bfloat16))
    errors = {}
    for case in ("disagree", "rank 0 cannot write"):
        if case == "rank 0 cannot write" and rank == 0:
            model.save_pretrained = _disk_full  # this instance only (torch.save also carries the ranks' messages)
        try:
            save_checkpoint(scratch / "errors", 1 + (rank if case == "disagree" else 0), model, None, None, None, {})
            errors[case] = None
        except (ValueError, OSError) as err:
            errors[case] = f"{type(err).__name__}: {err}"
    errors["left in output_dir"] = sorted(p.name for p in (scratch / "errors").iterdir()) if rank == 0 else []
    (scratch / f"worker-rank{rank}.json").write_text(json.dumps({"losses": losses, "optimizers": optimizers,
                                                                  "errors": errors}))
    torch.distributed.destroy_process_group()
    return 0


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _gathered_names(model, optimizer):
    """One process: optimizer state keyed by parameter name, as get_optimizer_state_dict gives it."""
    names = checkpoint_load._parameter_names(model, optimizer)
    return checkpoint_load._optimizer_by_name(optimizer.state_dict(), names)


def _one_process(cfg):
    """The model, optimizer and schedule the training loop builds for cfg (one process)."""
    from playbook.model import models
    from playbook.run import training

    model = models.prepare_model(cfg)[0]
    optimizer = make_optimizer(model, cfg.training, cfg.run)
    return model, optimizer, LRSchedule(optimizer, cfg.training.steps, cfg.training.lr_warmup_steps,
                                        cfg.training.lr_schedule)


def _cleanup_results(tags):
    from playbook.store.files import RESULTS_DIR

    for tag in tags:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)


def test_fsdp2_save_and_resume(tmp_path, capsys):
    """torchrun --nproc-per-node 2 (FSDP2, gloo): 4 steps straight == 2 + save + resume + 2, bit for bit,
    for full fine-tuning and for LoRA; every rank's random state comes back; the checkpoint has the
    one-process layout and loads with AutoModelForCausalLM.from_pretrained, giving the sharded model's
    logits; checkpoints cross between 1 and 2 processes exactly; an error on one rank stops both.

    The two processes take one GPU each where there are two (testkit.two_process_env). With one GPU they
    run on the CPU, and so must the one-process side of the comparisons (a preset's random weights are
    drawn on its device: a CPU's and a GPU's differ), so this test then runs whole in a child process
    that sees no GPU, as on a machine without one."""
    import json
    import subprocess

    from playbook.run import training
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if torch.cuda.is_available() and not two_processes_on_gpus():
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist",
                                f"{Path(__file__).resolve()}::test_fsdp2_save_and_resume"],
                               cwd=HERE, capture_output=True, text=True, timeout=600,
                               env={k: v for k, v in two_process_env().items() if k != "PYTEST_ADDOPTS"})
        assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
        record("1 GPU: the two processes and the one-process side on the CPU (a child process without the GPU)",
               0.0, 0.0, True)
        return
    where = two_process_device()  # the device of rank 0, and of this process's side of the comparisons
    tags = ["test_ckpt_one", "test_ckpt_to_one", "test_ckpt_dataset"] + [f"test_ckpt_{p}" for p in PHASES]
    try:
        # A one-process run first: the reference layout, and a checkpoint for two processes to resume.
        training.train(_config(*RUN, *TORCH_ADAMW, "--tag", "test_ckpt_one", "--output-dir", str(tmp_path / "one"),
                               "--save-every", "2"))
        out = subprocess.run(testkit.torchrun(str(HERE / "tests" / "checkpoint_test.py"), "--fsdp2-worker", str(tmp_path)),
                             cwd=HERE, capture_output=True, text=True, timeout=300,
                             # one thread each (see the logits below); the repository root on the path
                             env=two_process_env(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE)))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"worker-rank{r}.json").read_text()) for r in range(2)]
        losses = ranks[0]["losses"]

        # Resuming: the same float arithmetic in the same order, so the same bits.
        labels = {"": "", "lora_": " LoRA", "triton_": " Triton AdamW", "master_": " Triton AdamW, fp32 master"}
        assert ranks[0]["optimizers"]["triton_resumed"] == "adamw-triton", ranks[0]["optimizers"]
        assert ranks[0]["optimizers"]["master_resumed"] == "adamw-triton, fp32 master weights", ranks[0]["optimizers"]
        for kind, label in labels.items():
            assert len(losses[f"{kind}straight"]) == 4 and losses[f"{kind}resumed"] == losses[f"{kind}straight"], losses
            record(f"2 processes{label}: 4 steps == 2 + resume + 2 (bit for bit)", 0.0, 0.0, True)
        for kind in ("", "triton_", "master_"):
            straight, resumed = tmp_path / f"{kind}straight" / "checkpoint-4", tmp_path / f"{kind}resumed" / "checkpoint-4"
            assert (straight / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes(), kind
            same_tree(f"{labels[kind] or 'AdamW'}: optimizer after 4 steps, straight vs resumed",
                      *(checkpoint_load._read_state(p)["optimizer"] for p in (straight, resumed)))
        # The Triton AdamW's checkpoint of 2 processes holds whole states, as one process's does; the master fp32
        saved = checkpoint_load._read_state(tmp_path / "master_straight" / "checkpoint-2")["optimizer"]["state"]
        whole = load_file(tmp_path / "master_straight" / "checkpoint-2" / "model.safetensors")
        assert saved.keys() == whole.keys(), (sorted(saved)[:3], sorted(whole)[:3])
        for name, state in saved.items():
            assert state["exp_avg"].shape == state["master_param"].shape == whole[name].shape, name
            assert state["master_param"].dtype == torch.float32 and state["exp_avg"].dtype == whole[name].dtype, name
            exactly(f"fp32 master rounded == the saved weight: {name}", state["master_param"].to(whole[name].dtype),
                    whole[name])
        record("2 processes, Triton AdamW: whole states saved, the fp32 master as fp32", 0.0, 0.0, True)
        straight = tmp_path / "straight" / "checkpoint-4"
        for r in range(2):  # each rank's generators, right after the save and right after the load
            saved = torch.load(tmp_path / f"straight-saved-2-rank{r}.pt")["draws"]
            loaded = torch.load(tmp_path / f"resumed-loaded-rank{r}.pt")["draws"]
            exactly(f"rank {r}: torch.rand after load", loaded["torch"], saved["torch"])
            assert loaded["python"] == saved["python"], (r, loaded, saved)
        draws = [torch.load(tmp_path / f"straight-saved-2-rank{r}.pt")["draws"]["torch"] for r in range(2)]
        assert not torch.equal(*draws), "the ranks' generators must differ for this test to tell them apart"

        # The layout of a one-process checkpoint, loadable without this project's code.
        assert sorted(p.name for p in (tmp_path / "straight" / "checkpoint-2").iterdir()) == \
            sorted(p.name for p in (tmp_path / "one" / "checkpoint-2").iterdir())
        assert (tmp_path / "straight" / "latest").read_text() == "checkpoint-4\n"
        assert json.loads((straight / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        loaded = AutoModelForCausalLM.from_pretrained(straight, dtype=torch.bfloat16, attn_implementation="sdpa")
        loaded = loaded.to(where).eval()
        sharded = torch.load(tmp_path / "straight-saved-4-rank0.pt", map_location=where)["logits"]
        threads = torch.get_num_threads()
        # bitwise: the same weights and input on rank 0's device, and on a CPU one thread as in the torchrun
        # processes, so the same kernels sum in the same order
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                exactly("logits: from_pretrained(checkpoint) vs the sharded model",
                        loaded(input_ids=PROBE.to(where)).logits, sharded)
        finally:
            torch.set_num_threads(threads)

        # 1 process -> 2: what the sharded model holds after the load is the one-process checkpoint.
        one = tmp_path / "one" / "checkpoint-2"
        got = torch.load(tmp_path / "from_one-loaded.pt")
        same_tree("1 -> 2 processes: weights", got["weights"], load_file(one / "model.safetensors"))
        cfg = _config(*RUN, *TORCH_ADAMW, "--tag", "test_ckpt_to_one")
        model, optimizer, schedule = _one_process(cfg)
        load_checkpoint(one, model, optimizer, schedule)
        same_tree("1 -> 2 processes: optimizer", got["optimizer"], _gathered_names(model, optimizer))
        assert len(losses["from_one"]) == 4 and all(x == x for x in losses["from_one"]), losses["from_one"]
        assert (tmp_path / "from_one" / "checkpoint-4" / "model.safetensors").is_file()

        # 2 processes -> 1: the same, the other way.
        two = tmp_path / "straight" / "checkpoint-2"
        model, optimizer, schedule = _one_process(cfg)
        assert load_checkpoint(two, model, optimizer, schedule)["world_size"] == 2
        same_tree("2 -> 1 process: weights", weights(model), load_file(two / "model.safetensors"))
        same_tree("2 -> 1 process: optimizer", _gathered_names(model, optimizer),
                  checkpoint_load._read_state(two)["optimizer"])
        rows = tmp_path / "rows.jsonl"
        rows.write_text("\n".join(json.dumps({"prompt": f"Count to {i}.", "completion": " 1 2 3"}) for i in range(40)))
        with pytest.raises(SystemExit) as stop:
            training.train(_config(*RUN, "--tag", "test_ckpt_dataset", "--dataset", str(rows), "--resume", str(two)))
        assert stop.value.code == 2 and "written by 2 process(es), this run has 1" in capsys.readouterr().err
        record("1 <-> 2 processes: weights and optimizer exact; --dataset refused", 0.0, 0.0, True)

        # LoRA: peft's adapter files, loadable by one process on the same base.
        lora = tmp_path / "lora_straight" / "checkpoint-2"
        assert sorted(p.name for p in lora.iterdir() if "adapter" in p.name or "model" in p.name) == \
            ["adapter_config.json", "adapter_model.safetensors"]
        adapter = load_file(lora / "adapter_model.safetensors")
        got = torch.load(tmp_path / "lora_resumed-loaded.pt")["weights"]  # the sharded model after the load
        assert len(got) == len(adapter) > 0
        for name, t in got.items():
            exactly(f"LoRA loaded into 2 processes: {name}", t, adapter[name.replace(".default.", ".")])
        model, optimizer, schedule = _one_process(_config(*RUN, *TORCH_ADAMW, "--tag", "test_ckpt_to_one",
                                                          "--lora-r", "4"))
        load_checkpoint(lora, model, optimizer, schedule)  # the base fingerprint of 2 shards == that of 1 process
        from peft import get_peft_model_state_dict

        same_tree("2 -> 1 process: LoRA adapter", get_peft_model_state_dict(model), adapter)

        # An error on one rank is raised on both; nothing is left behind.
        for rank in ranks:
            assert "every process must pass the same arguments" in rank["errors"]["disagree"], rank["errors"]
            assert "No space left on device" in rank["errors"]["rank 0 cannot write"], rank["errors"]
        assert "(on rank 0)" in ranks[1]["errors"]["rank 0 cannot write"]
        assert ranks[0]["errors"]["left in output_dir"] == [], ranks[0]["errors"]
        record("an error on one rank stops both, leaves no files", 0.0, 0.0, True)
    finally:
        _cleanup_results(tags)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fsdp2-worker"]:  # one of the two processes of test_fsdp2_save_and_resume
        code = _fsdp2_worker(Path(sys.argv[2]))  # its results are written and its process group destroyed
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave without the interpreter's teardown: there, gloo's worker threads can still hold work
        # objects of the sharded model and abort the process ("terminate called without an active
        # exception", SIGABRT; seen once in CI after every phase had passed; pytorch/pytorch#179291
        # describes the same crash), which would fail a run whose results are all in.
        os._exit(code)
    sys.exit(run_as_script(__name__, "Checkpoints: exact round trip, Hugging Face loading, atomic saves"))
