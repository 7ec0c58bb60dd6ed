"""Tests of the joined projections (q/k/v as one matmul, gate/up as one matmul).

    $ python projections_test.py    # a readable report
    $ pytest projections_test.py

The joined group computes the same sums as the separate layers (each output element is one dot
product of a row of x with a row of one weight), so in fp32 on the CPU the model's loss and every
gradient must match the unpatched model's by testkit's rule; the join itself is checked to have
run (and not silently fallen back to separate matmuls). Then what must hold for a user: the same
Parameters under the same names (an optimizer made before patching, state dicts, save_pretrained),
a cached k/v output never handed to a call it does not belong to, a clear one-line fallback when the
weights stop being side by side, FP8, LoRA, torch.compile, and Phi-3 (joined already) refused.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import copy

import pytest
import torch
from torch import nn

from playbook.model import registry as ak
import projections_kernel as pk
import swiglu_kernel
from testkit import N_TERMS, batch, loss_and_grads, tiny_model  # 2 layers, hidden 64, vocabulary 256
from core.kernel_utils import DEVICE
from testkit import close_to_reference, exactly, expect_error, record, run_as_script

KERNELS = ("rmsnorm", "swiglu", "rope")  # the rest of the default set that shares the decoder layer


def tiny(kind="llama", dtype=torch.float32, seed=0):
    return tiny_model(kind, seed=seed).to(dtype)


class Spy:
    """Counts the groups computed by one matmul (calls of `joined_linear`) while it is active."""

    def __init__(self, monkeypatch):
        self.sizes = []
        original = pk.joined_linear

        def counting(x, modules):
            self.sizes.append(len(modules))
            return original(x, modules)

        monkeypatch.setattr(pk, "joined_linear", counting)


def test_joined_matmul_matches_separate_matmuls():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    joint = torch.randn(96, 64, generator=g, dtype=torch.float64).to(DEVICE)
    weights = [w.requires_grad_() for w in joint.split([64, 16, 16])]
    dys = [torch.randn(37, n, generator=g, dtype=torch.float64).to(DEVICE) for n in (64, 16, 16)]
    ys = pk.joined_matmul(x, weights)
    torch.autograd.backward(ys, dys)
    got = [*ys, x.grad, *[w.grad for w in weights]]
    for t in [x, *weights]:
        t.grad = None
    ys = pk.separate_matmuls(x, weights)
    torch.autograd.backward(ys, dys)
    want = [*ys, x.grad, *[w.grad for w in weights]]
    for what, a, b in zip(("q", "k", "v", "dx", "dWq", "dWk", "dWv"), got, want):
        # float64: one matmul and three give the same sums up to the order of a few additions
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=what)
    record("joined matmul = separate matmuls (float64): outputs, dx, each dW", 0.0, 0.0, True)


def test_joined_matmul_refuses_weights_not_side_by_side():
    w = [torch.randn(8, 4), torch.randn(8, 4)]  # two buffers
    msg = expect_error(ValueError, pk.joined_matmul, torch.randn(3, 4), w)
    assert "side by side" in msg
    record("weights in separate buffers: refused with a clear error", 0.0, 0.0, True)


def test_place_side_by_side_keeps_parameters_and_values():
    layers = [nn.Linear(16, n, bias=False) for n in (16, 4, 4)]
    params = [m.weight for m in layers]
    values = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)  # made before: must still update the same tensors
    pk.place_side_by_side(layers)
    assert all(m.weight is p for m, p in zip(layers, params))
    assert pk.side_by_side(params)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    y = pk.joined_matmul(torch.randn(5, 16), params)
    sum(t.sum() for t in y).backward()
    opt.step()
    assert all(not torch.equal(p, v) for p, v in zip(params, values))
    assert pk.side_by_side(params)  # the update was in place
    record("weights side by side: same Parameters, same values, an earlier optimizer still updates them",
           0.0, 0.0, True)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma"])
def test_model_matches_unjoined_model(kind, monkeypatch):
    base = tiny(kind)
    ours = copy.deepcopy(base)
    ids, labels = batch()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(base).double(), ids, labels)  # unpatched, float64
    ak.apply_kernels(base, KERNELS)
    report = ak.apply_kernels(ours, KERNELS + ("projections",))
    assert report.replaced["projections"] == pk.expected_patches(ours.config) == 2 * ours.config.num_hidden_layers
    base_loss, base_grads = loss_and_grads(base, ids, labels)
    spy = Spy(monkeypatch)
    loss, grads = loss_and_grads(ours, ids, labels)
    layers = ours.config.num_hidden_layers
    assert sorted(spy.sizes) == sorted([3] * layers + [2] * layers), spy.sizes  # every group ran joined
    n = N_TERMS  # tokens x the widest dimension: the longest sums behind the loss and gradients
    close_to_reference(f"{kind}: loss", loss, base_loss, ref_loss, torch.float32, n=n)
    for name, ref in ref_grads.items():
        close_to_reference(f"{kind}: d {name}", grads[name], base_grads[name], ref, torch.float32, n=n)
    assert list(ours.state_dict()) == list(base.state_dict())
    record(f"{kind}: {layers} q/k/v and {layers} gate/up groups joined; same names in the state dict", 0.0, 0.0, True)


def test_waiting_outputs_go_only_to_their_own_call():
    model = tiny()
    ak.apply_kernels(model, ("projections",))
    attn = model.model.layers[0].self_attn
    model(input_ids=batch()[0])  # installs the group
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    x = torch.randn(3, 64, device=DEVICE)
    with torch.no_grad():
        q(x)
        other = x.clone()
        exactly("k of another tensor", k(other), other @ k.weight.t())
        q(x)
        x.mul_(2)  # changed in place: the waiting outputs are of the old values
        exactly("k after x changed in place", k(x), x @ k.weight.t())
        q(x)
        v.weight.mul_(3)  # the weight changed after q's call
        exactly("v after its weight changed", v(x), x @ v.weight.t())
        q(x)
        k_out, v_out = k(x), v(x)
        exactly("k handed back", k_out, x @ k.weight.t())
        exactly("v handed back", v_out, x @ v.weight.t())
        # tensors of their own, not views: attention keeps v for backward, and a view would keep the
        # whole joined output (q and k before RoPE too) alive with it
        assert k_out._base is None and v_out._base is None
        assert q.joined_group.waiting is None  # both handed back: x is no longer held
    record("a waiting k/v output goes only to the same tensor, unchanged, with unchanged weights", 0.0, 0.0, True)


def test_weights_moved_after_patching_fall_back_with_one_message(capsys):
    model = tiny()
    ak.apply_kernels(model, KERNELS + ("projections",))
    ids, labels = batch()
    before, _ = loss_and_grads(model, ids, labels)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.data = attn.k_proj.weight.data.clone()  # no longer next to q's rows
    capsys.readouterr()
    pk._told.clear()
    after, grads = loss_and_grads(model, ids, labels)
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert "separate matmuls" in err and err.count("projections:") == 1, err
    exactly("loss with one group fallen back", after, before)
    assert all(g is not None for g in grads.values())
    record("weights moved after patching: separate matmuls, same loss, one message", 0.0, 0.0, True)


def test_gate_up_gradient_is_written_joined():
    """The fused SwiGLU's backward writes d gate and d up into one [rows, 2I] tensor: the joined
    matmul's backward must get it without autograd copying two halves together."""
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(5, 2, 2 * 48, generator=g) * 3).to(DEVICE).requires_grad_()
    w = torch.randn(32, 48, generator=g).to(DEVICE).requires_grad_()
    dout = torch.randn(5, 2, 32, generator=g).to(DEVICE)
    swiglu_kernel.swiglu_down_joined(gu, w, "silu").backward(dout)
    gate, up = gu.detach()[..., :48].clone().requires_grad_(), gu.detach()[..., 48:].clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    swiglu_kernel.swiglu_down(gate, up, w2, "silu").backward(dout)
    exactly("d gate_up = [d gate | d up]", gu.grad, torch.cat([gate.grad, up.grad], dim=-1))
    exactly("d weight", w.grad, w2.grad)
    h = swiglu_kernel.swiglu_joined(gu.detach(), "gelu_tanh")
    exactly("swiglu_joined = swiglu of the halves", h, swiglu_kernel.swiglu(gate.detach(), up.detach(), "gelu_tanh"))
    record("joined SwiGLU: same values as on separate halves; gradient written as one tensor", 0.0, 0.0, True)


