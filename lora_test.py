"""Tests of lora.py: LoRA through peft on a tiny LLaMA, alone and on top of this project's kernels.

    $ python lora_test.py       # a readable report
    $ pytest lora_test.py

r = 8 on the seven projections: only the adapters require grad and change in a training step, the
frozen lm_head gets no gradient; a saved adapter reloads to the same logits; the merged model (a
plain Hugging Face checkpoint) gives the LoRA model's logits up to fp32 rounding. The adapters'
B matrices are set to random values in most tests: peft starts them at zero, and a zero adapter
would make every comparison pass whatever the adapter code did.
"""

import sys
import types

import pytest
import torch
from torch import nn

import kernel_utils  # noqa: F401  (before peft, which imports triton: see lora._peft)
from kernel_utils import DEVICE
import lora
import testkit
from lora import ALL_TARGETS, apply_lora, load_adapter, merge_and_save, save_adapter, trainable_parameters
from testkit import close_to_reference, exactly, expect_error, record, run_as_script

VOCAB = 512
R = 8


def tiny(seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype)


def tokens(seed, shape=(2, 24)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, shape, generator=g)


def randomize_adapters(model, seed=0):
    """Random non-zero lora_B (peft initialises B to 0, which makes the adapter a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def adapter_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_only_the_adapters_train():
    """r=8 on all seven targets: the adapters, and only they, require grad, get gradients and change."""
    base = tiny(seed=0)
    linears = {n: m for n, m in base.named_modules() if n.rsplit(".", 1)[-1] in ALL_TARGETS}
    assert len(linears) == 7 * 2
    expected = sum(R * (m.in_features + m.out_features) for m in linears.values())  # A [r, in] + B [out, r]
    n_base = sum(p.numel() for p in base.parameters())
    model = apply_lora(base, r=R)
    trainable, total = trainable_parameters(model)
    assert (trainable, total) == (expected, n_base + expected), (trainable, total, expected, n_base)
    record(f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%)", 0.0, 0.0, True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
    wrapped = {n.split(".lora_")[0] for n in names}
    assert len(wrapped) == 14 and {w.rsplit(".", 1)[-1] for w in wrapped} == set(ALL_TARGETS), wrapped

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=False)
    x = tokens(1)
    model(input_ids=x, labels=x).loss.backward()
    lm_head = model.get_base_model().lm_head.weight
    assert lm_head.grad is None, "the frozen lm_head got a gradient"
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    record("no gradient on any frozen weight (lm_head included)", 0.0, 0.0, True)
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {n for n in before if "lora_B" in n} <= changed, "a lora_B did not change"
    assert all("lora_" in n for n in changed), sorted(n for n in changed if "lora_" not in n)
    record(f"one step changed {len(changed)} tensors, all adapters", 0.0, 0.0, True)


def test_attention_and_listed_targets():
    """'attention' wraps q, k, v, o only; a comma list wraps exactly what it names."""
    def wrapped(model):
        return sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_" in n})

    assert wrapped(apply_lora(tiny(), r=2, targets="attention")) == sorted(lora.ATTENTION_TARGETS)
    assert wrapped(apply_lora(tiny(), r=2, targets="v_proj, down_proj")) == ["down_proj", "v_proj"]
    assert wrapped(apply_lora(tiny(), r=2, targets=["q_proj"])) == ["q_proj"]
    model = apply_lora(tiny(), r=4, alpha=None)
    assert model.peft_config["default"].lora_alpha == 8  # default alpha = 2 r
    record("targets 'attention', a comma list, a list; alpha = 2 r", 0.0, 0.0, True)


def test_adapter_save_and_load(tmp_path):
    """save_adapter, then a fresh base + load_adapter: the same logits, bitwise."""
    model = apply_lora(tiny(seed=2), r=R)
    randomize_adapters(model, seed=3)
    x = tokens(4)
    with torch.no_grad():
        logits = model(x).logits
        base_logits = tiny(seed=2)(x).logits
    assert (logits - base_logits).abs().max() > 1e-2, "the random adapter should change the logits"
    out = save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".md") == ["adapter_config.json",
                                                                           "adapter_model.safetensors"]
    again = load_adapter(tiny(seed=2), out)
    same = adapter_state(again)
    assert same.keys() == adapter_state(model).keys()
    with torch.no_grad():
        exactly("logits after save_adapter / load_adapter", again(x).logits, logits)


def test_merge_and_save(tmp_path):
    """The merged model, loaded by AutoModelForCausalLM alone, gives the LoRA model's logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    x = tokens(5)
    ref_model = apply_lora(tiny(seed=6, dtype=torch.float64), r=R)  # the same LoRA model in float64
    randomize_adapters(ref_model, seed=7)
    model = apply_lora(tiny(seed=6), r=R)
    randomize_adapters(model, seed=7)
    with torch.no_grad():
        ref, lora_logits = ref_model(x).logits, model(x).logits
    out = merge_and_save(model, tmp_path / "merged")
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert keys == set(tiny().state_dict()), sorted(keys ^ set(tiny().state_dict()))
    merged = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    with torch.no_grad():
        merged_logits = merged(x).logits
    # W + s B A rounded to fp32 once, against W x + s B (A x) in fp32: both are fp32 rounding of the
    # same float64 computation, so testkit's rule applies (2x the LoRA model's own error + 1 ulp).
    close_to_reference("merged vs LoRA logits (float64 reference)", merged_logits, lora_logits, ref,
                       torch.float32, n=176)  # the longest reduction: down_proj over 176
    assert (merged_logits - tiny(seed=6)(x).logits).abs().max() > 1e-2, "the merge did not change the weights"


