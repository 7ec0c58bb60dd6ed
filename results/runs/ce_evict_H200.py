"""Cross-entropy 16384 x 128256 bf16, loss + gradient: the sweep kernel with cache-eviction hints on its two
sweeps' loads and the gradient's stores (copies of cross_entropy_kernel.py with those lines edited), checked
against the unedited kernel, then timed (do_bench medians) against the copy floor of the same run."""
import importlib.util, pathlib, sys
import torch, triton
sys.path.insert(0, ".")
import cross_entropy_kernel as ce

SRC = pathlib.Path(ce.__file__).read_text().splitlines(keepends=True)
LINES = {"s1": [233, 237], "s2": [326, 331], "st": [342]}  # 0-based: sweep 1 loads, sweep 2 loads, gradient store
assert "x_next = tl.load(logits_row + cols0" in SRC[233] and "cols_next >= 0" in SRC[331] and "tl.store(grad_row" in SRC[342]


def variant(name, hints):
    src = list(SRC)
    for key, policy in hints.items():
        for i in LINES[key]:
            line = src[i].rstrip("\n")
            assert line.endswith(")")
            src[i] = line[:-1] + f', eviction_policy="{policy}")\n'
    path = pathlib.Path(f"/tmp/ce_{name}.py")
    path.write_text("".join(src))
    spec = importlib.util.spec_from_file_location(f"ce_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


torch.manual_seed(0)
N, V = 16384, 128256
x = (torch.randn(N, V, device="cuda") * 4).bfloat16()
t = torch.randint(0, V, (N,), device="cuda"); t[::13] = -100
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median") * 1e3
dst = torch.empty_like(x)
copy = bench(lambda: dst.copy_(x))
floor = (2 * N * V * 2 + N * 12) / (2 * x.numel() * 2 / copy)
print(f"copy {copy:.1f} us -> {2 * x.numel() * 2 / copy / 1e3:.0f} GB/s; floor (read + write once) {floor:.1f} us", flush=True)
del dst
ref_l, ref_g = ce.cross_entropy_forward(x, t, -100, "mean", True, False, split=False)
ref_g = ref_g.clone()
VARIANTS = [("plain", {}), ("s1last", {"s1": "evict_last"}), ("s2first", {"s2": "evict_first"}),
            ("stfirst", {"st": "evict_first"}), ("s1last_s2first", {"s1": "evict_last", "s2": "evict_first"}),
            ("s1last_stfirst", {"s1": "evict_last", "st": "evict_first"}),
            ("all", {"s1": "evict_last", "s2": "evict_first", "st": "evict_first"})]
for rnd in range(2):
    for name, hints in VARIANTS:
        mod = variant(name, hints)
        f = lambda: mod.cross_entropy_forward(x, t, -100, "mean", True, False, split=False)
        l, g = f()
        same = torch.equal(l, ref_l) and torch.equal(g, ref_g)
        us = bench(f)
        xi = x.clone()  # in place: the gradient overwrites the logits (values stay finite)
        us_in = bench(lambda: mod.cross_entropy_forward(xi, t, -100, "mean", True, True, split=False))
        del xi
        print(f"round {rnd} {name:16s} out-of-place {us:8.1f} us ({us / floor:.2f}x floor)  in place {us_in:8.1f} us "
              f"({us_in / floor:.2f}x)  bit-equal {same}", flush=True)