def test_joined_swiglu_ops_pass_opcheck():
    g = torch.Generator().manual_seed(4)
    gu = torch.randn(6, 2 * 40, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(24, 40, generator=g).to(DEVICE).requires_grad_()
    torch.library.opcheck(swiglu_kernel.swiglu_joined_fwd_op, (gu, "silu"))
    torch.library.opcheck(swiglu_kernel.swiglu_down_joined_fwd_op, (gu, w, "silu"))
    record("swiglu_joined and swiglu_down_joined pass torch.library.opcheck", 0.0, 0.0, True)


def test_fp8_groups_run_joined_and_stay_as_accurate(monkeypatch):
    import fp8_linear_kernel

    base = tiny(dtype=torch.bfloat16)
    plain, sep, ours = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for m in (plain, sep, ours):
        ak.apply_kernels(m, KERNELS + (("projections",) if m is ours else ()))
    fp8_linear_kernel.patch_model(sep)
    fp8_linear_kernel.patch_model(ours)  # after: new Float8Linear modules, joined again at the next forward
    ids, labels = batch()
    _, ref = loss_and_grads(plain, ids, labels)
    _, g_sep = loss_and_grads(sep, ids, labels)
    spy = Spy(monkeypatch)
    _, g_ours = loss_and_grads(ours, ids, labels)
    assert sorted(spy.sizes) == [2, 2, 3, 3], spy.sizes
    for name, r in ref.items():
        if "proj" not in name:
            continue
        scale = r.float().norm()
        e_sep = ((g_sep[name].float() - r.float()).norm() / scale).item()
        e_ours = ((g_ours[name].float() - r.float()).norm() / scale).item()
        # One FP8 scale per row of the joined output gradient and per column of the joined weight
        # instead of one per projection: the error against bf16 must stay of the same size (measured
        # within 10% of the separate layers' 2-9% here; 1.5x leaves room for other random weights).
        assert e_ours <= 1.5 * e_sep + 1e-3, (name, e_ours, e_sep)
    record("FP8: groups run joined; each projection's gradient as close to bf16 as the separate layers'",
           0.0, 0.0, True)


def test_lora_on_joined_model_matches_lora_on_plain_model():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    base = tiny()
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    ak.apply_kernels(plain, KERNELS)
    ak.apply_kernels(ours, KERNELS + ("projections",))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    results = []
    for m in (plain, ours):
        torch.manual_seed(7)
        peft_model = get_peft_model(m, copy.deepcopy(config))
        results.append(loss_and_grads(peft_model, *batch()))
    exactly("LoRA loss", results[1][0], results[0][0])
    for name, grad in results[0][1].items():
        if grad is not None:
            torch.testing.assert_close(results[1][1][name], grad, rtol=1e-5, atol=1e-6)  # fp32 sums, same terms
    record("LoRA (peft) on q, v and up of a joined model: same loss and adapter gradients", 0.0, 0.0, True)


def test_save_and_load_hugging_face_format(tmp_path):
    import transformers

    model = tiny()
    ak.apply_kernels(model, ("projections",))
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    theirs = loaded.state_dict()
    for name, t in model.state_dict().items():
        exactly(f"saved {name}", theirs[name], t)
    record("save_pretrained of a joined model loads into a plain one, tensor for tensor", 0.0, 0.0, True)


def test_torch_compile_runs_the_projections_as_written():
    model = tiny()
    ak.apply_kernels(model, KERNELS + ("projections",))
    ids, labels = batch()
    eager, _ = loss_and_grads(model, ids, labels)
    compiled = torch.compile(model, backend="aot_eager")
    loss, grads = loss_and_grads(compiled, ids, labels)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)  # fp32: the graph may reorder sums
    assert all(g is not None for g in grads.values())
    record("torch.compile of a joined model: same loss (the graph runs separate projections)", 0.0, 0.0, True)


