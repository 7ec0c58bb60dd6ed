"""Sweep the launch settings of fp8_linear_kernel's two quantizing kernels at the shapes of one LLaMA 3.1 8B
training step (8192 tokens), and two ways of reducing the row kernel's partial column maxima.
Each variant is checked bit for bit against the module's launcher before it is timed (do_bench medians)."""
import itertools, json, sys, time
import torch, triton, triton.language as tl
from triton.testing import do_bench
import fp8_linear_kernel as F
from kernel_utils import next_power_of_2, num_sms

torch.manual_seed(0)
dev = torch.device("cuda")
SMS = num_sms(dev)
BW = 4.27e12  # copy bandwidth used for the floors in fp8_linear_kernel's docstring
T = 8192
# (name, M, K): every tensor one decoder layer quantizes (activations, weights, output gradients)
SHAPES = [("act h4096", T, 4096), ("act h14336", T, 14336), ("w q/o", 4096, 4096), ("w k/v", 1024, 4096),
          ("w gate/up", 14336, 4096), ("w down", 4096, 14336), ("dy k/v", T, 1024)]
CALLS = {"act h4096": 3 + 3 + 2, "act h14336": 1 + 1, "w q/o": 2 + 2, "w k/v": 2 + 2, "w gate/up": 2 + 2,
         "w down": 1 + 1, "dy k/v": 2 + 2}  # rough per-layer counts (rows + cols), for the weighting only


