"""The SwiGLU + FP8 row quantization kernels (swiglu_kernel.py) against the two separate passes they
replace, at LLaMA 3.1 8B's MLP shape ([8192 tokens, I = 14336], gate/up joined), and a sweep of their
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


h0 = S.swiglu_forward(g, u)
d0 = S.swiglu_backward(dh, g, u, packed=True)
ref_f, ref_b = (h0, *F.quantize_rows(h0, True, True)), (d0, *F.quantize_rows(d0, True, True))
sep = {
    "forward": (us(lambda: S.swiglu_forward(g, u)), us(lambda: F.quantize_rows(h0, True, True))),
    "backward": (us(lambda: S.swiglu_backward(dh, g, u, packed=True)), us(lambda: F.quantize_rows(d0, True, True))),
}
bytes_fused = {"forward": M * I * (2 + 2 + 2 + 1), "backward": M * I * (3 * 2 + 2 * 2 + 2 * 1)}
for d, (a, b) in sep.items():
    print(f"{d:8s} separate: swiglu {a:7.1f} us + row quantizer {b:7.1f} us = {a + b:7.1f} us", flush=True)
best = {}
for values in (512, 1024, 2048):
    for per_sm in (1, 2):
        S.FP8_ROW_VALUES = {"forward": values, "backward": values}
        S.FP8_PROGRAMS_PER_SM = {"forward": per_sm, "backward": per_sm}
        for d, fn, ref in (("forward", lambda: S.swiglu_forward_fp8(g, u), ref_f),
                           ("backward", lambda: S.swiglu_joined_backward_fp8(dh, g, u), ref_b)):
            ok = same(fn(), ref)
            t = us(fn) if ok else float("nan")
            total = sum(sep[d])
            print(f"{d:8s} fused, {16384 // values:2d} warps, {per_sm} program(s)/SM: bit-equal {ok}, {t:7.1f} us "
                  f"({bytes_fused[d] / t / 1e6:6.0f} GB/s), separate/fused {total / t:.2f}x", flush=True)
            if ok and t < best.get(d, (float("inf"),))[0]:
                best[d] = (t, values, per_sm)
print("best", best)
json.dump(best, open("/tmp/r/swiglu_fp8_best.json", "w"))
