"""Tests of the LoRA lesson (lora_kernel.py) and its glue (playbook/model/lora.py): LoRA through peft on a
tiny LLaMA, alone and on top of this project's kernels.

    $ python lora_test.py       # a readable report
    $ pytest lora_test.py

r = 8 on the seven projections: only the adapters require grad and change in a training step, the
frozen lm_head gets no gradient; a saved adapter reloads to the same logits; the merged model (a
plain Hugging Face checkpoint) gives the LoRA model's logits up to fp32 rounding. The adapters'
B matrices are set to random values in most tests: peft starts them at zero, and a zero adapter
would make every comparison pass whatever the adapter code did.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import math
import sys
import types

import pytest
import torch
from torch import nn

from core.kernel_utils import DEVICE
from playbook.model import lora
import lora_kernel
import testkit
from playbook.model.lora import ALL_TARGETS, apply_lora, load_adapter, merge_and_save, save_adapter, trainable_parameters
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


def _same_loss_as_plain_lora(tag, patch, after=None):
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
    if after is not None:
        after(patched)
    with torch.no_grad():
        got = _loss(patched, x)
        with patched.disable_adapter():
            without = _loss(patched, x)
    assert (got - without).abs() > 1e-3, f"{tag}: the adapters do not change the loss ({got} vs {without})"
    # one scalar: a mean over 48 targets of a 512-way log-softmax; the rule of testkit/__init__.py
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
    from playbook.model import registry

    patched = _same_loss_as_plain_lora("default kernels + LoRA",
                                       lambda m: registry.apply_kernels(m, registry.DEFAULT_KERNELS))
    x = tokens(11).to(DEVICE)
    _loss(patched, x).backward()
    grads = [p.grad for n, p in patched.named_parameters() if "lora_" in n]
    assert all(g is not None and g.abs().max() > 0 for g in grads)
    record(f"{len(grads)} adapter tensors got non-zero gradients", 0.0, 0.0, True)


@pytest.mark.parametrize("dropout,bias,train_base", [(False, False, False), (True, True, False), (False, True, True)])
def test_fused_lora_function(dropout, bias, train_base):
    """LoRALinearFunction against plain autograd on the same formula, in float64: output and the
    gradients of x, the adapters A and B, and (when they are trained) the base weight and bias."""
    g = torch.Generator().manual_seed(12)

    def rnd(*shape, grad=True):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)

    x, weight, a, b = rnd(3, 5, 24), rnd(40, 24, grad=train_base), rnd(R, 24), rnd(40, R)
    b_vec = rnd(40, grad=train_base) if bias else None
    mask = (torch.rand(3, 5, 24, generator=g) > 0.25).double() / 0.75 if dropout else None
    ours_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, weight, a, b)]
    ours_bias = b_vec.detach().clone().requires_grad_(train_base) if bias else None
    xo = ours_in[0]
    y = lora_kernel.LoRALinearFunction.apply(xo, xo * mask if dropout else xo, ours_in[1], ours_bias, ours_in[2],
                                      ours_in[3], 0.5)
    ref = lora_kernel.lora_linear_ref(x, x * mask if dropout else x, weight, b_vec, a, b, 0.5)
    dy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    y.backward(dy)
    ref.backward(dy)
    # float64 throughout; the fused order (x W^T, then += s (x A^T) B^T) only rounds differently, at
    # ~1e-16 relative on values of size ~10: 1e-12 absolute is far above that and far below any bug
    pairs = [("y", y, ref), ("dx", xo.grad, x.grad), ("dA", ours_in[2].grad, a.grad), ("dB", ours_in[3].grad, b.grad)]
    if train_base:
        pairs += [("dW", ours_in[1].grad, weight.grad), ("dbias", ours_bias.grad, b_vec.grad)]
    else:
        assert ours_in[1].grad is None
    for name, got, want in pairs:
        err = (got - want).abs().max().item()
        record(f"fused LoRA {name} (dropout={dropout}, bias={bias}, base trained={train_base})", err, 1e-12,
               err <= 1e-12)


def _two_lora_models(dtype):
    plain = apply_lora(tiny(seed=13).to(dtype), r=R)
    fused = apply_lora(tiny(seed=13).to(dtype), r=R)
    for m in (plain, fused):
        randomize_adapters(m, seed=14)
        if dtype != torch.float32:  # peft keeps adapters in fp32 whatever the base dtype
            assert all(p.dtype == torch.float32 for n, p in m.named_parameters() if "lora_" in n)
    assert lora_kernel.fuse_lora_layers(fused) == 7 * 2
    return plain, fused


def test_fused_lora_layers_match_peft():
    """fuse_lora_layers on a tiny fp32 LoRA model: loss and every adapter gradient as peft's own
    forward (float64 model as the reference), and the same adapter keys in the state dict."""
    plain, fused = _two_lora_models(torch.float32)
    ref = apply_lora(tiny(seed=13, dtype=torch.float64), r=R)
    randomize_adapters(ref, seed=14)
    x = tokens(15)
    losses = [_loss(m, x) for m in (plain, fused)] + [_loss_float64(ref, x)]
    for loss in losses:
        loss.backward()
    close_to_reference("fused LoRA loss vs peft (fp32)", losses[1], losses[0], losses[2], torch.float32, n=VOCAB)
    grads = [{n: p.grad for n, p in m.named_parameters() if "lora_" in n} for m in (plain, fused, ref)]
    assert grads[0].keys() == grads[1].keys() == grads[2].keys() and len(grads[0]) == 28
    for name in sorted(grads[0])[:4] + sorted(grads[0])[-4:]:
        # an adapter gradient sums over the 2 x 24 tokens and the layer width (up to 176)
        close_to_reference(f"d {name.split('model.')[-1]}", grads[1][name], grads[0][name], grads[2][name],
                           torch.float32, n=176, scale=grads[2][name].abs().max().item())
    assert adapter_state(fused).keys() == adapter_state(plain).keys()


def test_fused_lora_bf16_keeps_no_fp32_copies():
    """bf16 base model: peft saves an fp32 copy of every adapter's input for backward; the fused
    path saves none (x itself is saved once, in bf16), and the loss stays within bf16 rounding of
    peft's (which runs the adapters in fp32) and of the float64 model."""
    plain, fused = _two_lora_models(torch.bfloat16)
    ref = apply_lora(tiny(seed=13, dtype=torch.float64), r=R)
    randomize_adapters(ref, seed=14)
    x = tokens(16)

    def saved_in_lora_layers(model):
        """dtypes of the tensors the 14 LoRA layers save for backward (inside their own forward only)."""
        seen, handles = [], []

        def pack(t):
            seen.append((t.dtype, t.numel()))
            return t

        def enter(module, args):
            module._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            module._ctx.__enter__()

        def leave(module, args, out):
            module._ctx.__exit__(None, None, None)

        peft_linear = type(model.get_base_model().model.layers[0].self_attn.q_proj)
        for m in model.modules():
            if type(m) is peft_linear:
                handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
        loss = _loss(model, x)
        for h in handles:
            h.remove()
        return loss, seen

    plain_loss, plain_saved = saved_in_lora_layers(plain)
    fused_loss, fused_saved = saved_in_lora_layers(fused)
    fp32 = [n for dtype, n in plain_saved if dtype == torch.float32 and n >= 48 * 64]  # a row per token
    assert fp32, "peft was expected to save fp32 copies of the adapter inputs"
    bytes_saved = [sum(n * d.itemsize for d, n in saved) for saved in (plain_saved, fused_saved)]
    record(f"LoRA layers save: peft {bytes_saved[0]:,} B ({len(fp32)} fp32 input copies), fused {bytes_saved[1]:,} B, "
           "no fp32 per-token tensor", 0.0, 0.0,
           not [n for d, n in fused_saved if d == torch.float32 and n >= 48 * 64] and bytes_saved[1] < bytes_saved[0])
    with torch.no_grad():
        ref_loss = _loss_float64(ref, x)
    close_to_reference("fused LoRA loss vs peft (bf16 base)", fused_loss, plain_loss, ref_loss, torch.bfloat16, n=VOCAB)
    fused_loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().max() > 0
               for n, p in fused.named_parameters() if "lora_" in n)


