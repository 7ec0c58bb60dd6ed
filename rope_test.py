"""Tests of the fused RoPE: Hugging Face's apply_rotary_pos_emb, forward and backward, LLaMA 3.1 angles.

    $ python rope_test.py  # a readable report: every check, its error and tolerance
    $ pytest rope_test.py  # the same tests under pytest

Inputs are laid out the way the attention layers hand them over: [batch, heads, seq, head_dim]
views of [batch, seq, heads, head_dim] projections. The angles come from transformers' own rotary
embedding module with LLaMA 3.1's rope scaling, at positions past its original 8192-token context.
Tolerances follow the rule in testkit/__init__.py (each output value combines 2 products: n = 2). Then the
kernel as a PyTorch operator (opcheck, torch.compile, no double backward), the process-global patch
of Hugging Face's function (restored after every test that applies it), a tiny LLaMA patched with
all three of rmsnorm, swiglu and rope under torch.compile, and the byte count. The patch's contract shared
with the other lessons (the count, patching twice, the Parameters, the patched logits; the docstring's byte
counts) is tests/lesson_contract_test.py's, which calls check_patched below for what is RoPE's own.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import pytest
import torch

import rmsnorm_kernel
import rope_kernel
import swiglu_kernel
from core.kernel_utils import DEVICE
from rope_kernel import (MAX_HEAD_TILE, apply_rotary_pos_emb, ideal_bytes, patch_model, rope, rope_bwd_op,
                         rope_fwd_op, rope_ref, unpatch_model)
from testkit import close_to_reference, exactly, expect_error, random_like_grad, record, run_as_script

ON_GPU = DEVICE.type == "cuda"
LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)


def _angles(batch, positions, head_dim, dtype, scaling=True):
    """cos/sin [batch, T, head_dim] from transformers' LlamaRotaryEmbedding (as the model computes them)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=500000.0,
                      max_position_embeddings=131072, rope_scaling=LLAMA31_SCALING if scaling else None)
    rotary = LlamaRotaryEmbedding(cfg).to(DEVICE)
    probe = torch.empty(1, dtype=dtype, device=DEVICE)
    cos, sin = rotary(probe, positions.to(DEVICE).expand(batch, -1))
    return cos, sin


