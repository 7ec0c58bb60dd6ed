"""Where the backward's host time goes: the same work on the main thread, in autograd's worker thread, in a plain thread."""
import time, sys, os, threading
sys.path.insert(0, ".")
import torch, triton
import rmsnorm_kernel as rk
dev = torch.device("cuda")
_s, _e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); _s.record(); torch.cuda._sleep(1_000_000); _e.record(); _e.synchronize()
CYC = 1_000_000 / (_s.elapsed_time(_e) * 1e3)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)

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

def line(name, fn, reset=()):
    m, p20, p80 = host_us(fn, reset=reset)
    print(f"{name:66s} host {m:7.1f} us (p20-p80 {p20:.1f}-{p80:.1f})", flush=True)

N, H = 16384, 4096
x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
w = torch.randn(H, device=dev, dtype=torch.bfloat16)
dy = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_()
rstd = torch.empty(N, device=dev)
part = torch.randn(264, H, device=dev)
bbh, bbm, bnw, maxp = rk._bwd_settings(H, dev)
npg = min(-(-N // bbm), maxp)
dx = torch.empty_like(x)
bwd_args = (dy, x, w, rstd, dx, part, dy.stride(0), x.stride(0), dx.stride(0), N, H)
bwd_kw = dict(BLOCK_M=bbm, BLOCK_H=bbh, COMPUTE_DW=True, OFFSET=0.0, CASTING="llama", num_warps=bnw)

def make(body):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x.view_as(x)
        @staticmethod
        def backward(ctx, g):
            body()
            return g, None
    return lambda: F.apply(xg, wg).backward(dy)

bodies = {
    "nothing": lambda: None,
    "rmsnorm_backward (launcher: 2 empties, Triton launch, sum, to)": lambda: rk.rmsnorm_backward(dy, x, w, rstd, True),
    "Triton launch of _rmsnorm_bwd only": lambda: rk._rmsnorm_bwd[(npg,)](*bwd_args, **bwd_kw),
    "part.sum(0).to(bf16) only": lambda: part.sum(0).to(torch.bfloat16),
    "torch.empty x2 only": lambda: (torch.empty_like(x), torch.empty(264, H, device=dev)),
}
for name, body in bodies.items():
    line("main thread:  " + name, body)
    line("autograd bwd: " + name, make(body), reset=(xg, wg))
    ev = threading.Event()
    res = []
    def worker():
        res.append(host_us(body))
    t = threading.Thread(target=worker); t.start(); t.join()
    print(f"{'plain thread: ' + name:66s} host {res[0][0]:7.1f} us", flush=True)