def test_fused_lora_falls_back_to_peft():
    """What the fused path does not cover goes through peft unchanged: disabled adapters (the base
    model's output), a merged layer, autocast."""
    plain, fused = _two_lora_models(torch.float32)
    x = tokens(17)
    with torch.no_grad():
        with fused.disable_adapter():
            exactly("disabled adapters: the base model", fused(x).logits, tiny(seed=13)(x).logits)
        layer = fused.get_base_model().model.layers[0].self_attn.q_proj
        assert lora_kernel._fusable(layer, torch.zeros(1, 64), (), {}) == "default"
        assert lora_kernel._fusable(layer, torch.zeros(1, 64), (), {"adapter_names": ["default"]}) is None
        layer.merge()
        assert lora_kernel._fusable(layer, torch.zeros(1, 64), (), {}) is None
        layer.unmerge()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert lora_kernel._fusable(layer, torch.zeros(1, 64), (), {}) is None
    record("fallbacks: disabled, mixed batch, merged, autocast", 0.0, 0.0, True)
    assert "LoRA model" in expect_error(ValueError, lora_kernel.fuse_lora_layers, tiny())


def test_project_kernels_then_fused_lora():
    """The optimized scripts' LoRA: apply_kernels, apply_lora, fuse_lora_layers. The plain LoRA
    model's loss; the MLPs take the SwiGLU + LoRA down-projection path, which keeps no h =
    silu(gate) * up for backward; every adapter gets a gradient."""
    from playbook.model import registry
    import swiglu_kernel

    fused_mlps = []

    def fuse(model):
        assert lora_kernel.fuse_lora_layers(model) == 14
        fused_mlps.extend(m for m in model.modules()
                          if getattr(m.forward, "__func__", None) is lora_kernel.swiglu_lora_mlp_forward)

    patched = _same_loss_as_plain_lora("default kernels + fused LoRA",
                                       lambda m: registry.apply_kernels(m, registry.DEFAULT_KERNELS), fuse)
    assert len(fused_mlps) == 2
    x = tokens(11).to(DEVICE)
    widths = []

    def pack(t):
        widths.append(tuple(t.shape))
        return t

    mlp = fused_mlps[0]
    handle_in = mlp.register_forward_pre_hook(lambda m, a: setattr(m, "_ctx", torch.autograd.graph.saved_tensors_hooks(
        pack, lambda t: t)) or m._ctx.__enter__())
    handle_out = mlp.register_forward_hook(lambda m, a, o: m._ctx.__exit__(None, None, None))
    loss = _loss(patched, x)
    handle_in.remove(), handle_out.remove()
    # g and u are [tokens, 176] each and saved once by SwiGLUDownLoRAFunction; h would be a third
    per_token = [shape for shape in widths if shape[:-1] == (48,) and shape[-1] == 176]
    assert len(per_token) == 2, widths
    record(f"fused LoRA MLP saves g and u only of the [tokens, 176] activations ({per_token})", 0.0, 0.0, True)
    loss.backward()
    grads = [p.grad for n, p in patched.named_parameters() if "lora_" in n]
    assert all(g is not None and g.abs().max() > 0 for g in grads)
    record(f"{len(grads)} adapter tensors got non-zero gradients", 0.0, 0.0, True)
    assert swiglu_kernel.swiglu_mlp_forward is not lora_kernel.swiglu_lora_mlp_forward


