"""Cross-entropy with the head of each row kept in registers between the two sweeps (sweep 2 reads it
from the chip instead of from L2/DRAM). Plain CE, mean reduction, gradient in place. Variants timed
against the shipped kernel in one run; each checked against it first."""
import os, sys, time
sys.path.insert(0, ".")
import torch, triton, triton.language as tl
import triton.testing
import cross_entropy_kernel as ck

LOG2E = tl.constexpr(1.4426950408889634)
MIN_START = tl.constexpr(-1.0e38)


@triton.jit
def _ce_head(Logits, Grad, Targets, Loss, NValid, stride_l, stride_g, V, ignore_index,
             BLOCK_V: tl.constexpr, HEAD: tl.constexpr, HEAD_FP32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lrow = Logits + row * stride_l
    grow = Grad + row * stride_g
    cols0 = tl.arange(0, BLOCK_V)
    target = tl.load(Targets + row).to(tl.int64)
    n_rest = tl.cdiv(V - HEAD, BLOCK_V)
    if target == ignore_index:
        tl.store(Loss + row, 0.0)
        if HEAD > 0:
            hc = tl.arange(0, HEAD)
            tl.store(grow + hc, tl.zeros([HEAD], tl.float32).to(Grad.dtype.element_ty), mask=hc < V)
        for b in range(0, n_rest):
            cols = HEAD + b * BLOCK_V + cols0
            tl.store(grow + cols, tl.zeros([BLOCK_V], tl.float32).to(Grad.dtype.element_ty), mask=cols < V)
    else:
        if HEAD > 0:
            hc = tl.arange(0, HEAD)
            xh = tl.load(lrow + hc, mask=hc < V, other=-float("inf"))
            if HEAD_FP32:
                xh = xh.to(tl.float32)
        m_lane = tl.full([BLOCK_V], MIN_START, tl.float32)
        s_lane = tl.zeros([BLOCK_V], tl.float32)
        x_next = tl.load(lrow + HEAD + cols0, mask=HEAD + cols0 < V, other=-float("inf"))
        for b in range(0, n_rest):
            x = x_next.to(tl.float32)
            cols = HEAD + (b + 1) * BLOCK_V + cols0
            x_next = tl.load(lrow + cols, mask=cols < V, other=-float("inf"))
            e = tl.exp2(tl.abs(x - m_lane) * -LOG2E)
            s_lane = tl.where(x > m_lane, s_lane * e + 1.0, s_lane + e)
            m_lane = tl.maximum(m_lane, x)
        m = tl.max(m_lane, axis=0)
        if HEAD > 0:
            xhf = xh.to(tl.float32)
            m = tl.maximum(m, tl.max(xhf, axis=0))
        s = tl.sum(s_lane * tl.exp2((m_lane - m) * LOG2E), axis=0)
        if HEAD > 0:
            s += tl.sum(tl.exp2((xhf - m) * LOG2E), axis=0)
        log2_s = tl.log2(s)
        in_range = (target >= 0) & (target < V)
        x_target = tl.load(lrow + target, mask=in_range, other=float("nan")).to(tl.float32)
        tl.store(Loss + row, (m - x_target) + log2_s / LOG2E)
        n_valid = tl.load(NValid).to(tl.float32)
        scale = 1.0 / tl.maximum(n_valid, 1.0)
        scale = tl.where(in_range, scale, float("nan"))
        cols = HEAD + (n_rest - 1) * BLOCK_V + cols0
        x_next = tl.load(lrow + cols, mask=cols < V, other=-float("inf"))
        for i in range(0, n_rest):
            x = x_next.to(tl.float32)
            mask = cols < V
            cols_next = cols - BLOCK_V
            x_next = tl.load(lrow + cols_next, mask=(cols_next >= HEAD) & (cols_next < V), other=-float("inf"))
            g = tl.exp2((x - m) * LOG2E - log2_s) * scale
            tl.store(grow + cols, g.to(Grad.dtype.element_ty), mask=mask, eviction_policy="evict_first")
            cols = cols_next
        if HEAD > 0:
            gh = tl.exp2((xh.to(tl.float32) - m) * LOG2E - log2_s) * scale
            tl.store(grow + hc, gh.to(Grad.dtype.element_ty), mask=hc < V)
        tl.debug_barrier()
        p_target = tl.exp2((x_target - m) * LOG2E - log2_s)
        tl.store(grow + target, ((p_target - 1.0) * scale).to(Grad.dtype.element_ty), mask=in_range)


def run_head(logits, targets, n_valid, block_v, head, warps, fp32):
    N, V = logits.shape
    loss = torch.empty(N, device=logits.device, dtype=torch.float32)
    _ce_head[(N,)](logits, logits, targets, loss, n_valid, logits.stride(0), logits.stride(0), V, -100,
                   BLOCK_V=block_v, HEAD=head, HEAD_FP32=fp32, num_warps=warps)
    return loss


def run_shipped(logits, targets, n_valid):
    rows = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    ck.cross_entropy_forward(logits, targets, -100, "mean", True, True, n_valid=n_valid, loss_rows=rows)
    return rows


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    N, V = (16384, 128256) if dev == "cuda" else (6, 1000)
    variants = ([(16384, 0, 32, False), (8192, 16384, 32, False), (8192, 32768, 32, False), (16384, 16384, 32, False),
                 (16384, 32768, 32, False), (8192, 65536, 32, False), (8192, 16384, 32, True), (16384, 8192, 32, False),
                 (4096, 32768, 32, False), (8192, 32768, 16, False)]
                if dev == "cuda" else [(128, 0, 4, False), (128, 256, 4, False), (64, 512, 4, True)])
    g = torch.Generator(device="cpu").manual_seed(0)
    base = (torch.randn(N, V, generator=g) * 3).to(device=dev, dtype=torch.bfloat16)
    t = torch.randint(0, V, (N,), generator=g).to(dev)
    t[::97] = -100
    n_valid = (t != -100).sum()
    # reference: the shipped kernel, in place on a copy
    ref = base.clone(); ref_loss = run_shipped(ref, t, n_valid)
    print(torch.cuda.get_device_name() if dev == "cuda" else "cpu", triton.__version__, flush=True)
    floor_bytes = 2 * N * V * 2
    for bv, head, w, f32 in variants:
        x = base.clone()
        try:
            loss = run_head(x, t, n_valid, bv, head, w, f32)
        except Exception as e:  # noqa
            print(f"BLOCK_V {bv} HEAD {head} warps {w} fp32 {f32}: failed: {str(e)[:200]}", flush=True); continue
        dl = (loss - ref_loss).abs().max().item()
        dg = (x.float() - ref.float()).abs().max().item()
        ulp = ref.float().abs().max().item() * 2 ** -8
        if dev == "cuda":
            y = base.clone()
            ms = triton.testing.do_bench(lambda: run_head(y, t, n_valid, bv, head, w, f32), warmup=25, rep=200)
            extra = f"{ms*1e3:8.1f} us  {floor_bytes / (ms*1e-3) / 1e9:6.0f} GB/s"
        else:
            extra = ""
        print(f"BLOCK_V {bv:5d} HEAD {head:5d} warps {w:2d} head fp32 {f32!s:5}: {extra}  max |loss - shipped| {dl:.2e}, max |grad - shipped| {dg:.2e} (grad max {ref.float().abs().max().item():.2e})", flush=True)
    if dev == "cuda":
        y = base.clone()
        ms = triton.testing.do_bench(lambda: run_shipped(y, t, n_valid), warmup=25, rep=200)
        print(f"shipped kernel (BLOCK_V {ck.BLOCK_V}, {ck.NUM_WARPS} warps): {ms*1e3:8.1f} us  {floor_bytes / (ms*1e-3) / 1e9:6.0f} GB/s", flush=True)
        src = torch.empty(N * V * 2 // 2, dtype=torch.bfloat16, device=dev); dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
        print(f"copy of the logits' size: {ms*1e3:.1f} us, {2 * src.numel() * 2 / (ms*1e-3) / 1e9:.0f} GB/s (floor of ce = {floor_bytes / (2 * src.numel() * 2 / (ms*1e-3)) * 1e6:.1f} us)", flush=True)


main()
