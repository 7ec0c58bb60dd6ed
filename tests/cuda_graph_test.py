"""Tests of the CUDA-graph step (playbook/run/cuda_graph.py): when it is used, why not, and that the
replayed step trains as the eager one does.

    $ PYTHONPATH=. python tests/cuda_graph_test.py       # a readable report
    $ pytest tests/cuda_graph_test.py

On a CPU only the decisions and the optimizer plumbing run; the equivalence tests need a GPU. They
train the tiny preset twice from the same seed on the same real-text batches, once eager
(--cuda-graphs off) and once replayed, and compare the loss of every step. A learning rate that
changes every step (warm-up, then linear decay) and batches that differ every step make a stale input,
a rate not updated or a skipped optimizer step show at once.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from playbook.data.dataset import BatchAttention
from playbook.run import cuda_graph, training
from playbook.runtime import common
from playbook.store.files import RESULTS_DIR
from playbook.model import registry as ak
from playbook.config import make_parser, parse_config
from playbook.optim.schedule import schedule_factor
from testkit import record, run_as_script
from playbook.optim.optimizer import make_capturable, make_optimizer
from playbook.run.start import make_run_data
from playbook.optim.schedule import LRSchedule

HERE = Path(__file__).resolve().parent.parent
TEXT = HERE / "examples" / "chat.jsonl"
GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="CUDA graphs need a CUDA GPU")


def config(*argv):
    return parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized", list(argv))


def on_gpu(cfg):
    """The same settings as if a GPU were present (the decisions only look at the device's type)."""
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device=torch.device("cuda")))


# ------------------------------------------------------------------------------------------------
# The decisions (any machine)
# ------------------------------------------------------------------------------------------------
class _Rows:
    """A TrainData's rows and nothing else (unpacked, its padding mask kept): what graph_blocker reads."""

    def __init__(self, rows):
        self.rows, self.packing, self.attention = rows, False, BatchAttention()


def test_what_keeps_a_run_eager(monkeypatch):
    cfg = config()
    assert cuda_graph.graph_blocker(cfg) == ("no GPU" if not GPU else None)
    assert cuda_graph.graph_blocker(on_gpu(cfg)) is None
    assert cuda_graph.graph_blocker(on_gpu(config("--optimizer", "adamw-triton"))) is None  # its step count and rate live on the GPU
    for fp8 in (("--fp8",), ("--fp8", "--fp8-recipe", "mxfp8", "--fp8-emulate")):  # nothing drawn on the host
        assert cuda_graph.graph_blocker(on_gpu(config(*fp8))) is None, fp8
    cases = {
        "--cuda-graphs off": on_gpu(config("--cuda-graphs", "off")),
        "--offload-activations": on_gpu(config("--gradient-checkpointing", "--offload-activations")),
        "NVFP4": on_gpu(config("--fp8", "--fp8-recipe", "nvfp4")),  # its per-launch seeds (stochastic rounding)
        "emulated NVFP4": on_gpu(config("--fp8", "--fp8-recipe", "nvfp4-46", "--fp8-emulate")),
    }
    for want, c in cases.items():
        said = cuda_graph.graph_blocker(c)
        assert said is not None and want.split()[-1] in said, (want, said)
        record(f"{want} -> eager: {said}", 0.0, 0.0, True)
    padded = _Rows({"input_ids": None, "labels": None, "attention_mask": None})
    said = cuda_graph.graph_blocker(on_gpu(cfg), padded)
    assert said is not None and "padding mask" in said and "--packing" in said, said
    packed = _Rows({"input_ids": None, "labels": None, "position_ids": None, "segments": None})
    assert cuda_graph.graph_blocker(on_gpu(cfg), packed) is None
    record(f"right-padded rows -> eager: {said}; packed rows -> graph", 0.0, 0.0, True)
    monkeypatch.setattr(cuda_graph, "world", lambda: (0, 2))
    said = cuda_graph.graph_blocker(on_gpu(cfg))
    assert said is not None and "FSDP2" in said, said
    record(f"two processes -> eager: {said}", 0.0, 0.0, True)