def test_swiglu_down_lora_function():
    """SwiGLUDownLoRAFunction in fp32 against the float64 composition: output and the gradients of
    gate, up, A and B (base weight frozen), with h recomputed in backward."""
    g = torch.Generator().manual_seed(18)
    gate, up = (torch.randn(30, 176, generator=g) for _ in range(2))
    weight, a, b = torch.randn(64, 176, generator=g) / 13, torch.randn(R, 176, generator=g) / 13, torch.randn(64, R, generator=g)
    dy = torch.randn(30, 64, generator=g)
    ins = [t.clone().to(DEVICE).requires_grad_(True) for t in (gate, up)] + [weight.to(DEVICE)] + [
        t.clone().to(DEVICE).requires_grad_(True) for t in (a, b)]
    y = lora_kernel.SwiGLUDownLoRAFunction.apply(*ins, 0.5)
    y.backward(dy.to(DEVICE))
    ref_in = [t.double().requires_grad_(True) for t in (gate, up)] + [weight.double()] + [
        t.double().requires_grad_(True) for t in (a, b)]
    ref = lora_kernel.swiglu_down_lora_ref(*ref_in, 0.5)
    ref.backward(dy.double())
    # torch's fp32 composition, the "PyTorch" side of testkit's rule
    t_in = [t.clone().requires_grad_(True) for t in (gate, up)] + [weight] + [t.clone().requires_grad_(True) for t in (a, b)]
    tref = lora_kernel.swiglu_down_lora_ref(*t_in, 0.5)
    tref.backward(dy)
    close_to_reference("swiglu-down-LoRA y", y, tref, ref, torch.float32, n=176)
    for i, name in ((0, "d gate"), (1, "d up"), (3, "dA"), (4, "dB")):
        # dA sums over 30 tokens, d gate / d up over the 64 outputs (through W and B A)
        close_to_reference(f"swiglu-down-LoRA {name}", ins[i].grad, t_in[i].grad, ref_in[i].grad, torch.float32,
                           n=176, scale=ref_in[i].grad.abs().max().item())


