"""Row quantizer: does loading the next row block before quantizing the current one (register double
buffering) or Triton's software pipelining (num_stages) bring it closer to its byte floor? Every variant
is checked bit for bit against fp8_linear_kernel.quantize_rows (rows, scales, column maxima) first;
do_bench medians in us, and the ratio to the floor (read 2 B + write 1 B per element at 4.27 TB/s)."""
import torch, triton, triton.language as tl
from triton.testing import do_bench
import fp8_linear_kernel as F
from fp8_linear_kernel import _quantize_block
from kernel_utils import next_power_of_2, num_sms

dev = torch.device("cuda")
SMS = num_sms(dev)
BW = 4.27e12


@triton.jit
def _rows_prefetch(X, Q, Scale, ColMax, stride_x, M, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    col_max = tl.zeros([BLOCK_K], dtype=tl.float32)
    rows = pid * ROWS + tl.arange(0, ROWS)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=(rows < M)[:, None] & col_ok[None, :], other=0.0)
    for i in range(0, tl.cdiv(tl.cdiv(M, ROWS) - pid, n_programs)):
        cur_rows, cur = rows, x
        rows = (pid + (i + 1) * n_programs) * ROWS + tl.arange(0, ROWS)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=(rows < M)[:, None] & col_ok[None, :],
                    other=0.0)  # the next block, in flight while this one is quantized
        xf = cur.to(tl.float32)
        a = tl.abs(xf)
        col_max = tl.maximum(col_max, tl.max(a, axis=0))
        q, scale = _quantize_block(xf, tl.max(a, axis=1), 1, False)
        row_ok = cur_rows < M
        tl.store(Q + cur_rows[:, None] * K + cols[None, :], q, mask=row_ok[:, None] & col_ok[None, :])
        tl.store(Scale + cur_rows, scale, mask=row_ok)
    tl.store(ColMax + pid * K + cols, col_max, mask=col_ok)


def prefetch(x, rows, warps, programs):
    M, K = x.shape
    q = torch.empty((M, K), dtype=F.FP8_DTYPE, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    n = max(1, min(triton.cdiv(M, rows), programs))
    part = torch.empty((n, K), dtype=torch.float32, device=x.device)
    _rows_prefetch[(n,)](x, q, s, part, x.stride(0), M, K, ROWS=rows, BLOCK_K=next_power_of_2(K), num_warps=warps)
    return q, s, part.amax(dim=0)


def staged(x, stages):
    M, K = x.shape
    block = next_power_of_2(K)
    rows, warps, programs = F.row_launch(block, SMS)
    q = torch.empty((M, K), dtype=F.FP8_DTYPE, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    n = max(1, min(triton.cdiv(M, rows), programs))
    part = torch.empty((n, K), dtype=torch.float32, device=x.device)
    F._quantize_rows[(n,)](x, q, s, part, x.stride(0), M, K, ROWS=rows, BLOCK_K=block, WRITE_ROWS=True, COL_MAX=True,
                           ROUND_IN_SOFTWARE=False, num_warps=warps, num_stages=stages)
    return q, s, part.amax(dim=0)


def same(a, b):
    return all(torch.equal(u.view(torch.uint8) if u.dtype == F.FP8_DTYPE else u,
                           v.view(torch.uint8) if v.dtype == F.FP8_DTYPE else v) for u, v in zip(a, b))


for M, K in [(8192, 4096), (8192, 6144), (8192, 14336), (8192, 28672), (6144, 4096), (28672, 4096), (4096, 14336)]:
    torch.manual_seed(M + K)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16) * 3
    ref = F.quantize_rows(x, True, True)
    floor = (M * K * 3 + M * 4) / BW * 1e6
    block = next_power_of_2(K)
    r0, w0, p0 = F.row_launch(block, SMS)
    variants = {"launcher": lambda: F.quantize_rows(x, True, True)}
    for st in (1, 2, 3, 4):
        variants[f"num_stages={st}"] = lambda st=st: staged(x, st)
    for r in sorted({max(1, r0 // 2), r0}):
        for w in sorted({w0, max(4, w0 // 2), min(32, w0 * 2)}):
            for p in (1, 2):
                if r * block // (32 * w) <= 64:  # two blocks live per thread: half the usual budget
                    variants[f"prefetch rows={r} warps={w} p/SM={p}"] = lambda r=r, w=w, p=p: prefetch(x, r, w, SMS * p)
    out = []
    for name, fn in variants.items():
        try:
            if not same(fn(), ref):
                print(f"{M}x{K} {name}: NOT EQUAL"); continue
            us = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001
            print(f"{M}x{K} {name}: failed {type(e).__name__}"); continue
        out.append((name, us))
    base = out[0][1]
    print(f"[{M}, {K}] floor {floor:.1f} us")
    for name, us in sorted(out, key=lambda t: t[1])[:6] + [o for o in out if o[0] == "launcher"]:
        print(f"    {name:<34} {us:8.1f} us  {us / floor:5.2f}x floor  {base / us:5.2f}x launcher")
