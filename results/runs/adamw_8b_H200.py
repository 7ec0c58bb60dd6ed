# The Triton AdamW at LLaMA 3.1 8B's real parameter list (8.03e9, bf16) vs 5 layers (1.09e9), isolated.
import torch, triton, adamw_kernel
H, I, KV, V, L = 4096, 14336, 1024, 128256, 32
layer = [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I), (H,), (H,)]
def shapes(n_layers, head=True):
    s = ([(V, H)] if head else []) + layer * n_layers + ([(H,), (V, H)] if head else [])
    return s
g = torch.Generator(device="cuda").manual_seed(0)
for label, shp in [("5 layers (benchmark_kernels' case)", shapes(5, head=False)), ("LLaMA 3.1 8B (every parameter)", shapes(L))]:
    params = [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shp]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device="cuda", dtype=torch.bfloat16)
    n = sum(p.numel() for p in params)
    opt = adamw_kernel.TritonAdamW(params, lr=1e-5, weight_decay=0.1)
    opt.step(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(opt.step, warmup=3, rep=30, return_mode="median")
    floor_bytes = adamw_kernel.ideal_bytes(n)
    print(f"{label}: {n / 1e9:.3f} B params, {len(params)} tensors: ours {ms:.2f} ms, {floor_bytes / ms / 1e9:.0f} GB/s "
          f"({floor_bytes / 1e9:.1f} GB moved)")
    del opt, params
    torch.cuda.empty_cache()