def _dequantized_float64(model_4bit, seed):
    """The tiny model with every NF4 projection replaced by its dequantized weight, in float64:
    the exact model the 4-bit one computes, as a reference."""
    from bitsandbytes.functional import dequantize_4bit

    ref = tiny(seed=seed, dtype=torch.float64)
    with torch.no_grad():
        for name, m in model_4bit.named_modules():
            if lora_kernel._is_4bit(m):
                r = ref.get_submodule(name.replace(".base_layer", ""))
                r.weight.copy_(dequantize_4bit(m.weight.data, m.weight.quant_state).double())
    return ref


def test_qlora_fused_matches_peft():
    """QLoRA: the seven projections quantized to NF4 (bitsandbytes), LoRA on top. The fused path
    dequantizes the base weight inside the matmul's own function (forward and again in backward,
    never kept) and gives peft's bitsandbytes layer's loss; both against the float64 model built
    from the dequantized weights."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (in requirements.txt)")
    models = []
    for _ in range(2):
        base = tiny(seed=19, dtype=torch.bfloat16)
        assert lora.quantize_4bit(base) == 14
        models.append(apply_lora(base, r=R))
        randomize_adapters(models[-1], seed=20)
    plain, fused = models
    ref = apply_lora(_dequantized_float64(plain.get_base_model(), seed=19), r=R)
    randomize_adapters(ref, seed=20)
    assert lora_kernel.fuse_lora_layers(fused) == 14
    x = tokens(21)
    with torch.no_grad():
        ref_loss = _loss_float64(ref, x)
    plain_loss = _loss(plain, x)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_loss = _loss(fused, x)
    # a dequantized projection weight is [out, in] = [64, 64], [176, 64] or [64, 176]; none is kept
    # (the [64, 64] shapes of q_proj/o_proj's weights would also be... activations never have 64 rows here)
    assert not [s for s in saved if s in ((176, 64), (64, 176), (64, 64), (32, 64))], saved
    close_to_reference("QLoRA fused loss vs peft + bitsandbytes (bf16)", fused_loss, plain_loss, ref_loss,
                       torch.bfloat16, n=VOCAB)
    fused_loss.backward()
    grads = [p.grad for n, p in fused.named_parameters() if "lora_" in n]
    assert len(grads) == 28 and all(g is not None and g.abs().max() > 0 for g in grads)
    record("QLoRA: every adapter gets a gradient, no dequantized weight saved", 0.0, 0.0, True)


def test_qlora_script(capsys):
    """`finetune_optimized.py --lora-r 8 --load-in-4bit` on the tiny preset: runs, says what it did."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (in requirements.txt)")
    from playbook.model import registry
    from playbook.run import training
    from playbook.store.files import RESULTS_DIR
    from playbook.config import make_parser, parse_config

    argv = ["--steps", "2", "--timing-warmup-steps", "0", "--batch-size", "1", "--seq-len", "32", "--lora-r", "8",
            "--load-in-4bit", "--tag", "test_qlora", "--overwrite"]
    try:
        summary = training.train(parse_config(make_parser("test", kernels_default=registry.DEFAULT_KERNELS),
                                              "finetune_optimized", argv))
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"test_qlora{suffix}").unlink(missing_ok=True)
    text = capsys.readouterr().out
    assert "projections quantized to NF4" in text and "fused path" in text, text[-2000:]
    assert len(summary["losses"]) == 2 and all(math.isfinite(v) for v in summary["losses"]), summary["losses"]
    record(f"finetune_optimized.py --lora-r 8 --load-in-4bit: 2 steps, losses {summary['losses']}",
           0.0, 0.0, True)


