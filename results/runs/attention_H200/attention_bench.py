"""Per-document attention on packed rows, forward + backward, on one GPU: which kernel to use.

    python results/runs/attention_H200/attention_bench.py

Rows of T tokens hold documents of random length (a fixed seed); the tail of a row that no document
fills is a segment of its own. Compared, each as forward + backward in bf16:
  causal     SDPA is_causal on the whole row (no document boundaries: the synthetic batch's cost)
  dense      SDPA with a [B, 1, T, T] boolean mask (the packed rows' attention before)
  varlen     torch.nn.attention.varlen.varlen_attn with the exact cu_seqlens
  varlen_fix the same with cu_seqlens padded to a fixed length (zero-length documents at the end), as a
             captured step needs; also run inside a CUDA graph
  flex       FlexAttention (torch.compile'd) with a document block mask
Each is checked against per-document SDPA in float32.
"""
import inspect
import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = "cuda"
from torch.nn.attention import varlen as V

SIG = inspect.signature(V.varlen_attn).parameters
print("torch", torch.__version__, "varlen_attn params:", list(SIG))


def varlen(q, k, v, cu, T):
    kw = {}
    if "is_causal" in SIG:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in SIG:
            kw["enable_gqa"] = True
        else:
            r = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    return V.varlen_attn(q, k, v, cu, cu, T, T, **kw)


def docs(B, T, lo, hi, g):
    segs, cu = [], [0]
    for b in range(B):
        s, at, i = torch.empty(T, dtype=torch.long), 0, 0
        while at < T:
            n = int(torch.randint(lo, hi, (1,), generator=g))
            n = min(n, T - at)
            s[at:at + n] = i
            at += n
            i += 1
            cu.append(b * T + at)
        segs.append(s)
    return torch.stack(segs), torch.tensor(cu, dtype=torch.int32)


def timeit(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def case(name, B, T, Hq, Hkv, D, lo, hi):
    g = torch.Generator().manual_seed(1)
    seg, cu = docs(B, T, lo, hi, g)
    seg, cu = seg.to(dev), cu.to(dev)
    ndoc = cu.numel() - 1
    q = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16)
    # reference: per document, float32
    ref = torch.empty(B, Hq, T, D, device=dev)
    r = Hq // Hkv
    for i in range(ndoc):
        a, e = int(cu[i]), int(cu[i + 1])
        b, s0, s1 = a // T, a % T, (e - 1) % T + 1
        ref[b, :, s0:s1] = F.scaled_dot_product_attention(
            q[b, :, s0:s1].float(), k[b, :, s0:s1].float().repeat_interleave(r, 0),
            v[b, :, s0:s1].float().repeat_interleave(r, 0), is_causal=True)

    def causal():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(go)
        return o

    mask = ((seg[:, :, None] == seg[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=dev).tril())[:, None]

    def dense():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        o.backward(go)
        return o

    def flat(x):
        return x.transpose(1, 2).reshape(B * T, x.shape[1], D)

    def vl(cu_, fix=False):
        o = varlen(flat(q), flat(k), flat(v), cu_, T)
        o = o.view(B, T, Hq, D).transpose(1, 2)
        o.backward(go)
        return o

    n_fixed = B * (T // lo + 2) + 1
    cu_fix = torch.full((n_fixed,), B * T, dtype=torch.int32, device=dev)
    cu_fix[: cu.numel()] = cu
    rows = {}
    for nm, fn in [("causal", causal), ("dense", dense), ("varlen", lambda: vl(cu)), ("varlen_fix", lambda: vl(cu_fix))]:
        try:
            o = fn()
            err = (o.float() - ref).abs().max().item() if nm != "causal" else float("nan")
            q.grad = k.grad = v.grad = None
            ms = timeit(fn)
            rows[nm] = (ms, err)
        except Exception as e:  # noqa: BLE001
            rows[nm] = (float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
    # varlen_fix in a CUDA graph (fwd + bwd)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                q.grad = k.grad = v.grad = None
                vl(cu_fix)
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        q.grad = k.grad = v.grad = None
        with torch.cuda.graph(gr):
            og = vl(cu_fix)
        gr.replay()
        torch.cuda.synchronize()
        err = (og.float() - ref).abs().max().item()
        ms = timeit(gr.replay)
        rows["varlen_fix_graph"] = (ms, err)
    except Exception as e:  # noqa: BLE001
        rows["varlen_fix_graph"] = (float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        fa = torch.compile(flex_attention, dynamic=False)

        def mm(b, h, qi, ki):
            return (seg[b, qi] == seg[b, ki]) & (qi >= ki)
        t0 = time.perf_counter()
        bm = create_block_mask(mm, B, None, T, T, device=dev)
        torch.cuda.synchronize()
        bm_ms = (time.perf_counter() - t0) * 1e3

        def flex():
            o = fa(q, k, v, block_mask=bm, enable_gqa=True)
            o.backward(go)
            return o
        o = flex()
        err = (o.float() - ref).abs().max().item()
        q.grad = k.grad = v.grad = None
        rows["flex"] = (timeit(flex), err)
        bm_ms2 = timeit(lambda: create_block_mask(mm, B, None, T, T, device=dev), n=5)
        rows["flex_block_mask_build"] = (bm_ms2, f"first {bm_ms:.0f} ms")
    except Exception as e:  # noqa: BLE001
        rows["flex"] = (float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
    print(f"\n{name}: B={B} T={T} Hq={Hq} Hkv={Hkv} D={D}, {ndoc} segments (lengths {lo}-{hi}), fixed cu length {n_fixed}")
    for nm, (ms, err) in rows.items():
        print(f"  {nm:22s} {ms:8.3f} ms fwd+bwd   max |err| vs fp32 per-document: {err}")


case("llama-3.1-8b attention", 4, 2048, 32, 8, 128, 40, 1200)
case("llama-3.1-8b attention, short docs", 4, 2048, 32, 8, 128, 20, 300)
case("smollm2-135m attention", 8, 512, 9, 3, 64, 20, 400)
case("long row", 1, 32768, 32, 8, 128, 200, 6000)