def test_torch_compile_does_not_recompile_on_the_second_step():
    """The q/k/v groups are joined when the model is patched (`join_now`), not at its first compiled call: a
    join made inside the compiled forward changes what its guards saw, so the second step recompiled, and a
    recompilation inside the CUDA-graph capture of the training step fails (it synchronizes the GPU), which
    left `--compile` runs eager."""
    import fp8_linear_kernel

    model = tiny()
    ak.apply_kernels(model, KERNELS + ("projections",))
    assert pk.join_now(model) == 0  # patch_model joined them already
    swapped = copy.deepcopy(model)
    fp8_linear_kernel.patch_model(swapped)  # new Float8Linear modules around the same weights
    layers = model.config.num_hidden_layers
    assert pk.join_now(swapped) == layers and pk.join_now(swapped) == 0
    ids, labels = batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    first, _ = loss_and_grads(compiled, ids, labels)
    with torch._dynamo.config.patch(error_on_recompile=True):
        second, _ = loss_and_grads(compiled, ids, labels)
    exactly("second compiled step", second, first)
    record(f"torch.compile: the second step reuses the first one's graphs; {layers} swapped groups joined again",
           0.0, 0.0, True)


def test_phi3_is_left_out_with_a_reason():
    model = tiny("phi3")
    report = ak.apply_kernels(model, ("projections",))
    assert "projections" in report.not_applied and "already" in report.not_applied["projections"]
    record("Phi-3 (qkv_proj, gate_up_proj joined already): not applied, with the reason", 0.0, 0.0, True)


def test_flops_and_bytes():
    assert pk.flops(8192, 4096, "4096+1024+1024", backward=False) == 2 * 8192 * 4096 * 6144
    assert pk.flops(8192, 4096, "14336+14336") == 3 * 2 * 8192 * 4096 * 28672
    e = 2
    assert pk.ideal_bytes(10, 4, "3+5", torch.bfloat16) == (10 * 4 + 8 * 4 + 10 * 8) * e
    record("flops and ideal bytes: the docstring's counts", 0.0, 0.0, True)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Joined projections: q/k/v and gate/up as one matmul each"))
