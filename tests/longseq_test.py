"""Long sequences stay correct: RoPE past 128k positions, packed rows, the chunked loss over many rows.

    $ PYTHONPATH=. python tests/longseq_test.py   # a readable report
    $ pytest tests/longseq_test.py

On a CPU (Triton's interpreter) the shapes are small and the positions are real:
- RoPE at positions 131,000-131,100 and 262,000-262,100 with LLaMA 3.1 8B's rotary embedding
  (rope_type llama3, factor 8, theta 500,000; the `llama-3.1-8b` preset's config): the fused RoPE,
  as the registry patches it into the model, against Hugging Face's apply_rotary_pos_emb, forward
  and gradient, in fp32 and bf16. How precise Hugging Face's own fp32 angles are at such positions
  is measured first; off-by-one positions and unscaled angles must fail the same check.
- A packed row of 2048 tokens (playbook/data/dataset.py, `--packing`) through a tiny LLaMA with the default
  kernels: each example's logits equal those of the example run alone, the row's loss is the
  token-weighted mean of the examples' losses, and positions restart at every example.
- The fused linear cross-entropy in chunks (eight full chunks and a partial one, a chunk with every
  label ignored) against the unchunked PyTorch loss: loss, dx and dW.

What a packed row costs at long lengths: the mask is [B, 1, T, T] bool, B x T x T bytes: 16 MiB
at 4 x 2048, 17.2 GB for one row of 131,072 tokens, and building it (dataset.packed_attention_mask)
holds a T x T causal mask and a B x T x T comparison beside it, about 3x that at its peak. So at
very long rows, train with batch rows of one example that fill the row (no --packing: an unpadded
row needs no mask tensor, attention runs its causal path; a padded row gets the same [B, 1, T, T]
mask from Hugging Face, test_mask_memory_at_long_rows checks both) or a shorter --seq-len.

With a CUDA GPU three more tests run at the real length: RoPE over 131,072 positions, the fused
linear cross-entropy over 131,072 rows of LLaMA 3.1 8B's head (vocabulary 128,256, hidden 4096)
against an fp32 reference computed in chunks, and a 2-layer model (hidden 256), forward and backward
on one 131,072-token sequence, with the default kernels and without.
"""

import copy
import json
import tempfile
from pathlib import Path

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import pytest
import torch

from playbook.data import dataset
from playbook.model import registry, tokenizer
from core.kernel_utils import DEVICE
from playbook.model.presets import PRESETS
from testkit import (FACTOR, ULP, close_to_reference, exactly, random_like_grad, record, run_as_script,
                              tiny_model)
import linear_cross_entropy_kernel
import rope_kernel

ON_GPU = DEVICE.type == "cuda"
LLAMA_8B = PRESETS["llama-3.1-8b"]
LONG = 131072  # LLaMA 3.1's context: max_position_embeddings of the 8B preset
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (131,072-token runs)")


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _rotary(scaling: bool = True):
    """transformers' LlamaRotaryEmbedding with the 8B preset's config (or without its rope scaling)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    options = dict(LLAMA_8B, rope_scaling=LLAMA_8B["rope_scaling"] if scaling else None)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**options)).to(DEVICE)
    assert rotary.rope_type == ("llama3" if scaling else "default"), rotary.rope_type
    return rotary


def _tables(rotary, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin [B, T, head_dim] exactly as the model builds them (fp32 angles, cast to `dtype`)."""
    probe = torch.empty(1, dtype=dtype, device=DEVICE)
    return rotary(probe, positions.to(DEVICE))


def _true_tables(rotary, positions: torch.Tensor):
    """cos/sin in float64 from the same inverse frequencies: the angle p * inv_freq without fp32 rounding."""
    angles = positions.to(DEVICE).double()[..., None] * rotary.inv_freq.double()
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling


