"""Host us per call: the floor of autograd's machinery next to RMSNorm as a user calls it (GPU kept busy)."""
import time, sys, os
sys.path.insert(0, ".")
import torch, triton
import triton.testing
import rmsnorm_kernel as rk

dev = torch.device("cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); start.record(); torch.cuda._sleep(1_000_000); end.record(); end.synchronize()
CYC = 1_000_000 / (start.elapsed_time(end) * 1e3)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "cpus", os.cpu_count(), flush=True)

def host_us(fn, n=200, reset=()):
    for _ in range(10):
        for t in reset: t.grad = None
        fn()
    torch.cuda.synchronize()
    s = []
    for _ in range(n):
        for t in reset: t.grad = None
        torch.cuda.synchronize()
        torch.cuda._sleep(int(3000 * CYC))
        t0 = time.perf_counter(); fn(); s.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    s.sort()
    return s[len(s) // 2], s[len(s) // 5], s[4 * len(s) // 5]

def back_to_back(fn, reset=(), n=200):
    """host us per call when calls follow each other (GPU kept busy by one long spin)"""
    for _ in range(10):
        for t in reset: t.grad = None
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(200_000 * CYC))
    t0 = time.perf_counter()
    for _ in range(n):
        for t in reset: t.grad = None
        fn()
    us = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return us

N, H = 16384, 4096
x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
w = torch.randn(H, device=dev, dtype=torch.bfloat16)
dy = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_()

class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        y = torch.empty_like(x); r = torch.empty(x.shape[0], device=x.device)
        ctx.save_for_backward(x, w, r)
        return y
    @staticmethod
    def backward(ctx, dy):
        x, w, r = ctx.saved_tensors
        return torch.empty_like(dy), torch.empty_like(w)

class NoopNoAlloc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, dy):
        return dy, None

def line(name, fn, reset=()):
    m, p20, p80 = host_us(fn, reset=reset)
    b = back_to_back(fn, reset=reset)
    print(f"{name:66s} host {m:7.1f} us (p20-p80 {p20:.1f}-{p80:.1f}), back to back {b:7.1f} us", flush=True)

small = torch.randn(16, device=dev)
line("small.add_(1): one aten launch", lambda: small.add_(1))
line("torch.empty(16384x4096 bf16)", lambda: torch.empty(N, H, device=dev, dtype=torch.bfloat16))
line("NoopNoAlloc.apply(x, w).backward(dy)", lambda: NoopNoAlloc.apply(xg, wg).backward(dy), reset=(xg, wg))
line("Noop.apply(x, w).backward(dy)  [4 allocations, no kernel]", lambda: Noop.apply(xg, wg).backward(dy), reset=(xg, wg))
line("(x * 2).backward(dy)  [aten mul, its backward, AccumulateGrad]", lambda: (xg * 2).backward(dy), reset=(xg,))
line("rmsnorm(x, w).backward(dy)  [ours, as a user calls it]", lambda: rk.rmsnorm(xg, wg, 1e-5).backward(dy), reset=(xg, wg))
yy = [None]
def fwd():
    yy[0] = rk.rmsnorm(xg, wg, 1e-5)
line("  its forward only (with autograd)", fwd, reset=(xg, wg))
with torch.no_grad():
    line("rmsnorm(x, w) under no_grad", lambda: rk.rmsnorm(x, w, 1e-5))
line("rk._check_inputs", lambda: rk._check_inputs(x, w))
rstd = torch.empty(N, device=dev)
line("rmsnorm_forward (launcher)", lambda: rk.rmsnorm_forward(x, w, 1e-5))
line("rmsnorm_backward (launcher)", lambda: rk.rmsnorm_backward(dy, x, w, rstd, True))
part = torch.randn(264, H, device=dev)
line("part.sum(0).to(bf16)", lambda: part.sum(0).to(torch.bfloat16))
for name, f in [("ours", lambda: rk.rmsnorm(xg, wg, 1e-5).backward(dy)), ("Noop", lambda: Noop.apply(xg, wg).backward(dy))]:
    q = triton.testing.do_bench(f, warmup=25, rep=200, grad_to_none=[xg, wg], quantiles=[0.5, 0.2, 0.8])
    print(f"do_bench {name}: {q[0]*1e3:.1f} us (p20-p80 {q[1]*1e3:.1f}-{q[2]*1e3:.1f})", flush=True)
