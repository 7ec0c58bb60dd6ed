"""Run finetune_optimized.py with fp8_linear_kernel set to one of three variants (argv[1]), for an A/B in one call:
  before    the launch settings and custom-op dispatch of the code before session 7
  launches  session 7's tuned launch settings, custom-op dispatch in eager autograd as before
  current   the code as it is (tuned launches, eager autograd calls the wrapped functions directly)"""
import runpy, sys
import fp8_linear_kernel as F

variant = sys.argv.pop(1)
if variant in ("before", "launches"):
    F._ops = lambda: (F.fp8_rows_op, F.fp8_cols_op, F.fp8_scaled_mm_op)
if variant == "before":
    def old_row_launch(block_k, sms):
        rows = max(1, min(16, 4096 // block_k))
        num_warps = max(1, min(32, rows * block_k // (32 * 16)))
        return rows, num_warps, sms * (1 if num_warps >= 32 else 2)
    F.row_launch = old_row_launch
    F.COL_BLOCK_M, F.COL_BLOCK_K, F.COL_NUM_WARPS = 128, 64, 4
print(f"fp8 variant: {variant}", flush=True)
sys.argv = ["finetune_optimized.py"] + sys.argv[1:]
runpy.run_path("finetune_optimized.py", run_name="__main__")