def _loss(model, x):
    return model(input_ids=x, labels=x).loss


def _loss_float64(model, x):
    """The loss of a float64 model in float64 (Hugging Face's loss casts the logits to float32)."""
    logits = model(input_ids=x).logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).double(), x[:, 1:].reshape(-1))


def _patch_swiglu(model):
    import swiglu_kernel

    if hasattr(swiglu_kernel, "patch_model"):
        assert swiglu_kernel.patch_model(model) == 2
    else:
        for m in model.modules():
            if type(m).__name__ == "LlamaMLP":
                m.forward = types.MethodType(swiglu_kernel.swiglu_mlp_forward, m)


def _mlp_bypassing_down_proj(mlp, x):
    """What a fused MLP must not do under LoRA: use down_proj's base weight, skipping its adapter."""
    import swiglu_kernel

    return swiglu_kernel.swiglu_down(mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj.weight)


def _patch_bypass(model):
    for m in model.modules():
        if type(m).__name__ == "LlamaMLP":
            m.forward = types.MethodType(_mlp_bypassing_down_proj, m)


def _same_loss_as_plain_lora(tag, patch):
    """Loss of tiny -> patch -> apply_lora against plain tiny -> apply_lora with the same base and adapter
    weights (and the float64 plain model as reference). The plain losses are computed before `patch`
    runs: a kernel may swap a function of transformers for every model. Returns the patched model."""
    x = tokens(10).to(DEVICE)  # the kernels run where Triton runs: the GPU when there is one
    plain, ref = (apply_lora(tiny(seed=8).to(DEVICE), r=R),
                  apply_lora(tiny(seed=8, dtype=torch.float64).to(DEVICE), r=R))
    for m in (plain, ref):
        randomize_adapters(m, seed=9)
    with torch.no_grad():
        torch_loss, ref_loss = _loss(plain, x), _loss_float64(ref, x)
    patched = tiny(seed=8).to(DEVICE)
    patch(patched)
    patched = apply_lora(patched, r=R)
    randomize_adapters(patched, seed=9)
    with torch.no_grad():
        got = _loss(patched, x)
        with patched.disable_adapter():
            without = _loss(patched, x)
    assert (got - without).abs() > 1e-3, f"{tag}: the adapters do not change the loss ({got} vs {without})"
    # one scalar: a mean over 48 targets of a 512-way log-softmax; the rule of testkit.py
    close_to_reference(f"{tag}: loss vs plain LoRA", got, torch_loss, ref_loss, torch.float32, n=VOCAB)
    return patched


def test_swiglu_kernel_keeps_a_lora_down_proj():
    """swiglu_mlp_forward fuses down_proj's weight into its own op: with LoRA on down_proj it must call
    the adapter-wrapped module instead, or the adapter is silently skipped. Same loss as unpatched."""
    _same_loss_as_plain_lora("swiglu + LoRA", _patch_swiglu)


def test_the_check_catches_a_bypassed_adapter():
    """The same check on an MLP that multiplies by down_proj.weight directly must fail."""
    with pytest.raises(AssertionError, match="loss vs plain LoRA"):
        _same_loss_as_plain_lora("bypassing down_proj", _patch_bypass)
    testkit._records[-1]["passed"] = True  # the failure was expected: report it as caught
    testkit._records[-1]["note"] = "(expected to fail: caught)"


def test_project_kernels_then_lora():
    """apply_kernels (RMSNorm, SwiGLU, RoPE, fused lm_head + loss) then apply_lora: the plain LoRA
    model's loss, and every adapter gets a gradient."""
    import apply_kernels

    patched = _same_loss_as_plain_lora("default kernels + LoRA",
                                       lambda m: apply_kernels.apply_kernels(m, apply_kernels.DEFAULT_KERNELS))
    x = tokens(11).to(DEVICE)
    _loss(patched, x).backward()
    grads = [p.grad for n, p in patched.named_parameters() if "lora_" in n]
    assert all(g is not None and g.abs().max() > 0 for g in grads)
    record(f"{len(grads)} adapter tensors got non-zero gradients", 0.0, 0.0, True)


class _NoProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


def test_errors(monkeypatch):
    """Bad rank, alpha, dropout and targets; a second apply_lora; no peft; non-LoRA models."""
    model = tiny()
    assert "r must be" in expect_error(ValueError, apply_lora, model, 0)
    expect_error(ValueError, apply_lora, model, 2.5)
    expect_error(ValueError, apply_lora, model, 8, -1.0)
    expect_error(ValueError, apply_lora, model, 8, None, 1.0)
    expect_error(ValueError, apply_lora, model, 8, None, -0.1)
    msg = expect_error(ValueError, apply_lora, model, 8, None, 0.0, "q_proj,qproj")
    assert "qproj" in msg and all(t in msg for t in ALL_TARGETS), msg
    expect_error(ValueError, apply_lora, model, 8, None, 0.0, " , ")
    assert "fc" in expect_error(ValueError, apply_lora, _NoProjections(), 8)
    adapted = apply_lora(model, 2)
    assert "already" in expect_error(ValueError, apply_lora, adapted, 2)
    assert "LoRA model" in expect_error(ValueError, save_adapter, tiny(), "x")
    expect_error(ValueError, merge_and_save, tiny(), "x")
    expect_error(FileNotFoundError, load_adapter, tiny(), "no/such/adapter")
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    assert "pip install peft" in expect_error(RuntimeError, apply_lora, tiny(), 8)


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "LoRA through peft: adapters only, save, merge, on top of the kernels"))
