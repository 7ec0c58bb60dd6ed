"""SwiGLU with the FP8 maxima (swiglu_kernel.py) + one quantizing pass for both layouts
(fp8_linear_kernel.quantize_both), against the SwiGLU kernel + the two separate quantizing passes, at
LLaMA 3.1 8B's MLP shape ([8192 tokens, I = 14336], gate/up joined); a sweep of the maxima kernels'
launch settings. Every variant is checked bit for bit against the separate passes before it is timed.
Writes the fastest setting per direction to /tmp/r/swiglu_fp8_best.json."""
import json
import torch
from triton.testing import do_bench
import kernel_utils  # noqa: F401
import fp8_linear_kernel as F
import swiglu_kernel as S

M, I = 8192, 14336
torch.manual_seed(0)
gu = torch.randn(M, 2 * I, device="cuda", dtype=torch.bfloat16) * 3
g, u = S.halves(gu)
dh = torch.randn(M, I, device="cuda", dtype=torch.bfloat16)
print(torch.cuda.get_device_name(), "sms", torch.cuda.get_device_properties(0).multi_processor_count, flush=True)


def bits(t):
    return t.view(torch.uint8) if t.dtype == F.FP8_DTYPE else t


def same(a, b):
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def us(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def separate(x):
    q, s, cm = F.quantize_rows(x, True, True)
    return (x, q, s, *F.quantize_cols(x, cm))


def fused(made):
    x, rm, cm = made
    return (x, *F.quantize_both(x, rm, cm))


h0 = S.swiglu_forward(g, u)
d0 = S.swiglu_backward(dh, g, u, packed=True)
ref = {"forward": separate(h0), "backward": separate(d0)}
plain = {"forward": lambda: S.swiglu_forward(g, u), "backward": lambda: S.swiglu_backward(dh, g, u, packed=True)}
maxima = {"forward": lambda: S.swiglu_forward_maxima(g, u), "backward": lambda: S.swiglu_joined_backward_maxima(dh, g, u)}
sep = {}
for d, x in (("forward", h0), ("backward", d0)):
    a, b, c = us(plain[d]), us(lambda: F.quantize_rows(x, True, True)), us(lambda: F.quantize_cols(x, F.quantize_rows(x, False, True)[2]))
    sep[d] = a + us(lambda: separate(x))
    print(f"{d:8s} separate: swiglu {a:7.1f} us + rows {b:7.1f} + (maxima and) columns {c:7.1f}; swiglu + both passes {sep[d]:7.1f} us", flush=True)
best = {}
for prefetch in (True, False):
    S.FP8_PREFETCH = prefetch
    for launch in ((128, 1, 2048, 8), (32, 1, 2048, 8), (64, 1, 2048, 8), (32, 1, 1024, 4), (64, 1, 1024, 4),
                   (128, 1, 1024, 4)):
        for d in ("forward", "backward") if not prefetch else ("backward",):
            S.FP8_LAUNCH[d] = launch
            made = maxima[d]()
            ok = same(fused(made), ref[d])
            tm = us(maxima[d]) if ok else float("nan")
            tb = us(lambda: F.quantize_both(*made)) if ok else float("nan")
            print(f"{d:8s} {launch} prefetch {prefetch}: bit-equal {ok}, maxima kernel {tm:7.1f} us + quantize_both "
                  f"{tb:7.1f} = {tm + tb:7.1f} us; separate / this {sep[d] / (tm + tb):.2f}x", flush=True)
            if ok and tm < best.get(d, (float("inf"),))[0]:
                best[d] = (tm, launch, prefetch)
print("best", best)
json.dump(best, open("/tmp/r/swiglu_fp8_best.json", "w"))
