"""Every model family the kernels know, patched and unpatched: the same loss and the same gradients.

    $ PYTHONPATH=. python tests/families_test.py       # a readable report
    $ pytest tests/families_test.py

For each family (llama, mistral, qwen2, qwen3, gemma, gemma2, phi3) a tiny random model (2 layers,
hidden 64, vocabulary 256, fp32) is built from transformers' own config class, twice from one seed.
The kernels are applied to one of them (`apply_kernels`, the default set; for Gemma 2 also the
set with the logits-level cross-entropy), and both run the
same random batch, with labels of which about a quarter are -100. The patched model's loss and the
gradient of every parameter must match the unpatched model's by testkit/__init__.py's rule: at most twice
as far from a float64 copy of the model as the fp32 Hugging Face model is, plus one fp32 ulp and
the rounding noise of an fp32 sum of tokens x width terms, of each tensor's scale. Each count that
apply_kernels reports must equal the kernel's `expected_patches` and what the unpatched model
actually holds (its RMSNorm and MLP modules). A third model, patched with the in-place RMSNorm
backward, must give bitwise the same gradients as the second: it would not if a norm whose output
feeds the residual stream (Gemma 2's post norms) ran in place.

What each family exercises: Gemma's norm (1 + w, all in fp32) and GeGLU MLP; Gemma 2's four norms
per layer and its final-logit softcap (set low, 0.5, so that it changes this tiny model's logits,
which stay below ~0.6, and a loss that skipped it would show); Phi-3's fused gate_up_proj, and
partial rotary (partial_rotary_factor 0.5: the first half of each head rotates).
"""

import copy
import inspect

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import pytest
import torch

from playbook.model import registry as ak
import rmsnorm_kernel
from core.kernel_utils import DEVICE
from core.model_families import FAMILIES as TABLE
from testkit import (CONFIGS, FAMILIES, N_TERMS, batch, close_to_reference, exactly, loss_and_grads, record,
                              run_as_script, tiny_model)

KERNEL_SETS = {  # the default set, and the one with the logits-level loss instead of the fused head
    "default": ak.DEFAULT_KERNELS,
    "cross_entropy": ("rmsnorm", "cross_entropy", "swiglu", "rope"),
}
# Every family with the default set; Gemma 2 also with cross_entropy, the loss kernel that sees its
# capped logits whether or not the fused lm_head + loss takes the cap.
CASES = [(kind, "default") for kind in FAMILIES] + [("gemma2", "cross_entropy")]


def count_modules(model, suffix: str) -> int:
    """Modules of the unpatched model whose class name ends in `suffix`: a count independent of the
    family table that the kernels use."""
    return sum(type(m).__name__.endswith(suffix) for m in model.modules())


@pytest.mark.parametrize("kind, kernels", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_family_matches_hugging_face(kind, kernels):
    names = KERNEL_SETS[kernels]
    base, ours, in_place = tiny_model(kind), tiny_model(kind), tiny_model(kind)
    ids, labels = batch()
    # Unpatched first, and the float64 reference: the RoPE kernel replaces a module-level function.
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(base).double(), ids, labels)
    base_loss, base_grads = loss_and_grads(base, ids, labels)

    report = ak.apply_kernels(ours, names)
    for name, why in report.not_applied.items():
        record(f"{kind}: {name} not applied: {why[:60]}...", 0.0, 0.0, True)
    expected = {"rmsnorm": count_modules(base, "RMSNorm"), "swiglu": count_modules(base, "MLP"),
                "cross_entropy": 1, "linear_cross_entropy": 1, "rope": 1,
                "projections": count_modules(base, "Attention") + count_modules(base, "MLP")}
    for name, count in report.replaced.items():
        assert count == ak.kernel_module(name).expected_patches(ours.config) == expected[name], (name, count)
    record(f"{kind}: {report.describe()}", 0.0, 0.0, True)
    assert set(report.replaced) | set(report.not_applied) == set(names) & set(ak.KERNEL_NAMES)  # lora acts later
    assert set(report.not_applied) <= _may_not_apply(kind), f"{kind}: {report.not_applied}"
    loss, grads = loss_and_grads(ours, ids, labels)
    close_to_reference(f"{kind}: loss", loss, base_loss, ref_loss, torch.float32, n=N_TERMS)
    worst, worst_ratio = "", -1.0
    for name, ref in ref_grads.items():
        assert grads[name] is not None, f"{kind}: no gradient for {name}"
        close_to_reference(f"{kind}: d {name}", grads[name], base_grads[name], ref, torch.float32, n=N_TERMS)
        err = (grads[name].double() - ref).abs().max().item()
        ratio = err / max((base_grads[name].double() - ref).abs().max().item(), 1e-30)
        if ratio > worst_ratio:
            worst, worst_ratio = name, ratio
    record(f"{kind}: all {len(ref_grads)} gradients (worst vs HF's error: {worst})", 0.0, 0.0, True)

    # The in-place RMSNorm backward: bitwise the out-of-place results, Gemma 2's post norms spared.
    if "rmsnorm" in report.replaced:
        rmsnorm_kernel.patch_model(in_place, in_place=True)
        ak.apply_kernels(in_place, names)
        loss2, grads2 = loss_and_grads(in_place, ids, labels)
        exactly(f"{kind}: in-place RMSNorm backward: loss", loss2, loss)
        assert all(torch.equal(grads2[n], grads[n]) for n in grads), f"{kind}: in-place gradients differ"
        record(f"{kind}: in-place RMSNorm backward: all gradients bitwise equal", 0.0, 0.0, True)