def _patched_rope(kernels: str = "rope"):
    """Hugging Face's apply_rotary_pos_emb, and the function the registry puts in its place.

    The patch is process-global (the LLaMA module's function); conftest.py restores it after each test."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    report = registry.apply_kernels(tiny_model("llama"), kernels)
    assert report.replaced.get("rope") == 1, report.describe()
    assert modeling_llama.apply_rotary_pos_emb is rope_kernel.apply_rotary_pos_emb
    return original, modeling_llama.apply_rotary_pos_emb


def _qk(batch, seq, dtype, seed=0, hq=LLAMA_8B["num_attention_heads"], hk=LLAMA_8B["num_key_value_heads"],
        head_dim=LLAMA_8B["head_dim"]):
    """q, k as the attention layer hands them over: [B, heads, T, D] views of [B, T, heads, D] projections."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, seq, hq, head_dim, generator=g, device=DEVICE).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, hk, head_dim, generator=g, device=DEVICE).to(dtype).transpose(1, 2)
    return q, k


def _forward_backward(fn, q, k, cos, sin, dq, dk):
    """(q_embed, k_embed, dq, dk) of fn(q, k, cos, sin) for upstream gradients dq, dk."""
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qo, ko = fn(q, k, cos, sin)
    torch.autograd.backward([qo, ko], [dq, dk])
    return qo.detach(), ko.detach(), q.grad, k.grad