@triton.jit
def _colmax_reduce(P, Out, n, K, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for p0 in range(0, n, BLOCK_P):
        r = p0 + tl.arange(0, BLOCK_P)
        v = tl.load(P + r[:, None] * K + cols[None, :], mask=(r < n)[:, None] & (cols < K)[None, :], other=0.0)
        acc = tl.maximum(acc, tl.max(v, axis=0))
    tl.store(Out + cols, acc, mask=cols < K)


@triton.jit
def _rows_atomic(X, Q, Scale, ColMax, stride_x, M, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    col_max = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in range(0, tl.cdiv(tl.cdiv(M, ROWS) - pid, n_programs)):
        rows = (pid + i * n_programs) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.abs(x)
        col_max = tl.maximum(col_max, tl.max(a, axis=0))
        q, scale = F._quantize_block(x, tl.max(a, axis=1), 1, False)
        tl.store(Q + rows[:, None] * K + cols[None, :], q, mask=mask)
        tl.store(Scale + rows, scale, mask=row_ok)
    tl.atomic_max(ColMax + cols, col_max, mask=col_ok, sem="relaxed")


def rows_variant(x, rows, warps, per_sm, reduce):
    M, K = x.shape
    bk = next_power_of_2(K)
    q = torch.empty((M, K), dtype=F.FP8_DTYPE, device=dev)
    s = torch.empty(M, dtype=torch.float32, device=dev)
    n = max(1, min(triton.cdiv(M, rows), SMS * per_sm))
    if reduce == "atomic":
        cm = torch.zeros(K, dtype=torch.float32, device=dev)
        _rows_atomic[(n,)](x, q, s, cm, x.stride(0), M, K, ROWS=rows, BLOCK_K=bk, num_warps=warps)
        return q, s, cm
    part = torch.empty((n, K), dtype=torch.float32, device=dev)
    F._quantize_rows[(n,)](x, q, s, part, x.stride(0), M, K, ROWS=rows, BLOCK_K=bk, WRITE_ROWS=True, COL_MAX=True,
                           ROUND_IN_SOFTWARE=False, num_warps=warps)
    if reduce == "torch":
        cm = part.amax(dim=0)
    else:
        cm = torch.empty(K, dtype=torch.float32, device=dev)
        _colmax_reduce[(triton.cdiv(K, 256),)](part, cm, n, K, BLOCK_P=32, BLOCK_K=256, num_warps=4)
    return q, s, cm


def cols_variant(x, cm, bm, bk, warps):
    M, K = x.shape
    mp = F.padded(M)
    qt = torch.empty((K, mp), dtype=F.FP8_DTYPE, device=dev)
    sc = torch.empty(K, dtype=torch.float32, device=dev)
    F._quantize_cols_transposed[(triton.cdiv(mp, bm), triton.cdiv(K, bk))](
        x, qt, sc, cm, x.stride(0), M, mp, K, BLOCK_M=bm, BLOCK_K=bk, ROUND_IN_SOFTWARE=False, num_warps=warps)
    return qt, sc


def same(a, b):
    return all(torch.equal(u.view(torch.uint8) if u.dtype == F.FP8_DTYPE else u,
                           v.view(torch.uint8) if v.dtype == F.FP8_DTYPE else v) for u, v in zip(a, b))


out = {"gpu": torch.cuda.get_device_name(), "sms": SMS, "rows": {}, "cols": {}}
t0 = time.time()
for name, M, K in SHAPES:
    # random rows of different magnitudes (not zeros): the scales differ per row and per column
    x = (torch.randn(M, K, device=dev) * torch.rand(M, 1, device=dev).mul(4).exp()).to(torch.bfloat16)
    floor_rows = (M * K * 3 + M * 4) / BW * 1e6
    ref = F.quantize_rows(x, True, True)
    base = do_bench(lambda: F.quantize_rows(x, True, True), warmup=25, rep=60)
    res = []
    bk = next_power_of_2(K)
    rows_options = sorted({max(1, t // bk) for t in [4096, 8192, 16384, 32768]})

    def bench_rows(rows, warps, per_sm, red):
        try:
            got = rows_variant(x, rows, warps, per_sm, red)
        except Exception as e:  # out of resources
            return None
        if not same(got, ref):
            print("MISMATCH rows", name, rows, warps, per_sm, red, flush=True)
            return None
        return do_bench(lambda: rows_variant(x, rows, warps, per_sm, red), warmup=10, rep=40) * 1e3

    for rows, warps, per_sm in itertools.product(rows_options, [4, 8, 16, 32], [1, 2, 4, 8]):
        ept = rows * bk // (32 * warps)  # elements per thread
        if ept > 128 or ept < 4:
            continue
        us = bench_rows(rows, warps, per_sm, "torch")
        if us is not None:
            res.append((us, rows, warps, per_sm, "torch"))
    res.sort()
    for r in list(res[:3]):
        for red in ["triton", "atomic"]:
            us = bench_rows(*r[1:4], red)
            if us is not None:
                res.append((us, *r[1:4], red))
    res.sort()
    out["rows"][name] = {"M": M, "K": K, "current_us": base * 1e3, "floor_us": floor_rows, "best": res[:8]}
    print(f"rows {name:11} [{M}x{K}] current {base*1e3:8.1f} us  floor {floor_rows:7.1f}  best " +
          "; ".join(f"{r[0]:.1f} us rows={r[1]} w={r[2]} per_sm={r[3]} {r[4]}" for r in res[:4]), flush=True)
    # column kernel
    cm = ref[2]
    refc = F.quantize_cols(x, cm)
    basec = do_bench(lambda: F.quantize_cols(x, cm), warmup=25, rep=60)
    floor_cols = (M * K * 3 + K * 4) / BW * 1e6
    resc = []
    for bm, bkc, warps in itertools.product([32, 64, 128, 256], [32, 64, 128, 256], [2, 4, 8, 16]):
        if bm * bkc // (32 * warps) > 128 or bm * bkc // (32 * warps) < 4:
            continue
        try:
            got = cols_variant(x, cm, bm, bkc, warps)
        except Exception:
            continue
        if not same(got, refc):
            print("MISMATCH cols", name, bm, bkc, warps, flush=True)
            continue
        ms = do_bench(lambda: cols_variant(x, cm, bm, bkc, warps), warmup=10, rep=40)
        resc.append((ms * 1e3, bm, bkc, warps))
    resc.sort()
    out["cols"][name] = {"M": M, "K": K, "current_us": basec * 1e3, "floor_us": floor_cols, "best": resc[:8]}
    print(f"cols {name:11} [{M}x{K}] current {basec*1e3:8.1f} us  floor {floor_cols:7.1f}  best " +
          "; ".join(f"{r[0]:.1f} us bm={r[1]} bk={r[2]} w={r[3]}" for r in resc[:4]), flush=True)
    print(f"  ({time.time() - t0:.0f} s)", flush=True)
    del x
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp8_tune.json", "w"), indent=1)
