# Where the fused linear cross-entropy's time goes at the 8B step's shape: the three bare matmuls,
# the fp32 dW accumulation, and whole op at several chunk sizes (fwd+bwd, do_bench medians).
import sys, torch, triton
from linear_cross_entropy_kernel import linear_cross_entropy
torch.manual_seed(0)
H, V = 4096, 128256
dev = "cuda"
for N in [int(a) for a in sys.argv[1:]] or [8192]:
    x = (torch.randn(N, H, device=dev) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=dev) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), device=dev)
    def bench(f):
        return triton.testing.do_bench(f, warmup=5, rep=40, return_mode="median")
    buf = torch.empty(2048, V, device=dev, dtype=torch.bfloat16)
    acc = torch.empty(V, H, device=dev, dtype=torch.float32)
    xc = x.detach()[:2048]
    g = torch.randn(2048, V, device=dev).bfloat16()
    n = N // 2048
    fwd = bench(lambda: torch.mm(xc, w.detach().t(), out=buf)) * n
    dx = bench(lambda: torch.mm(g, w.detach())) * n
    dw16 = bench(lambda: torch.mm(g.t(), xc)) * n
    dw32 = bench(lambda: torch.ops.aten.addmm.dtype_out(acc, g.t(), xc, torch.float32, out=acc)) * n
    big = torch.randn(N, V, device=dev).bfloat16()
    dwfull = bench(lambda: torch.mm(big.t(), x.detach()))
    del big
    print(f"N={N}: per-chunk(2048) matmuls x{n}: fwd {fwd:.2f} ms, dx {dx:.2f} ms, dW bf16 out {dw16:.2f} ms, "
          f"dW fp32 addmm {dw32:.2f} ms; one dW matmul over all N: {dwfull:.2f} ms")
    for chunk in (1024, 2048, 4096, 8192):
        if chunk > N:
            continue
        for acc32 in (True, False):
            def step():
                x.grad = w.grad = None
                linear_cross_entropy(x, w, t, chunk=chunk, accumulate_fp32=acc32).backward()
            step(); torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
            ms = bench(step)
            peak = (torch.cuda.max_memory_allocated() - base) / 1e6
            print(f"N={N} chunk={chunk} fp32_acc={acc32}: {ms:.2f} ms fwd+bwd, extra peak {peak:.0f} MB")
    del x, w, g, buf, acc
    torch.cuda.empty_cache()