def _qk(batch, hq, hk, seq, head_dim, dtype, seed=0):
    """q and k as the attention layer makes them: projections viewed as [B, heads, T, D]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, seq, hq, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(batch, seq, hk, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
    return q, k


def _run(fn, q, k, cos, sin, dq, dk):
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qo, ko = fn(q, k, cos, sin)
    torch.autograd.backward([qo, ko], [dq, dk])
    return qo.detach(), ko.detach(), q.grad, k.grad


def _check(tag, q, k, cos, sin, dq=None, dk=None):
    dtype = q.dtype
    dq = random_like_grad(q, 1) if dq is None else dq
    dk = random_like_grad(k, 2) if dk is None else dk
    ours = _run(rope, q, k, cos, sin, dq, dk)
    same = _run(rope_ref, q, k, cos, sin, dq, dk)
    ref = _run(rope_ref, q.double(), k.double(), cos.double(), sin.double(), dq.double(), dk.double())
    for i, what in enumerate(("q_embed", "k_embed", "dq", "dk")):
        close_to_reference(f"{tag} {what}", ours[i], same[i], ref[i], dtype, n=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hk, head_dim", [(4, 2, 16), (4, 1, 16), (6, 6, 64), (3, 1, 24), (1, 1, 2)])
def test_matches_hugging_face(hq, hk, head_dim, dtype):
    """GQA (2 groups), one KV head (MQA), MHA, head counts / dims that are not powers of 2, and the
    smallest head (one pair of halves of one value each)."""
    positions = torch.arange(5).unsqueeze(0) * 2000 + 9000  # 9000 ... 17000: past the 8192 context
    cos, sin = _angles(2, positions, head_dim, dtype)
    q, k = _qk(2, hq, hk, 5, head_dim, dtype)
    _check(f"hq={hq} hk={hk} d={head_dim}", q, k, cos, sin)


def test_llama31_scaling_changes_the_angles():
    """The kernel must honour the tables it is given: scaled and unscaled angles give other results."""
    positions = torch.arange(6).unsqueeze(0) * 3000
    q, k = _qk(1, 2, 1, 6, 16, torch.float32, seed=3)
    scaled = rope(q, k, *_angles(1, positions, 16, torch.float32, scaling=True))[0]
    plain = rope(q, k, *_angles(1, positions, 16, torch.float32, scaling=False))[0]
    ref = rope_ref(q, k, *_angles(1, positions, 16, torch.float32, scaling=True))[0]
    close_to_reference("LLaMA 3.1 scaled angles", scaled, ref, ref, torch.float32, n=2, factor=0)
    assert (scaled - plain).abs().max() > 0.1, "scaled and unscaled angles must differ at long positions"


def test_per_sequence_positions_and_contiguous_inputs():
    """Each sequence its own positions (packing, left padding); q/k plain contiguous tensors."""
    positions = torch.stack([torch.arange(7), torch.arange(7) + 100, torch.arange(7).flip(0)])
    cos, sin = _angles(3, positions, 32, torch.bfloat16)
    q, k = (t.contiguous() for t in _qk(3, 4, 2, 7, 32, torch.bfloat16, seed=4))
    _check("per-sequence positions, contiguous q/k", q, k, cos, sin)


def test_one_table_for_the_whole_batch():
    positions = torch.arange(9).unsqueeze(0)
    cos, sin = _angles(1, positions, 16, torch.float32)  # [1, T, D], broadcast over 2 sequences
    q, k = _qk(2, 2, 2, 9, 16, torch.float32, seed=5)
    _check("cos/sin [1, T, D] broadcast", q, k, cos, sin)


def test_hugging_face_signature_and_layouts():
    positions = torch.arange(4).unsqueeze(0)
    cos, sin = _angles(2, positions, 16, torch.float32)
    q, k = _qk(2, 2, 1, 4, 16, torch.float32, seed=6)
    ref = rope_ref(q, k, cos, sin)
    out = apply_rotary_pos_emb(q, k, cos, sin)
    exactly("drop-in, unsqueeze_dim=1 == rope()", out[0], rope(q, k, cos, sin)[0])
    close_to_reference("drop-in q", out[0], ref[0], ref[0], torch.float32, n=2, factor=0)
    out_bthd = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    exactly("[B, T, heads, D] layout (unsqueeze_dim=2)", out_bthd[1].transpose(1, 2), out[1])
    old_style = apply_rotary_pos_emb(q, k, cos, sin, None, 1)  # (position_ids, unsqueeze_dim) of older releases
    exactly("older signature with position_ids", old_style[0], out[0])


def test_upstream_gradients_with_stride_0():
    """A gradient broadcast over the heads (stride 0 along heads) and one from `.sum()` (every
    stride 0), as autograd can hand them over."""
    cos, sin = _angles(2, torch.arange(6).unsqueeze(0) + 50, 16, torch.bfloat16)
    q, k = _qk(2, 4, 2, 6, 16, torch.bfloat16, seed=8)
    g = torch.Generator().manual_seed(9)
    dq = torch.randn(2, 1, 6, 16, generator=g).to(DEVICE, torch.bfloat16).expand_as(q)
    dk = torch.randn((), generator=g).to(DEVICE, torch.bfloat16).expand_as(k)  # random, so a dropped dk shows
    assert dq.stride(1) == 0 and dk.stride() == (0, 0, 0, 0)
    _check("dq broadcast over heads, dk of a sum", q, k, cos, sin, dq=dq, dk=dk)


def test_empty_sequence():
    """No tokens: forward and backward return empty tensors of the right shapes."""
    cos = torch.zeros(1, 0, 16, device=DEVICE)
    q, k = (t.clone().requires_grad_() for t in _qk(2, 2, 1, 0, 16, torch.float32))
    qo, ko = rope(q, k, cos, cos)
    assert qo.shape == q.shape and ko.shape == k.shape
    (qo.sum() + ko.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    record("empty sequence: forward and backward", 0.0, 0.0, True)


def test_too_many_heads_are_refused():
    heads, head_dim = 512, 512
    assert heads * head_dim // 2 > MAX_HEAD_TILE  # 131072 values of one token's heads
    q = torch.randn(1, heads, 1, head_dim, device=DEVICE)
    cos = torch.randn(1, 1, head_dim, device=DEVICE)
    expect_error(ValueError, rope, q, q[:, :1], cos, cos)


def test_second_order_gradients_raise():
    """RoPE is linear in q, so dq depends only on the upstream gradient: differentiate through it
    with respect to that gradient (the double-backward trick behind Jacobian-vector products)."""
    cos, sin = _angles(1, torch.arange(4).unsqueeze(0), 16, torch.float32)
    q, k = (t.clone().requires_grad_() for t in _qk(1, 2, 1, 4, 16, torch.float32))
    qo, ko = rope(q, k, cos, sin)
    v = random_like_grad(qo).requires_grad_()
    (dq,) = torch.autograd.grad(qo, q, v, create_graph=True)
    assert "second-order" in expect_error(RuntimeError, lambda: dq.sum().backward())


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake implementation (strides included: HF's transposed views
    must come back in the same layout), autograd registration, AOTAutograd with dynamic shapes."""
    cos, sin = _angles(2, torch.arange(5).unsqueeze(0) + 7, 24, torch.bfloat16)
    q, k = _qk(2, 3, 1, 5, 24, torch.bfloat16, seed=10)
    torch.library.opcheck(rope_fwd_op, (q.clone().requires_grad_(), k.clone().requires_grad_(), cos, sin))
    torch.library.opcheck(rope_fwd_op, (q.contiguous(), k.contiguous(), cos[:1], sin[:1]))
    torch.library.opcheck(rope_bwd_op, (random_like_grad(q, 11), random_like_grad(k, 12), cos, sin))
    record("opcheck: rope_fwd (x2), rope_bwd", 0.0, 0.0, True)


