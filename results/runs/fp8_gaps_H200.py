"""Where a profiled training step's GPU idles: from profile_baseline's Chrome trace (argv[1]), the gaps between
consecutive kernels inside each ProfilerStep, split into those where the next kernel was launched only after the
previous one ended (the GPU waited for the host) and the rest, and the host-side operation that was running
when each late launch happened."""
import bisect, collections, json, sys

ev = json.load(open(sys.argv[1]))["traceEvents"]
X = [e for e in ev if e.get("ph") == "X"]
kernels = sorted((e for e in X if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
launch = {e["args"].get("correlation"): e for e in X if e.get("cat") in ("cuda_runtime", "cuda_driver")
          and "correlation" in e.get("args", {})}
steps = sorted((e for e in X if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep")),
               key=lambda e: e["ts"])
cpu = sorted((e for e in X if e.get("cat") in ("cpu_op", "user_annotation", "python_function")), key=lambda e: e["ts"])
by_tid = collections.defaultdict(list)
for e in cpu:
    by_tid[e["tid"]].append(e)
tops = {}
for tid, es in by_tid.items():  # outermost ops per thread (not inside another one), skipping ProfilerStep itself
    out, end = [], -1.0
    for e in es:
        if e["name"].startswith("ProfilerStep"):
            continue
        if e["ts"] >= end:
            out.append(e); end = e["ts"] + e["dur"]
    tops[tid] = (out, [e["ts"] for e in out])


def enclosing(e):
    out, starts = tops.get(e["tid"], ([], []))
    i = bisect.bisect_right(starts, e["ts"]) - 1
    if i >= 0 and out[i]["ts"] + out[i]["dur"] >= e["ts"]:
        return out[i]["name"][:90]
    return "(no op)"


syncs = collections.Counter(); sync_us = collections.Counter()
for e in X:
    if e.get("cat") in ("cuda_runtime", "cuda_driver") and any(s in e["name"] for s in ("Synchronize", "Malloc", "Free", "Memcpy", "EventQuery")):
        syncs[e["name"]] += 1; sync_us[e["name"]] += e["dur"]
print("runtime calls (all steps):", {k: (syncs[k], round(sync_us[k] / 1e3, 2)) for k in syncs})
for s in steps:
    t0, t1 = s["ts"], s["ts"] + s["dur"]
    ks = [k for k in kernels if t0 <= k["ts"] < t1]
    if not ks:
        continue
    busy = sum(k["dur"] for k in ks)
    late = collections.Counter(); late_n = collections.Counter(); other = 0.0; nxt = collections.Counter()
    late_total = 0.0
    for a, b in zip(ks, ks[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap <= 0:
            continue
        L = launch.get(b["args"].get("correlation"))
        if L is not None and L["ts"] + L["dur"] > a["ts"] + a["dur"]:
            key = enclosing(L)
            late[key] += gap; late_n[key] += 1; late_total += gap; nxt[b["name"][:60]] += gap
        else:
            other += gap
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"] if ks else 0
    print(f"\n{s['name']}: window {s['dur'] / 1e3:.1f} ms, first to last kernel {span / 1e3:.1f} ms, kernels {len(ks)} "
          f"busy {busy / 1e3:.1f} ms; gaps between kernels: {(span - busy) / 1e3:.1f} ms, of which the next launch came "
          f"late {late_total / 1e3:.1f} ms, other {other / 1e3:.1f} ms; before the first kernel {(ks[0]['ts'] - t0) / 1e3:.1f} ms, "
          f"after the last {(t1 - ks[-1]['ts'] - ks[-1]['dur']) / 1e3:.1f} ms")
    print("  late launches by the host op running (ms, count):")
    for k, v in late.most_common(12):
        print(f"    {v / 1e3:8.2f} ms {late_n[k]:6d}  {k}")
    print("  late gaps by the kernel that waited (ms):")
    for k, v in nxt.most_common(8):
        print(f"    {v / 1e3:8.2f} ms  {k}")
