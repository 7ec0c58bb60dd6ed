"""FP8 vs bf16 loss over the 200 steps of two runs with the same data, seed and schedule: per-step relative
difference and means over windows of steps.  python results/runs/finetune_H200_text200_compare.py BF16.json FP8.json"""
import json
import statistics as st
import sys

b = json.load(open(sys.argv[1]))["losses"]
f = json.load(open(sys.argv[2]))["losses"]
rel = [100 * (y - x) / x for x, y in zip(b, f)]
print("| steps | bf16 mean loss | FP8 mean loss | FP8 vs bf16 | per-step min | per-step max |")
print("|---|---:|---:|---:|---:|---:|")
for lo, hi in [(0, 10), (10, 20), (20, 50), (50, 100), (100, 150), (150, 200)]:
    mb, mf = st.mean(b[lo:hi]), st.mean(f[lo:hi])
    print(f"| {lo + 1}-{hi} | {mb:.4f} | {mf:.4f} | {100 * (mf - mb) / mb:+.2f}% | {min(rel[lo:hi]):+.2f}% | {max(rel[lo:hi]):+.2f}% |")
print(f"steps with |FP8 - bf16| > 1% of bf16: {sum(abs(r) > 1 for r in rel)} of {len(rel)} "
      f"(steps {', '.join(str(i + 1) for i, r in enumerate(rel) if abs(r) > 1)}); largest {max(rel, key=abs):+.2f}%")
print(f"final loss: bf16 {b[-1]:.4f}, FP8 {f[-1]:.4f} ({100 * (f[-1] - b[-1]) / b[-1]:+.3f}%)")
