"""Which operations of one training step make the host wait for the GPU (torch.cuda.set_sync_debug_mode),
on LLaMA 3.1 8B's shapes cut to 2 layers, with the default kernels, FP8 and the Triton AdamW; and the data batch."""
import traceback, warnings, sys
import torch
import apply_kernels as ak, training
from run_config import make_parser, parse_config

cfg = parse_config(make_parser("sync", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized",
                   ["--model", "llama-3.1-8b", "--num-layers", "2", "--batch-size", "4", "--seq-len", "2048",
                    "--optimizer", "adamw-triton", "--fp8"] + sys.argv[1:])
model, *_ = training.prepare_model(cfg)
opt = training.make_optimizer(model, cfg)
data = training.make_run_data(cfg, model, None)
for i in range(3):
    training.training_step(model, opt, [data.batch(i, cfg.device)], cfg.max_grad_norm, grad_norm=False)
torch.cuda.synchronize()
seen = {}


def show(message, category, filename, lineno, file=None, line=None):
    stack = "".join(traceback.format_stack(limit=12)[:-2][-6:])
    seen.setdefault(str(message)[:80], stack)


warnings.showwarning = show
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
for i in range(3, 5):
    batch = data.batch(i, cfg.device)
    training.training_step(model, opt, [batch], cfg.max_grad_norm, grad_norm=(i == 4))
torch.cuda.set_sync_debug_mode(0)
print(f"{len(seen)} distinct synchronising operation(s) in two steps (data batch included)")
for m, st in seen.items():
    print("==", m); print(st)