def test_the_schedule_fills_a_tensor_rate_in_place():
    """A captured optimizer reads its rate from one tensor: the schedule must write into that tensor,
    not replace it with a float (the graph would keep the old rate for the whole run)."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    lr = torch.tensor(1e-3)
    opt = torch.optim.AdamW([{"params": [p]}, {"params": [torch.nn.Parameter(torch.randn(4))]}], lr=lr, foreach=False)
    schedule = LRSchedule(opt, total_steps=10, warmup_steps=4, kind="linear")
    rates = []
    for step in range(6):
        schedule.apply(step)
        assert all(g["lr"] is lr for g in opt.param_groups)
        rates.append(float(lr))
    want = [1e-3 * schedule_factor(s, 10, 4, "linear") for s in range(6)]
    assert rates == pytest.approx(want, rel=1e-6), (rates, want)  # fp32 tensor vs float64 arithmetic
    record(f"rate tensor filled in place each step: {', '.join(f'{r:.2e}' for r in rates)}", 0.0, 0.0, True)


def test_a_loaded_optimizer_is_made_capturable_again():
    """load_state_dict replaces our groups with the saved ones (a float rate, capturable False, a CPU
    step count from an eager run): make_capturable restores the one shared rate tensor and the flag."""
    params = [torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))]
    eager = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=2e-4, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    eager.step()
    saved = eager.state_dict()
    lr = torch.tensor(9.0)
    ours = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=lr, foreach=True, capturable=True)
    ours.load_state_dict(saved)
    assert not isinstance(ours.param_groups[0]["lr"], torch.Tensor)  # what load_state_dict leaves
    make_capturable(ours, torch.device("cpu"))
    rates = {id(g["lr"]) for g in ours.param_groups}
    assert len(rates) == 1 and all(g["capturable"] for g in ours.param_groups)
    assert float(ours.param_groups[0]["lr"]) == pytest.approx(2e-4)  # the saved rate, in fp32
    assert all(s["step"].dtype == torch.float32 and float(s["step"]) == 1.0 for s in ours.state.values())
    record("after load: one rate tensor (2.0e-04), capturable, step counts kept (1)", 0.0, 0.0, True)


def test_the_peak_counts_the_captured_step(monkeypatch):
    """Replays allocate nothing (the step's tensors were allocated once, in the capture), so a peak read over
    replays alone would leave the activations out: the reported peak is the larger of the two."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 64 * 10**9)  # replays: weights + state
    step = cuda_graph.GraphedStep.__new__(cuda_graph.GraphedStep)
    step.graph, step.capture_peak_bytes = object(), 81 * 10**9  # the capture: the activations too
    assert cuda_graph.peak_bytes(step) == 81 * 10**9
    step.capture_peak_bytes = 10 * 10**9
    assert cuda_graph.peak_bytes(step) == 64 * 10**9
    assert cuda_graph.peak_bytes(None) == 64 * 10**9  # an eager run: the allocator's own peak
    record("peak = max(replays' peak, the capture's peak): 64 and 81 GB -> 81 GB", 0.0, 0.0, True)


def test_a_compiled_model_keeps_sdpa_causal_path(monkeypatch):
    """transformers (5.17 with torch 2.11, as on the GPU machines) never skips the causal mask while Dynamo
    traces: it builds a [B, 1, T, T] mask, and attention runs about 3x slower on a GPU. `--compile` installs
    the causal skip first, so the compiled forward calls SDPA without a mask, as an eager step does. Here
    transformers is made to refuse the skip as it does under tracing there; the control traces without ours."""
    from transformers import masking_utils

    from playbook.model import models
    from testkit import tiny_model

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    mapping = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    monkeypatch.setitem(mapping, "sdpa", mapping["sdpa"])  # restored after the test, as the next line's patch
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", masking_utils.find_packed_sequence_indices)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))

    def masks_in_compiled_forward():
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        model = tiny_model("llama")
        model.config._attn_implementation = "sdpa"
        torch._dynamo.reset()
        on_device = ids.to(next(model.parameters()).device)
        torch.compile(model, backend=backend)(input_ids=on_device, labels=on_device)
        calls = [n for gm in graphs for n in gm.graph.nodes
                 if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]
        assert len(calls) == model.config.num_hidden_layers, calls
        return sum(n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) is not None for n in calls)

    without = masks_in_compiled_forward()
    model = tiny_model("llama")
    models.apply_compile(model, config("--compile"))  # model.compile() only marks the model: nothing traced yet
    assert getattr(mapping["sdpa"], "causal_skip", False)
    with_skip = masks_in_compiled_forward()
    padding = torch.ones(2, 32, dtype=torch.bool)
    padding[1, :5] = False
    args = dict(batch_size=2, q_length=32, kv_length=32, attention_mask=padding, device="cpu")
    assert torch.equal(mapping["sdpa"](**args), mapping["sdpa"].__wrapped__(**args))  # a padding mask: transformers'
    assert without == 2 and with_skip == 0, (without, with_skip)
    record(f"compiled 2-layer model, SDPA calls given a mask: {without} without the causal skip, {with_skip} with it; "
           "padded rows keep transformers' mask", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# Replayed = eager (GPU)
# ------------------------------------------------------------------------------------------------
STEPS = 8
BASE = ("--model", "llama-tiny", "--batch-size", "2", "--seq-len", "128", "--data", str(TEXT), "--steps", str(STEPS),
        "--timing-warmup-steps", "1", "--lr", "1e-3", "--lr-warmup-steps", "2", "--lr-schedule", "linear",
        "--overwrite")


# A bf16 weight that rounds the other way (the capturable AdamW computes its bias correction on the GPU in
# fp32, the eager one on the host in fp64) moves the tiny model's loss by ~1e-5; 2e-3 of the loss leaves
# room for a few such flips to add up over 8 steps, while a stale batch, a rate left at its first value or
# a missing optimizer step moves it by 1e-2 or more from the second replayed step on.
REL_TOL = 2e-3
VARIANTS = {
    "default kernels": (),
    "grad-accum 2 + clipping": ("--grad-accum", "2", "--max-grad-norm", "0.5"),
    "packed rows (4-D mask)": ("--dataset", str(TEXT), "--packing", "--seq-len", "256"),
    "LoRA r=8": ("--lora-r", "8", "--lr", "1e-2"),
    "FP8 projections": ("--fp8", "--fp8-recipe", "rowwise"),  # the default recipe keeps a 2-layer model in bf16
    "optimizer in backward": ("--optimizer-in-backward",),
    "Triton AdamW": ("--optimizer", "adamw-triton"),
    "Triton AdamW in backward": ("--optimizer", "adamw-triton", "--optimizer-in-backward"),
    "gradient checkpointing": ("--gradient-checkpointing",),
}


@needs_gpu
@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_replayed_step_trains_as_the_eager_one(name):
    argv, base = VARIANTS[name], list(BASE)
    if "--dataset" in argv:  # --data and --dataset are one choice
        i = base.index("--data")
        del base[i: i + 2]
    tag = "test_cuda_graph_" + "".join(c if c.isalnum() else "_" for c in name)
    eager = _run(base, tag + "_eager", *argv, "--cuda-graphs", "off")
    graph = _run(base, tag + "_graph", *argv)
    assert graph["cuda_graphs"] == "replayed from step 2", graph["cuda_graphs"]
    assert eager["cuda_graphs"] == "off (--cuda-graphs off)", eager["cuda_graphs"]
    a, b = eager["losses"], graph["losses"]
    assert len(a) == len(b) == STEPS
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert worst <= REL_TOL, (name, a, b)
    assert a[-1] < a[0], a  # it trains
    pe, pg = eager["summary"]["peak GPU memory (GB)"], graph["summary"]["peak GPU memory (GB)"]
    qe, qg = eager["summary"]["host queue median (ms)"], graph["summary"]["host queue median (ms)"]
    record(f"{name}: losses {b[0]:.4f} -> {b[-1]:.4f}, worst step {worst:.1e} rel. from eager; host queue "
           f"{qe:.2f} -> {qg:.2f} ms, peak {pe * 1e3:.0f} / {pg * 1e3:.0f} MB", worst, REL_TOL, True)


def _run(base, tag, *argv):
    try:
        return training.train(config(*base, "--tag", tag, *argv))
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)