def test_torch_compile_matches_eager():
    """fullgraph=True: the operators are opaque, so the compiled graph runs the same kernels on the
    same data, and outputs and gradients are equal bit for bit."""
    torch._dynamo.reset()
    compiled = torch.compile(rope, fullgraph=True)
    cos, sin = _angles(2, torch.arange(6).unsqueeze(0) + 3, 16, torch.bfloat16)
    q, k = _qk(2, 4, 2, 6, 16, torch.bfloat16, seed=13)
    dq, dk = random_like_grad(q, 14), random_like_grad(k, 15)
    results = []
    for fn in (rope, compiled):
        qi, ki = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        qo, ko = fn(qi, ki, cos, sin)
        torch.autograd.backward([qo, ko], [dq, dk])
        results.append((qo, ko, qi.grad, ki.grad))
    for what, eager, comp in zip(("q_embed", "k_embed", "dq", "dk"), *results):
        exactly(f"torch.compile == eager: {what}", comp, eager)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=176, rms_norm_eps=1e-5)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DEVICE)
    for m in model.modules():  # HF initialises RMSNorm weights to ones; make them random
        if type(m).__name__.endswith("RMSNorm"):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    return model


def check_patched(kind: str, model, count: int):
    """RoPE's own part of tests/lesson_contract_test.py's contract (the count expected_patches says, patching twice
    a no-op, the same Parameters, the patched logits): the family module's one function is the kernel's."""
    from core.model_families import family_module

    assert count == 1 and family_module(kind).apply_rotary_pos_emb is apply_rotary_pos_emb, (kind, count)


def test_patch_model_twice_then_restore():
    """Patched twice (the counts are the contract's), restored once: Hugging Face's original function is back."""
    from transformers.models.llama import modeling_llama

    model = _tiny_llama()
    original = modeling_llama.apply_rotary_pos_emb
    try:
        patch_model(model)
        patch_model(model)
        assert modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb
    finally:
        restored = unpatch_model(model)
    assert restored == 1 and modeling_llama.apply_rotary_pos_emb is original, "patching twice lost the original"
    assert unpatch_model("llama") == 0, "a second restore has nothing to do"
    record("patch twice, restore once: HF's original function is back", 0.0, 0.0, True)


