"""A/B timing of the default kernels of one tree: python quick_ab.py DIR (imports DIR's kernel modules)."""
import sys, torch
sys.path.insert(0, sys.argv[1])
import triton.testing as tt
import cross_entropy_kernel as ce, rmsnorm_kernel as rn, linear_cross_entropy_kernel as fl
g = torch.Generator(device="cuda").manual_seed(0)
N, H, V = 16384, 4096, 128256
dt = torch.bfloat16
t = torch.randint(0, V, (N,), device="cuda", generator=g)
# CE (in-place gradient, the default)
base = torch.randn(N, V, device="cuda", dtype=dt, generator=g)
lg = base.clone().requires_grad_()
ref = torch.nn.functional.cross_entropy(base.float(), t)
got = ce.cross_entropy(lg, t); assert abs(got.item() - ref.item()) < 1e-2 * abs(ref.item()), (got, ref)
def f_ce():
    lg.data.copy_(base); ce.cross_entropy(lg, t).backward()
def f_copy():
    lg.data.copy_(base)
ms_ce = tt.do_bench(f_ce, grad_to_none=[lg], return_mode="median"); ms_cp = tt.do_bench(f_copy, return_mode="median")
del base, lg
x = torch.randn(N, H, device="cuda", dtype=dt, generator=g).requires_grad_(); w = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(dt).requires_grad_()
dy = torch.randn(N, H, device="cuda", dtype=dt, generator=g)
y = rn.rmsnorm(x, w, 1e-5); r = rn.rmsnorm_ref(x.float(), w.float(), 1e-5); assert (y.float() - r).abs().max() < 0.05
ms_rn = tt.do_bench(lambda: rn.rmsnorm(x, w, 1e-5).backward(dy), grad_to_none=[x, w], return_mode="median")
W = (0.02 * torch.randn(V, H, device="cuda", dtype=dt, generator=g)).requires_grad_()
xs = x.detach().clone().requires_grad_()
lo = fl.linear_cross_entropy(xs, W, t); rf = torch.nn.functional.cross_entropy((xs[:2048].float() @ W.float().T), t[:2048])
ms_fl = tt.do_bench(lambda: fl.linear_cross_entropy(xs, W, t).backward(), grad_to_none=[xs, W], return_mode="median")
print(f"{sys.argv[1]}: cross_entropy fwd+bwd {ms_ce - ms_cp:.3f} ms (minus the {ms_cp:.3f} ms restore copy) | rmsnorm fwd+bwd {ms_rn*1000:.1f} us | linear_cross_entropy fwd+bwd {ms_fl:.2f} ms (loss {lo.item():.4f}, first-2048 fp32 ref {rf.item():.4f})")