@needs_gpu
def test_the_captured_step_keeps_causal_attention_without_a_mask():
    """Under capture transformers counts the capture as tracing and would build a [B, 1, T, T] causal mask
    (about 3x slower attention on an H200): the captured step must call SDPA with no mask, as eager does."""
    from playbook.model.models import prepare_model

    cfg = config(*BASE)
    model, *_ = prepare_model(cfg)
    data = make_run_data(cfg, model, None)
    optimizer = make_optimizer(model, cfg.training, cfg.run, capturable=True)
    batches = [data.batch(0, cfg.run.device)]
    step = cuda_graph.GraphedStep(lambda mb: training.training_step(model, optimizer, mb, zero_grad=False), batches)
    with cuda_graph.count_masked_attention() as eager_masked:
        step.run(batches, lambda mb: training.training_step(model, optimizer, mb))
    assert step.capture(optimizer) is None
    layers = model.config.num_hidden_layers
    assert eager_masked[0] == 0 and step.masked_attention == 0, (eager_masked, step.masked_attention)
    record(f"{layers} attention calls eager and captured, {step.masked_attention} of them given a mask", 0.0, 0.0, True)


@needs_gpu
def test_a_failed_capture_gives_its_memory_back():
    """A capture that fails (out of memory, typically) leaves the run eager; the eager steps that follow must
    get the memory the capture took, not find it held in the failed graph's private pool."""
    weight = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    size = 256 * 2**20  # 1 GiB of fp32 per tensor the capture allocates

    def step_fn(micro_batches):
        held = [torch.full((size,), 1.5, device="cuda") for _ in range(2)]  # allocated in the graph's pool
        weight.grad = held[0][: weight.numel()].view_as(weight) * 2.0  # a gradient made in the pool, as a step's
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 448.00 MiB (raised by the test)")

    step = cuda_graph.GraphedStep(step_fn, [{"x": torch.zeros(1, device="cuda")}])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    reason = step.capture(optimizer)
    after = torch.cuda.memory_reserved()
    assert reason is not None and reason.startswith("OutOfMemoryError: CUDA out of memory"), reason
    assert step.graph is None and weight.grad is None
    # the capture reserved 2 GiB and more; everything above the reserve before it must be back with the driver
    # (the allocator's rounding of its own small blocks is far below 64 MiB)
    held = (after - before) / 2**20
    assert held < 64, f"{held:.0f} MiB still reserved after the failed capture"
    record(f"failed capture: reserved {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after "
           f"(2,048 MiB were allocated in it)", held, 64.0, True)