def _close_on_device(name, ours, torch_impl, ref, dtype, n=1, factor=FACTOR):
    """testkit's rule (max|ours - ref| <= factor * max|torch - ref| + ulp(dtype) * scale + 2^-23 * sqrt(n) * scale)
    on the GPU, for tensors of gigabytes. `ref` is fp32 computed from the same inputs: its own error
    (~2^-24 relative) is far below bf16's rounding (2^-9), so it stands in for float64 here."""
    ref = ref.float()
    err = (ours.float() - ref).abs().max().item()  # .item(): a sync point, once per check
    torch_err = (torch_impl.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    tol = factor * torch_err + ULP[dtype] * scale + 2.0**-23 * n**0.5 * scale
    record(name, err, tol, passed=err <= tol)


def _no_worse_than_hf(name, ours, hf, exact, dtype, n=1):
    """max|ours - exact| may exceed Hugging Face's own max|hf - exact| by one ulp of `dtype` and the
    rounding of an fp32 sum of n terms, of the output's scale (the two compute in different orders)."""
    exact = exact.double()
    err = (ours.double() - exact).abs().max().item()
    hf_err = (hf.double() - exact).abs().max().item()
    tol = (ULP[dtype] + 2.0**-23 * n**0.5) * exact.abs().max().item()
    record(f"{name}: ours {err:.2e} - HF's {hf_err:.2e}", max(err - hf_err, 0.0), tol, passed=err - hf_err <= tol)


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """One CPU thread: these ops are too small to split, and on a busy machine two threads spin-waiting
    on each other make a step several times slower (tests/data_test.py measured ~10x)."""
    before = torch.get_num_threads()
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _free_gb() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / 1e9


# ------------------------------------------------------------------------------------------------
# 1. RoPE at positions past 131,072
# ------------------------------------------------------------------------------------------------
def test_fp32_angles_lose_precision_linearly_with_position():
    """How exact Hugging Face's cos/sin tables are at large positions (fp32 angles vs float64).

    The angle p * inv_freq is one fp32 product, off by up to half an ulp: at most p * max(inv_freq) * 2^-24
    (inv_freq[0] = 1 rad per position); cos/sin add about one fp32 ulp. So the tables' error grows
    linearly with the position: 2^-8 = 0.0039 for positions 65,536-131,071 and 2^-7 above, where
    bf16's own rounding of a cos/sin value near 1 is at most 2^-9. From 65,536 positions on, the
    fp32 angles, not the bf16 tables, limit RoPE's precision. Meta's reference code computes the
    angles in fp32 too, so matching Hugging Face at the same dtype is the goal (next test).
    A power of two times inv_freq is exact, so each check takes the 255 positions below one."""
    rotary = _rotary()
    inv_max = rotary.inv_freq.max().item()
    first_past_bf16 = None
    for p in [2**k for k in range(10, 21)] + [262144 + 2**17]:
        positions = torch.arange(p - 255, p)[None]
        cos, sin = _tables(rotary, positions, torch.float32)
        cos64, sin64 = _true_tables(rotary, positions)
        err = max((cos.double() - cos64).abs().max().item(), (sin.double() - sin64).abs().max().item())
        bound = p * inv_max * 2.0**-24 + 2.0**-23
        record(f"fp32 tables, 255 positions below {p:>9,}: error <= p * 2^-24", err, bound, passed=err <= bound)
        if first_past_bf16 is None and err > 2.0**-9:
            first_past_bf16 = p
    assert first_past_bf16 is not None and first_past_bf16 <= LONG, first_past_bf16
    record(f"fp32 tables' error first > 2^-9 below position {first_past_bf16:,}", 0.0, 0.0, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_past_128k_positions_matches_hugging_face(dtype):
    """Two sequences of 101 positions, 131,000-131,100 (across 131,072) and 262,000-262,100, 8B shapes
    (32 query heads, 8 key heads, head_dim 128), with the tables the model builds in `dtype`.

    Two checks per output (q_embed, k_embed, dq, dk):
    - against the exact rotation by the same tables (float64): the testkit rule, at most 2x as far
      as Hugging Face's formula in `dtype` (each value combines 2 products: n = 2);
    - against the exact rotation by the exact angles: no further than Hugging Face is, give or take
      one ulp of `dtype` (the excess over HF's error is what is recorded). At these positions both
      carry the fp32 tables' error (up to 2^-7 of each value, test above; ~3e-2 here), so a fixed
      tolerance would have to be ~1e-1; comparing with Hugging Face's own error is what can fail.
    Controls: tables one position off (each token rotated by its neighbour's angle) and tables
    without LLaMA 3.1's scaling must fail the second check by far."""
    hf_rope, our_rope = _patched_rope()
    rotary = _rotary()
    T = 101
    positions = torch.stack([torch.arange(T) + 131000, torch.arange(T) + 262000])
    cos, sin = _tables(rotary, positions, dtype)
    cos64, sin64 = _true_tables(rotary, positions)
    q, k = _qk(2, T, dtype)
    dq, dk = random_like_grad(q, 1), random_like_grad(k, 2)
    ours = _forward_backward(our_rope, q, k, cos, sin, dq, dk)
    hf = _forward_backward(hf_rope, q, k, cos, sin, dq, dk)
    q64, k64, dq64, dk64 = q.double(), k.double(), dq.double(), dk.double()
    same_tables = _forward_backward(rope_kernel.rope_ref, q64, k64, cos.double(), sin.double(), dq64, dk64)
    exact = _forward_backward(rope_kernel.rope_ref, q64, k64, cos64, sin64, dq64, dk64)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    for i, what in enumerate(("q_embed", "k_embed", "dq", "dk")):
        close_to_reference(f"{name} {what}: same tables", ours[i], hf[i], same_tables[i], dtype, n=2)
        _no_worse_than_hf(f"{name} {what}: exact angles", ours[i], hf[i], exact[i], dtype, n=2)
    if dtype != torch.float32:
        return
    tol = (hf[0].double() - exact[0]).abs().max().item() + ULP[dtype] * exact[0].abs().max().item()
    for what, (c, s) in (("positions + 1", _tables(rotary, positions + 1, dtype)),
                         ("no llama3 scaling", _tables(_rotary(scaling=False), positions, dtype))):
        err = (our_rope(q, k, c, s)[0].double() - exact[0]).abs().max().item()
        record(f"control, {what}: q_embed error > 10x tol", err, 10 * tol, passed=err > 10 * tol)


# ------------------------------------------------------------------------------------------------
# 2. Packed rows
# ------------------------------------------------------------------------------------------------
PACKED_LEN = 2048  # the longest row the CPU affords here: the interpreter runs each kernel per row
EXAMPLE_CHARS = (701, 523, 389, 211, 97, 19)  # + BOS and EOS: 1,952 tokens in one row, 96 of padding


def _packed_row():
    """One --packing row of PACKED_LEN tokens from text rows, through make_data and the byte tokenizer."""
    g = torch.Generator().manual_seed(7)
    letters = "abcdefghijklmnopqrstuvwxyz     ,.ABCDEFGH"
    texts = ["".join(letters[i] for i in torch.randint(0, len(letters), (n,), generator=g).tolist())
             for n in EXAMPLE_CHARS]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        d = dataset.make_data(str(path), "dataset", tokenizer.byte_tokenizer(), vocab_size=512, batch_size=1,
                           seq_len=PACKED_LEN, seed=0, packing=True)
    assert d.rows["input_ids"].shape[0] == 1, "all examples fit in one row"
    return d.batch(0, DEVICE), d.rows["segments"][0]


def _logits(model, **inputs):
    with torch.no_grad():
        return model(**inputs).logits[0]


def test_packed_examples_match_the_examples_alone():
    """A row of six examples (21 to 703 tokens) and padding, with the default kernels:
    - position ids restart at 0 at every example (exactly), and the mask is [1, 1, T, T] bool;
    - each example's logits in the row equal its logits alone (testkit rule: the fp32 model alone
      is the PyTorch result, a float64 copy the reference; n = T, the longest sum behind a logit is
      attention's over at most T keys);
    - the row's loss (the fused linear cross-entropy) is the token-weighted mean of the examples'
      losses alone: each example's first label is -100, so no token predicts across a boundary;
    - control: the same row with one causal mask over all of it (no boundaries) changes a later
      example's logits by far more than the tolerance."""
    batch, segments = _packed_row()
    ids, labels, positions, mask = (batch[k] for k in ("input_ids", "labels", "position_ids", "attention_mask"))
    T = PACKED_LEN
    assert mask.shape == (1, 1, T, T) and mask.dtype == torch.bool
    spans = [((segments == s).nonzero().min().item(), (segments == s).nonzero().max().item() + 1)
             for s in range(int(segments.max()) + 1)]
    assert sorted(e - s for s, e in spans) == sorted(n + 2 for n in EXAMPLE_CHARS)
    for s, e in spans:
        exactly(f"positions restart: example at {s:>4}, {e - s:>3} tokens", positions[0, s:e].cpu(),
                torch.arange(e - s))

    # Hugging Face first (the RoPE patch is process-global), one example at a time, fp32 and float64.
    base = tiny_model("llama", vocab_size=512)
    base.config._attn_implementation = "sdpa"  # as the training scripts load models; eager would add the bool mask
    base64 = copy.deepcopy(base).double()
    alone = []
    for s, e in spans:
        one = {"input_ids": ids[:, s:e], "labels": labels[:, s:e]}
        with torch.no_grad():
            out32, out64 = base(**one), base64(**one)
        alone.append((out32.logits[0], out64.logits[0], out32.loss, out64.loss, (labels[0, s + 1:e] != -100).sum()))

    ours = copy.deepcopy(base)
    report = registry.apply_kernels(ours)  # the default set
    record(f"default kernels: {report.describe()}", 0.0, 0.0, True)
    packed = _logits(ours, input_ids=ids, position_ids=positions, attention_mask=mask)
    for (s, e), (l32, l64, _, _, _) in zip(spans, alone):
        close_to_reference(f"logits packed == alone: {e - s:>3} tokens at {s:>4}", packed[s:e], l32, l64,
                           torch.float32, n=T)

    with torch.no_grad():
        loss = ours(input_ids=ids, labels=labels, position_ids=positions, attention_mask=mask).loss
    count = sum(a[4] for a in alone)
    loss32 = sum(a[2] * a[4] for a in alone) / count
    loss64 = sum(a[3] * a[4] for a in alone) / count
    close_to_reference(f"row loss == weighted mean of {len(spans)} examples' losses", loss, loss32, loss64,
                       torch.float32, n=T * 512)

    one_mask = dataset.packed_attention_mask(torch.zeros_like(segments)[None].to(DEVICE))  # causal over the row
    leaky = _logits(ours, input_ids=ids, position_ids=positions, attention_mask=one_mask)
    s, e = spans[-1]
    leak = (leaky[s:e] - alone[-1][0]).abs().max().item()
    record(f"control, no example boundaries: last example moves {leak:.1e} > 1e-2", leak, 1e-2, passed=leak > 1e-2)


def test_mask_memory_at_long_rows():
    """The packed mask is B x T x T bytes; at 131,072 tokens that is computed here, not run.

    Also what the note in the docstring rests on: an unpadded row reaches attention with no mask tensor
    (Hugging Face's causal path), a padded row with a [B, 1, T, T] one, as a packed row does."""
    T = 64
    segments = torch.tensor([[0] * 20 + [1] * 30 + [-1] * 14])
    mask = dataset.packed_attention_mask(segments)
    assert mask.dtype == torch.bool and mask.nbytes == 1 * T * T
    per_row = LONG * LONG * mask.element_size()
    record(f"packed mask, 1 x {LONG:,}: {per_row / 1e9:.1f} GB ({per_row / 2**30:.0f} GiB), "
           f"~{3 * per_row / 1e9:.0f} GB while built", 0.0, 0.0, True)
    assert per_row == 17_179_869_184

    model = tiny_model("llama", vocab_size=512)
    model.config._attn_implementation = "sdpa"
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    ids = torch.randint(0, 512, (2, T), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    padded = torch.ones(2, T, dtype=torch.long, device=DEVICE)
    padded[1, 50:] = 0
    for what, mask_2d in (("unpadded", torch.ones_like(padded)), ("padded", padded)):
        seen.clear()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask_2d)
        got = seen[0]
        shape = None if got is None else tuple(got.shape)
        record(f"{what} rows: attention gets mask {shape}", 0.0, 0.0, True)
        assert (got is None) == (what == "unpadded"), (what, shape)
        if got is not None:
            assert shape == (2, 1, T, T), shape


# ------------------------------------------------------------------------------------------------
# 3. The chunked loss over many rows
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_matches_unchunked(dtype):
    """521 rows in chunks of 64: eight full chunks and a last one of 9 rows; about a quarter of the labels
    -100, spread over every chunk, the third chunk entirely ignored and the last one partly.

    Tolerances: the testkit rule against float64, PyTorch's unchunked loss in `dtype` (logits in
    `dtype`, upcast to fp32 for the loss, as Hugging Face does) as the comparison. n: the loss sums N x V
    terms, dx sums over V, dW over the N rows (across all chunks: its fp32 accumulator is what keeps it
    as exact as one matmul). The upstream gradient is 0.73, not 1. Control (fp32): a mean of each
    chunk's own mean (what a loop that normalised per chunk would give) misses the reference by far.
    On a CPU, Triton's interpreter converts fp32 to bf16 by truncation (core/kernel_utils.py), so
    the gradient the kernel writes into its bf16 logits buffer leans toward zero and bf16 dW comes
    closer to its tolerance there (~90%) than rounding to nearest puts it."""
    N, H, V, chunk = 521, 64, 509, 64
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype)
    w = (torch.randn(V, H, generator=g) * H**-0.5).to(DEVICE, dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < 0.25] = -100
    targets[2 * chunk: 3 * chunk] = -100
    targets[N - 3] = -100
    targets[[0, 1]] = torch.tensor([0, V - 1])
    targets = targets.to(DEVICE)
    assert N % chunk and N // chunk >= 8

    def run(fn, dt):
        xi, wi = x.to(dt).clone().requires_grad_(), w.to(dt).clone().requires_grad_()
        loss = fn(xi, wi, targets)
        (loss * 0.73).backward()
        return loss.detach(), xi.grad, wi.grad

    ours = run(lambda a, b, t: linear_cross_entropy_kernel.linear_cross_entropy(a, b, t, chunk=chunk), dtype)
    same = run(linear_cross_entropy_kernel.linear_cross_entropy_ref, dtype)
    ref = run(linear_cross_entropy_kernel.linear_cross_entropy_ref, torch.float64)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    for i, (what, n) in enumerate((("loss", N * V), ("dx", V), ("dW", N))):
        close_to_reference(f"{name} {what}, 9 chunks == unchunked", ours[i], same[i], ref[i], dtype, n=n)

    if dtype != torch.float32:
        return
    # The control, in fp32 where the loss tolerance is tight (the same rule as above).
    loss_tol = FACTOR * (same[0] - ref[0]).abs().item() + (ULP[dtype] + 2.0**-23 * (N * V) ** 0.5) * ref[0].abs().item()
    per_chunk = []
    for s in range(0, N, chunk):
        rows = targets[s: s + chunk]
        if (rows != -100).any():
            per_chunk.append(linear_cross_entropy_kernel.linear_cross_entropy_ref(x[s: s + chunk].double(),
                                                                                  w.double(), rows))
    off = (torch.stack(per_chunk).mean() - ref[0]).abs().item()
    record(f"control, mean of per-chunk means: off by {off:.1e} > 10x tol", off, 10 * loss_tol,
           passed=off > 10 * loss_tol)


# ------------------------------------------------------------------------------------------------
# GPU: the real length
# ------------------------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.big_gpu_memory
def test_gpu_rope_over_131072_positions():
    """One sequence of 131,072 tokens, 8B shapes, bf16: the patched RoPE against Hugging Face's formula,
    both against the fp32 rotation by the same tables (testkit rule, n = 2), forward and gradient.
    Memory: q 1.07 GB and k 0.27 GB in bf16; with outputs, gradients and the fp32 reference ~15 GB."""
    if _free_gb() < 20:
        pytest.skip(f"needs ~20 GB of free GPU memory, {_free_gb():.0f} GB free")
    hf_rope, our_rope = _patched_rope()
    positions = torch.arange(LONG)[None]
    cos, sin = _tables(_rotary(), positions, torch.bfloat16)
    q, k = _qk(1, LONG, torch.bfloat16, seed=11)
    dq, dk = random_like_grad(q, 3), random_like_grad(k, 4)
    ours = _forward_backward(our_rope, q, k, cos, sin, dq, dk)
    hf = _forward_backward(hf_rope, q, k, cos, sin, dq, dk)
    ref = _forward_backward(rope_kernel.rope_ref, q.float(), k.float(), cos.float(), sin.float(), dq.float(),
                            dk.float())
    for i, what in enumerate(("q_embed", "k_embed", "dq", "dk")):
        _close_on_device(f"131,072 positions, bf16 {what}", ours[i], hf[i], ref[i], torch.bfloat16, n=2)


def _flce_reference(x, w, targets, chunk):
    """The mean cross-entropy of x @ w.T and its gradients (upstream 1), in chunks of rows, twice:
    in fp32 (the reference) and as PyTorch computes it in bf16 (logits in bf16, upcast to fp32 for the
    loss, gradient cast back to bf16 for the matmuls; dW summed in fp32 over the chunks, as one cuBLAS
    matmul over all rows sums inside). Returns ((loss, dx, dW) fp32, (loss, dx, dW) bf16)."""
    N = x.shape[0]
    valid = targets != -100
    count = valid.sum().float()
    w32 = w.float()
    results = {}
    for kind in ("fp32", "bf16"):
        loss = torch.zeros((), device=x.device)
        dx = torch.empty(x.shape, device=x.device, dtype=torch.float32 if kind == "fp32" else x.dtype)
        dw = torch.zeros(w.shape, device=x.device)  # fp32 sum over the chunks
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            xc, tc, vc = x[s:e], targets[s:e].clamp(min=0), valid[s:e]
            rows = torch.arange(e - s, device=x.device)
            logits = xc.float() @ w32.t() if kind == "fp32" else (xc @ w.t()).float()
            loss += ((torch.logsumexp(logits, dim=-1) - logits[rows, tc]) * vc).sum()
            grad = torch.softmax(logits, dim=-1)
            del logits
            grad[rows, tc] -= 1.0
            grad *= (vc.float() / count)[:, None]
            if kind == "fp32":
                dx[s:e] = grad @ w32
                dw += grad.t() @ xc.float()
            else:
                grad = grad.to(x.dtype)
                dx[s:e] = grad @ w
                dw += grad.t().float() @ xc.float()  # bf16 values, exact in fp32; summed in fp32
            del grad
        results[kind] = (loss / count, dx, dw if kind == "fp32" else dw.to(x.dtype))
    return results["fp32"], results["bf16"]


@needs_gpu
@pytest.mark.big_gpu_memory
def test_gpu_linear_cross_entropy_over_131072_rows():
    """LLaMA 3.1 8B's head over one 131,072-token sequence, bf16: hidden 4096, vocabulary 128,256.

    The unchunked PyTorch loss would hold the logits, 131,072 x 128,256: 33.6 GB in bf16 and 67 GB
    in fp32, so the reference walks the rows in chunks of 4096 (_flce_reference). Memory, in GB:
    x 1.07 and W 1.05 (bf16); ours adds dx 1.07, dW 1.05, the fp32 accumulator 2.10 and its
    2048-row logits buffer 0.53; the reference adds W, dx, dW in fp32 (2.10 each), bf16 dx 1.07,
    its fp32 dW sum 2.10, and per chunk ~4 fp32 [4096, V] tensors (2.10 each): ~30 GB at most.
    Tolerance: the testkit rule against the fp32 reference, with PyTorch's bf16 computation as the
    comparison (n as in test_chunked_loss_matches_unchunked). About 3 of 4 labels are kept."""
    if _free_gb() < 36:
        pytest.skip(f"needs ~36 GB of free GPU memory, {_free_gb():.0f} GB free")
    N, H, V = LONG, LLAMA_8B["hidden_size"], LLAMA_8B["vocab_size"]
    g = torch.Generator(device=DEVICE).manual_seed(13)
    x = torch.randn(N, H, generator=g, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g, device=DEVICE) * H**-0.5).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), generator=g, device=DEVICE)
    targets[torch.rand(N, generator=g, device=DEVICE) < 0.25] = -100
    chunk = linear_cross_entropy_kernel.chunk_tokens(N, V, torch.bfloat16, accumulator_bytes=V * H * 4)
    record(f"default chunk: {chunk} rows, {-(-N // chunk)} chunks", 0.0, 0.0, chunk < N)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy_kernel.linear_cross_entropy(xi, wi, targets)
    loss.backward()
    ours = (loss.detach(), xi.grad, wi.grad)
    del xi, wi, loss
    ref, same = _flce_reference(x, w, targets, chunk=4096)
    for i, (what, n) in enumerate((("loss", N * V), ("dx", V), ("dW", N))):
        _close_on_device(f"{N:,} rows x vocab {V:,}: {what}", ours[i], same[i], ref[i], torch.bfloat16, n=n)