def test_patched_tiny_llama_under_torch_compile():
    """A tiny LLaMA with rmsnorm, swiglu and rope patched: torch.compile(model, fullgraph=True) puts
    every kernel call in one graph and gives eager's loss and gradients. Inductor compiles everything
    around the opaque kernels (attention, matmuls, the loss), fusing and reordering those fp32 ops,
    so results are close, not bit-identical."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _tiny_llama()
    try:
        for kernel in (rmsnorm_kernel, swiglu_kernel, rope_kernel):
            assert kernel.patch_model(model) == kernel.expected_patches(model.config)
        g = torch.Generator().manual_seed(16)
        ids = torch.randint(0, 512, (2, 12), generator=g).to(DEVICE)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")  # Inductor, keeping the graphs Dynamo captured
        results = []
        for run in (model, torch.compile(model, backend=counter, fullgraph=True)):
            model.zero_grad(set_to_none=True)
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    finally:
        unpatch_model(model)
    calls = [str(node.target) for graph in counter.graphs for node in graph.graph.nodes]
    for op, expected in (("rmsnorm_fwd", 5), ("swiglu_down_fwd", 2), ("rope_fwd", 2)):  # 2 layers
        assert calls.count(f"playbook.{op}.default") == expected, f"{op} must run {expected}x in the compiled graph"
    (loss_e, grads_e), (loss_c, grads_c) = results
    # fp32 throughout; Inductor's fused and reordered reductions change each result by a few ulps
    # (2^-23 relative), which two layers and the loss carry to ~1e-6 relative. 1e-4 of the largest
    # value leaves a 100x margin and still fails any real error (a missing or misrouted gradient
    # is as large as the gradient itself).
    rel = 1e-4
    err = (loss_c - loss_e).abs().item()
    record("compiled vs eager: loss", err, rel * loss_e.abs().item(), err <= rel * loss_e.abs().item())
    worst, worst_err, worst_tol = "", 0.0, 0.0
    for name, ge in grads_e.items():
        e, tol = (grads_c[name] - ge).abs().max().item(), rel * ge.abs().max().item()
        assert e <= tol, f"{name}: compiled gradient differs by {e:.3e} > {tol:.3e}"
        if e / tol >= (worst_err / worst_tol if worst_tol else 0.0):
            worst, worst_err, worst_tol = name, e, tol
    record(f"compiled vs eager: {len(grads_e)} gradients, worst {worst}", worst_err, worst_tol, True)


def test_ideal_bytes_is_the_hand_count():
    """LLaMA 3.1 8B (32 query heads, 8 KV heads, head_dim 128) at 8192 tokens, bf16: the hand count behind the
    module docstring's figures (that the docstring states what ideal_bytes gives is tests/lesson_contract_test.py's)."""
    n, e = 8192, 2
    forward = ideal_bytes(n, 32, 8, 128, torch.bfloat16)
    both = ideal_bytes(n, 32, 8, 128, torch.bfloat16, backward=True)
    # per token: Q and K heads read and written, plus one cos and one sin row read
    assert forward == n * ((32 + 8) * 128 * 2 + 2 * 128) * e
    assert both == 2 * forward  # backward: the same traffic for the gradients
    record(f"ideal bytes at 8192 tokens bf16: fwd {forward / 1e6:.1f} MB, fwd+bwd {both / 1e6:.1f} MB",
           0.0, 0.0, True)


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda q, k, c: (q, k, c[..., :8], c[..., :8]), ValueError, id="cos of another head_dim"),
        pytest.param(lambda q, k, c: (q[..., :15], k[..., :15], c[..., :15], c[..., :15]), ValueError, id="odd head_dim"),
        pytest.param(lambda q, k, c: (q, k[:, :, :3], c, c), ValueError, id="q and k of different lengths"),
        pytest.param(lambda q, k, c: (q, k.double(), c, c), TypeError, id="q and k of different dtypes"),
        pytest.param(lambda q, k, c: (q[0], k[0], c, c), ValueError, id="3-D q"),
        pytest.param(lambda q, k, c: (q.long(), k.long(), c, c), TypeError, id="integer q"),
    ],
)
def test_bad_input_gives_clear_error(make, error):
    cos, _ = _angles(2, torch.arange(4).unsqueeze(0), 16, torch.float32)
    q, k = _qk(2, 2, 1, 4, 16, torch.float32)
    expect_error(error, rope, *make(q, k, cos))


def test_learned_angles_are_refused():
    cos, sin = _angles(1, torch.arange(4).unsqueeze(0), 16, torch.float32)
    q, k = _qk(1, 2, 1, 4, 16, torch.float32)
    expect_error(NotImplementedError, rope, q, k, cos.clone().requires_grad_(), sin)


# ---------------------------------------------------------------------------- GPU-only, full size
@pytest.mark.skipif(not ON_GPU, reason="LLaMA-size attention inputs need a GPU (the interpreter is slow)")
def test_llama_31_8b_shapes():
    """4 x 2048 tokens, 32 query heads, 8 KV heads, head_dim 128, bf16, positions 0..2047."""
    positions = torch.arange(2048).unsqueeze(0)
    cos, sin = _angles(4, positions, 128, torch.bfloat16)
    q, k = _qk(4, 32, 8, 2048, 128, torch.bfloat16, seed=7)
    _check("LLaMA 3.1 8B, 4 x 2048", q, k, cos, sin)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fused RoPE: test report"))