def _may_not_apply(kind: str) -> set:
    """Kernels that may be left out for a family: the fused lm_head + loss for Gemma 2 unless it
    takes the final-logit softcap; the joined projections for Phi-3, whose are joined already."""
    lce = ak.kernel_module("linear_cross_entropy").linear_cross_entropy
    if kind == "gemma2" and "softcap" not in inspect.signature(lce).parameters:
        return {"linear_cross_entropy"}
    if kind == "phi3":  # q/k/v and gate/up are joined in the checkpoint already
        return {"projections"}
    return set()


def test_every_family_is_available():
    """Every family of the table is in this transformers release (5.17 and 5.23 both have them all),
    with the classes and the function the kernels patch."""
    from core.model_families import SUPPORTED_MODEL_TYPES, family_classes, family_module

    assert SUPPORTED_MODEL_TYPES == FAMILIES == tuple(TABLE)
    for kind in FAMILIES:
        assert len(family_classes("RMSNorm", kind)) == len(family_classes("MLP", kind)) == 1, kind
        assert callable(family_module(kind).apply_rotary_pos_emb), kind
    record(f"{len(FAMILIES)} families: RMSNorm, MLP and apply_rotary_pos_emb found", 0.0, 0.0, True)


def test_kernel_that_does_not_apply_is_reported_in_one_line(capsys):
    """A Gemma config with the exact (erf) GELU: the fused MLP computes silu or gelu_tanh, so swiglu
    is left out with one line saying why, and the other kernels still apply."""
    model = tiny_model("gemma", hidden_act="gelu")
    if model.config.hidden_act != "gelu":  # transformers 5.23 reads Gemma's "gelu" as the tanh form
        model.config.hidden_act = "gelu"
    report = ak.apply_kernels(model, "rmsnorm,swiglu,rope")
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "swiglu not applied" in line]
    assert len(lines) == 1 and "'gelu'" in lines[0] and "Traceback" not in out, out
    assert set(report.not_applied) == {"swiglu"} and set(report.replaced) == {"rmsnorm", "rope"}
    assert "swiglu not applied" in report.describe()
    record(f"one line: {lines[0][:60]}...", 0.0, 0.0, True)


def test_gemma2_fused_loss_and_softcap():
    """Gemma 2 caps its logits before the loss. The fused lm_head + loss applies only in a version
    that takes the cap; otherwise apply_kernels leaves it out and says so."""
    model = tiny_model("gemma2")
    report = ak.apply_kernels(model, "linear_cross_entropy")
    lce = ak.kernel_module("linear_cross_entropy").linear_cross_entropy
    if "softcap" in inspect.signature(lce).parameters:
        assert report.replaced == {"linear_cross_entropy": 1}
        record("gemma2: the fused lm_head + loss takes the softcap and applies", 0.0, 0.0, True)
    else:
        assert "final_logit_softcapping=0.5" in report.not_applied["linear_cross_entropy"]
        record("gemma2: fused lm_head + loss left out (no softcap argument)", 0.0, 0.0, True)


def test_partial_rotary_matches_phi3():
    """Phi-3's apply_rotary_pos_emb rotates only the first cos.shape[-1] dimensions of each head
    (partial_rotary_factor < 1); the fused drop-in does the same, forward and backward."""
    from transformers.models.phi3 import modeling_phi3

    import rope_kernel

    g = torch.Generator().manual_seed(3)
    B, HQ, HK, T, D, R = 2, 4, 2, 5, 16, 8
    q, k = (torch.randn(B, h, T, D, generator=g).to(DEVICE) for h in (HQ, HK))
    angles = torch.randn(B, T, R // 2, generator=g).repeat(1, 1, 2).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    dq, dk = torch.randn(q.shape, generator=g).to(DEVICE), torch.randn(k.shape, generator=g).to(DEVICE)
    results = []
    for fn, dtype in ((rope_kernel.apply_rotary_pos_emb, torch.float32),
                      (modeling_phi3.apply_rotary_pos_emb, torch.float32),
                      (modeling_phi3.apply_rotary_pos_emb, torch.float64)):
        qi, ki = q.to(dtype).clone().requires_grad_(), k.to(dtype).clone().requires_grad_()
        qo, ko = fn(qi, ki, cos.to(dtype), sin.to(dtype))
        torch.autograd.backward([qo, ko], [dq.to(dtype), dk.to(dtype)])
        results.append((qo, ko, qi.grad, ki.grad))
    for i, what in enumerate(("q", "k", "dq", "dk")):
        close_to_reference(f"partial rotary {R} of {D}: {what}", *(r[i] for r in results), torch.float32, n=2)
    exactly("the passed-through half of q is q", results[0][0][..., R:], q[..., R:])


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Model families: test report"))