@needs_gpu
@pytest.mark.big_gpu_memory
def test_gpu_small_model_trains_on_131072_tokens():
    """A 2-layer LLaMA (hidden 256, 4 heads of 64, LLaMA 3.1's rope scaling) in bf16,
    forward and backward on one sequence of 131,072 tokens, with the default kernels and without.
    Reference: the same model in fp32 (SDPA has no float64 kernel that fits 131,072 tokens); testkit
    rule with the unpatched bf16 model as the comparison, n = tokens x width of the widest sum."""
    # As many key as query heads: the fp32 reference needs SDPA's memory-efficient kernel (flash and cuDNN
    # take no fp32), which takes no grouped-query heads; SDPA's math fallback would build the [T, T] scores
    # (256 GiB at 131,072 tokens).
    overrides = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                     num_key_value_heads=4, head_dim=64, max_position_embeddings=LONG,
                     rope_theta=LLAMA_8B["rope_theta"], rope_scaling=LLAMA_8B["rope_scaling"])
    g = torch.Generator().manual_seed(17)
    ids = torch.randint(0, 1024, (1, LONG), generator=g)
    labels = torch.where(torch.rand(1, LONG, generator=g) < 0.25, -100, ids)
    ids, labels = ids.to(DEVICE), labels.to(DEVICE)

    def step(model):
        model.config._attn_implementation = "sdpa"  # no mask: the causal kernels, memory linear in T
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}

    ref = step(tiny_model("llama", **overrides))  # unpatched first: the RoPE patch is process-global
    base = step(tiny_model("llama", **overrides).to(torch.bfloat16))
    model = tiny_model("llama", **overrides).to(torch.bfloat16)
    report = registry.apply_kernels(model)
    record(f"default kernels: {report.describe()}", 0.0, 0.0, True)
    ours = step(model)
    n = LONG * 1024
    _close_on_device("131,072 tokens: loss", ours[0], base[0], ref[0], torch.bfloat16, n=n)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.1.input_layernorm.weight", "model.norm.weight", "lm_head.weight"):
        _close_on_device(f"131,072 tokens: d {name}", ours[1][name], base[1][name], ref[1][name], torch.bfloat16,
                         n=n)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Long sequences: test report"))
