"""Run finetune_optimized.py with the FP8 row quantizer as in ff790b4 (`before`: no double-buffered loop,
its launch settings) or as it is (`current`), argv[1], for an A/B in one call."""
import runpy, sys
import fp8_linear_kernel as F

variant = sys.argv.pop(1)
if variant == "before":
    F.PREFETCH_LAUNCH = {}

    def before_row_launch(block_k, sms):
        if block_k <= 8192:
            return F.ROW_ELEMENTS // block_k, F.ROW_WARPS, sms * F.ROW_PROGRAMS_PER_SM
        if block_k <= 16384:
            return 2, 16, sms
        return 1, block_k // 4096, sms
    F.row_launch = before_row_launch
print(f"row quantizer: {variant}", flush=True)
sys.argv = ["finetune_optimized.py"] + sys.argv[1:]
runpy.run_path("finetune_optimized.py", run_name="__main__")