def test_qlora_checkpoint_saves_and_resumes(tmp_path):
    """A QLoRA run writes its checkpoint (the base's fingerprint reads the NF4 weights, packed in
    uint8, by their byte values) and a resumed run continues from it on the same quantized base."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (in requirements.txt)")
    from playbook.model import registry
    from playbook.run import training
    from playbook.store.files import RESULTS_DIR
    from playbook.store import checkpoint_load
    from playbook.config import make_parser, parse_config

    out = tmp_path / "qlora"
    argv = ["--timing-warmup-steps", "0", "--batch-size", "1", "--seq-len", "32", "--lora-r", "8",
            "--load-in-4bit", "--tag", "test_qlora_resume", "--overwrite", "--output-dir", str(out)]
    parser = lambda: make_parser("test", kernels_default=registry.DEFAULT_KERNELS)  # noqa: E731
    try:
        first = training.train(parse_config(parser(), "finetune_optimized", ["--steps", "2", *argv]))
        saved = sorted(p.name for p in out.glob("checkpoint-*"))
        assert saved == ["checkpoint-2"], saved
        fingerprint = checkpoint_load._read_state(out / "checkpoint-2")["base_fingerprint"]
        packed = [name for name in fingerprint if "proj" in name and "lora" not in name]
        assert len(packed) == 14 and all(math.isfinite(v) and v > 0 for n in packed for v in fingerprint[n]), packed
        resumed = training.train(parse_config(parser(), "finetune_optimized",
                                              ["--steps", "3", "--resume", str(out), *argv[:-3], "--output-dir", str(out)]))
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            for f in RESULTS_DIR.glob(f"test_qlora_resume*{suffix}"):
                f.unlink(missing_ok=True)
    # the resumed run's summary holds the whole curve: the checkpoint's two losses, then step 3's
    assert len(resumed["losses"]) == 3 and resumed["losses"][:2] == first["losses"], (first, resumed["losses"])
    record(f"QLoRA: checkpoint-2 written with 14 NF4 weights fingerprinted, resumed for step 3 "
           f"(loss {resumed['losses'][2]:.4f})", 0.0, 0.0, True)


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
