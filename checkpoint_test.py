"""Tests of checkpoint.py: an exact round trip, Hugging Face loading with no project code, atomic saves.

    $ python checkpoint_test.py     # a readable report
    $ pytest checkpoint_test.py

On a tiny LLaMA (fp32, sdpa) trained a few AdamW steps on random tokens: after load_checkpoint the
weights, the optimizer state, the scheduler state and the random number generators are bitwise what
they were at the save, so one more training step gives bitwise the same weights. The saved directory
loads with AutoModelForCausalLM.from_pretrained (also after the model's modules were patched in place)
and gives identical logits. A save that dies part-way leaves the previous checkpoint and `latest` as
they were; keep_last deletes old checkpoints; bad input gets a one-line error naming the path.
"""

import copy
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import kernel_utils  # noqa: F401  (before peft, which imports triton: see lora._peft)
import checkpoint
from checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from testkit import exactly, expect_error, record, run_as_script

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
    import apply_kernels

    apply_kernels.apply_kernels(model, "rmsnorm,swiglu,linear_cross_entropy")
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
    import data
    from transformers import AutoTokenizer

    model = tiny(seed=9)
    tok = data.byte_tokenizer()
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


def test_refuses_several_processes(tmp_path, monkeypatch):
    """Under torchrun (WORLD_SIZE > 1) both functions refuse instead of writing one shard's view."""
    model = tiny(seed=12)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "2 processes" in expect_error(RuntimeError, save_checkpoint, tmp_path, 1, model, None, None, None, {})
    expect_error(RuntimeError, load_checkpoint, tmp_path, model)
    assert not list(tmp_path.iterdir())


def _lora_run(seed_base, r=4):
    from lora import apply_lora

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


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "Checkpoints: exact round trip, Hugging Face loading, atomic saves"))
