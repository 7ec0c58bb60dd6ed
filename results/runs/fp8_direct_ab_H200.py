"""Run a script (SCRIPT, default finetune_optimized.py) with the FP8 layers launching their kernels
directly in eager mode (`direct`, the default) or through the custom operators (`operators`), argv[1],
for an A/B in one call."""
import os, runpy, sys
import fp8_linear_kernel as F

variant = sys.argv.pop(1)
F.DIRECT_LAUNCH = variant == "direct"
print(f"FP8 layers: {variant} (DIRECT_LAUNCH={F.DIRECT_LAUNCH})", flush=True)
script = os.environ.get("SCRIPT", "finetune_optimized.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
