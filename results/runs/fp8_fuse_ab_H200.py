"""Run finetune_optimized.py with the SwiGLU's FP8 maxima and one-read quantization on (`fused`) or off (`separate`),
argv[1], for an A/B in one call; the launch setting is the sweep's best when it left one."""
import json, os, runpy, sys
import fp8_linear_kernel as F
import swiglu_kernel as S

variant = sys.argv.pop(1)
F.FUSE_CASTS = variant == "fused"
if os.path.exists("/tmp/r/swiglu_fp8_best.json"):
    for d, (_, launch, prefetch) in json.load(open("/tmp/r/swiglu_fp8_best.json")).items():
        if d == "backward":
            S.FP8_LAUNCH[d], S.FP8_PREFETCH = tuple(launch), prefetch
print(f"fused casts: {variant} {S.FP8_LAUNCH} prefetch {S.FP8_PREFETCH} forward maxima {S.FP8_FORWARD_MAXIMA}", flush=True)
script = os.environ.get("SCRIPT", "finetune_optimized.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
