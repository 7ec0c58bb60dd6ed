"""Probes: (1) SDPA backends at the 8B training shapes and at 131k; (2) why the LoRA replay call blocks.
Usage: python .gpu/probe.py sdpa | python .gpu/probe.py replay <finetune args...>"""
import sys, time, ctypes, json
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path.insert(0, ".")

def sdpa_probe():
    from triton.testing import do_bench
    torch.manual_seed(0)
    cases = [("train 4x2048 GQA 32/8", 4, 2048, 32, 8), ("long 1x32768 GQA", 1, 32768, 32, 8), ("long 1x131072 GQA", 1, 131072, 32, 8)]
    out = {}
    for name, B, T, H, KV in cases:
        q = torch.randn(B, H, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, KV, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, KV, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(B, H, T, 128, device="cuda", dtype=torch.bfloat16)
        flops = 4 * B * H * T * T * 128 / 2 * 3.5  # causal, fwd + bwd (2.5x)
        ref = None
        for label, backends, gqa in [("flash gqa", [SDPBackend.FLASH_ATTENTION], True),
                                     ("cudnn gqa", [SDPBackend.CUDNN_ATTENTION], True),
                                     ("cudnn repeat", [SDPBackend.CUDNN_ATTENTION], False),
                                     ("flash repeat", [SDPBackend.FLASH_ATTENTION], False),
                                     ("efficient gqa", [SDPBackend.EFFICIENT_ATTENTION], True)]:
            def f():
                with sdpa_kernel(backends):
                    kk, vv = (k, v) if gqa else (k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1))
                    o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                return o
            try:
                o = f(); o.backward(do)
                g = q.grad.clone(); q.grad = k.grad = v.grad = None
                if ref is None:
                    ref = (o.detach().float(), g.float())
                err = ((o.detach().float() - ref[0]).abs().max().item(), (g.float() - ref[1]).abs().max().item())
                def step():
                    o = f(); o.backward(do); q.grad = k.grad = v.grad = None
                ms = do_bench(step, warmup=3 if T > 8192 else 25, rep=20 if T > 8192 else 200)
                fwd = do_bench(lambda: f(), warmup=3 if T > 8192 else 25, rep=20 if T > 8192 else 200)
                line = f"{name:26s} {label:14s} fwd+bwd {ms:9.3f} ms  fwd {fwd:9.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  max|dout| {err[0]:.3e} max|dq| {err[1]:.3e}"
                out[f"{name}/{label}"] = dict(ms=ms, fwd_ms=fwd, err=err)
            except Exception as e:
                line = f"{name:26s} {label:14s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                q.grad = k.grad = v.grad = None
            print(line, flush=True)
        del q, k, v, do, ref
        torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[2] if len(sys.argv) > 2 else "/dev/null", "w"), indent=1)

def graph_nodes(graph):
    try:
        raw = graph.raw_cuda_graph()
    except Exception as e:
        return f"n/a ({e})"
    for lib in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            rt = ctypes.CDLL(lib)
            n = ctypes.c_size_t(0)
            rc = rt.cudaGraphGetNodes(ctypes.c_void_p(raw), None, ctypes.byref(n))
            return n.value if rc == 0 else f"rc {rc}"
        except OSError:
            continue
    return "no libcudart"

def replay_probe(argv):
    from playbook import cuda_graph
    if "--sdpa-cudnn" in argv:
        argv.remove("--sdpa-cudnn")
        orig = F.scaled_dot_product_attention
        def sdpa(*a, **kw):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
                return orig(*a, **kw)
        torch.nn.functional.scaled_dot_product_attention = sdpa
        print("probe: SDPA with cuDNN first", flush=True)
    orig_replay = cuda_graph.GraphedStep.replay
    state = {"n": 0}
    def replay(self, micro_batches):
        state["n"] += 1
        n = state["n"]
        if n == 1:
            print(f"probe: graph nodes {graph_nodes(self.graph)}", flush=True)
        if n in (3, 4):
            torch.cuda.synchronize()
            if n == 4:
                torch.cuda._sleep(int(6e8))  # ~300 ms of GPU work queued ahead
            t0 = time.perf_counter()
            out = orig_replay(self, micro_batches)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"probe: replay {n} ({'idle GPU' if n == 3 else 'behind a ~300 ms kernel'}): call returned after {1e3*(t1-t0):.1f} ms, "
                  f"GPU done after {1e3*(t2-t0):.1f} ms", flush=True)
            return out
        return orig_replay(self, micro_batches)
    cuda_graph.GraphedStep.replay = replay
    from playbook.registry import DEFAULT_KERNELS
    from playbook.config import make_parser, parse_config
    from playbook.training import train
    train(parse_config(make_parser("probe", kernels_default=DEFAULT_KERNELS), "finetune_optimized", argv))

if __name__ == "__main__":
    if sys.argv[1] == "sdpa":
        sdpa_probe()
    else:
        replay_probe(sys.argv[2:])