@needs_gpu
def test_a_resumed_run_replays_from_its_checkpoint(tmp_path):
    """Resume: the loaded optimizer is made capturable again; the continued curve matches the eager one."""
    out = tmp_path / "ckpt"
    base = [*BASE, "--lr-schedule", "constant", "--lr-warmup-steps", "0"]  # the same rates for 4 steps as for 8
    first = _run(base, "test_cuda_graph_resume_a", "--steps", "4", "--timing-warmup-steps", "1", "--output-dir",
                 str(out), "--cuda-graphs", "off")
    eager = _run(base, "test_cuda_graph_resume_b", "--cuda-graphs", "off")
    resumed = _run(base, "test_cuda_graph_resume_c", "--resume", str(out), "--output-dir", str(out),
                   "--timing-warmup-steps", "1")
    assert resumed["cuda_graphs"] == "replayed from step 6", resumed["cuda_graphs"]
    a, b = eager["losses"][4:], resumed["losses"][4:]
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert len(b) == STEPS - 4 and worst <= REL_TOL, (a, b, first["losses"])
    record(f"resumed at step 4, replayed from step 6: worst step {worst:.1e} rel. from eager", worst, REL_TOL, True)


def test_the_launch_queue_and_the_allocator_are_set_before_cuda_starts():
    """playbook.startup.start() sets CUDA_SCALE_LAUNCH_QUEUES=4x (a replayed LoRA step overflowed the default
    command buffer, and the replay call waited for the GPU) and PyTorch's expandable segments (the 8B full
    fine-tune at 4 x 2048 fits an 80 GB H100 with them only); values the user set are kept."""
    import os
    import subprocess
    import sys

    names = ("CUDA_SCALE_LAUNCH_QUEUES", "PYTORCH_CUDA_ALLOC_CONF")
    code = f"import os; from playbook.startup import start; start(kernels=False); print(*(os.environ.get(n) for n in {names!r}))"
    env = {k: v for k, v in os.environ.items() if k not in names}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    mine = dict(env, CUDA_SCALE_LAUNCH_QUEUES="2x", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    kept = subprocess.run([sys.executable, "-c", code], env=mine, capture_output=True, text=True, check=True).stdout.split()
    assert got == ["4x", "expandable_segments:True"], got
    assert kept == ["2x", "expandable_segments:False"], kept
    record(f"after playbook.startup.start(): {' '.join(got)} (a user's {' '.join(kept)} kept)", 0.0, 0.0, True)


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "CUDA graphs: when, why not, and the same training"))
