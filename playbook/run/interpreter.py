"""A real model on a CPU with the kernels on: say so before the first step, estimate the step, show progress.

Without a GPU, Triton runs every kernel in its interpreter: Python executes the kernel's code block by
block, program by program. That is what the tests and the llama-tiny demo need, and it is far too slow
for a real model: `finetune_optimized.py --model smollm2-135m` did not finish one step in 14 minutes on a
2-core CPU, where `--kernels none` takes seconds per step. So before the first step (and before the eval
loss and the sample answers, which run the same kernels) a CPU run that uses a kernel on any model but
the llama-tiny preset prints:

  - that the kernels run in Triton's interpreter, and what to do instead (`--kernels none`, or a GPU);
  - an estimate of one training step, from the run's own model and first micro-batch: one forward and
    backward through the model cut to its first decoder layer, with hooks timing that layer; the rest
    (embedding, final norm, the fused lm_head + loss) is what remains, and the step is the rest plus one
    layer's time for every layer, for every micro-batch. An extrapolation, and the run says so. The probe
    runs the real batch, not a slice of it: the interpreter's cost is mostly per program, and a program
    covers a block of rows, so a few tokens cost nearly as much as a full block (a 64-token probe
    predicted 14.6 min for a step that took 2 to 3);
  - an estimate of the whole run, from the same probe and one more (one token through the cut model, as
    each answer's tokens are decoded): the training steps, the eval passes (before the first step, every
    --eval-every steps and after the last: each a forward of every held-out batch), the sample answers
    before and after (--sample-prompts: prompts x up to MAX_NEW_TOKENS tokens each), and the checkpoints'
    disk (--output-dir);
  - and, while it trains, a heartbeat: a line at most every HEARTBEAT_S seconds naming the decoder layer
    the forward or backward pass has reached, so a step of minutes is not silence.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from core.process import is_main, log
from playbook.model.generate import MAX_NEW_TOKENS
from playbook.runtime.time_left import periodic_steps
from playbook.sections import RunConfig

HEARTBEAT_S = 30.0  # at most one progress line per this many seconds
HEARTBEAT_FROM_S = 60.0  # steps estimated shorter than this get no heartbeat


def applies(cfg: RunConfig, used: tuple) -> bool:
    """True for a CPU run whose kernels (registry.in_effect) run in the interpreter on a model other than the
    llama-tiny preset (the model the CPU demo is sized for)."""
    return not cfg.on_gpu and bool(used) and cfg.model.model != "llama-tiny"


def _layers_holder(model: nn.Module) -> nn.Module:
    """The module whose `.layers` is the decoder stack (a peft model's base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def _cut_to_first_layer_timed(model: nn.Module, run, clock) -> dict:
    """Run `run()` with the model cut to its first decoder layer, hooks timing that layer: {"total", "forward"
    (the whole forward, until `run` says so through the returned mark), "layer_forward", "layer_backward"}.
    Leaves the model, its gradients and the random state as they were."""
    holder = _layers_holder(model)
    layers = holder.layers
    first = layers[0]
    marks = {}

    def mark(name):
        marks.setdefault(name, clock())

    def before(module, args, kwargs):
        mark("forward in")
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.requires_grad:  # its gradient is the layer's backward done
            x.register_hook(lambda g: mark("backward out"))

    def after(module, args, out):
        mark("forward out")
        y = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(y, torch.Tensor) and y.requires_grad:  # its gradient starts the layer's backward
            y.register_hook(lambda g: mark("backward in"))

    handles = [first.register_forward_pre_hook(before, with_kwargs=True), first.register_forward_hook(after)]
    try:
        with torch.random.fork_rng(devices=[]):
            holder.layers = nn.ModuleList([first])
            t0 = clock()
            run(lambda: mark("model out"))
            end = clock()
    finally:
        for h in handles:
            h.remove()
        holder.layers = layers
        model.zero_grad(set_to_none=True)
    forward_end = marks.get("model out", end)
    return {"total": end - t0, "forward": forward_end - t0,
            "layer_forward": marks.get("forward out", t0) - marks.get("forward in", t0),
            "layer_backward": marks.get("backward out", end) - marks.get("backward in", end)}  # (frozen input: to the end)


def estimate_step_seconds(model: nn.Module, batch: dict, grad_accum: int, clock=time.perf_counter) -> dict:
    """Seconds for one training step (forward and backward of every micro-batch; the optimizer, PyTorch's on a
    CPU, is left out), extrapolated from one forward and backward of `batch` through the model cut to its first
    decoder layer: hooks time that layer's forward and backward, the rest (embedding, final norm, the fused
    lm_head + loss) is what remains. Leaves the model, its gradients and the random state as they were.
    Returns {"step_s", "layer_s" (forward + backward of one layer), "rest_s", "forward_s" (one forward of `batch`
    through the whole model: an eval batch), "layers", "tokens"}."""
    layers = len(_layers_holder(model).layers)

    def run(forward_done):
        loss = model(input_ids=batch["input_ids"], labels=batch.get("labels", batch["input_ids"])).loss
        forward_done()
        loss.backward()

    t = _cut_to_first_layer_timed(model, run, clock)
    layer_s = max(t["layer_forward"] + t["layer_backward"], 0.0)
    rest_s = max(t["total"] - layer_s, 0.0)
    forward_s = max(t["forward"] - t["layer_forward"], 0.0) + layers * max(t["layer_forward"], 0.0)
    return {"step_s": grad_accum * (rest_s + layers * layer_s), "layer_s": layer_s, "rest_s": rest_s,
            "forward_s": forward_s, "layers": layers, "tokens": batch["input_ids"].numel() * grad_accum}


def estimate_token_seconds(model: nn.Module, batch: dict, clock=time.perf_counter) -> float:
    """Seconds for one decoded token of an answer: one token of `batch` forward through the model cut to its
    first decoder layer, without gradients, the layer's time counted once for every layer. (In the interpreter a
    program costs about the same for one row as for a block of them, so the prompt's own forward costs about
    one token more.)"""
    layers = len(_layers_holder(model).layers)

    def run(forward_done):
        with torch.no_grad():
            model(input_ids=batch["input_ids"][:1, :1])
        forward_done()

    t = _cut_to_first_layer_timed(model, run, clock)
    return max(t["forward"] - t["layer_forward"], 0.0) + layers * max(t["layer_forward"], 0.0)


def checkpoint_bytes(model: nn.Module) -> dict:
    """What one checkpoint of the scripts (playbook/store/checkpoint.py) holds, before the first one is written:
    {"weights": the saved weights (an adapter's only, for a peft model), "optimizer": AdamW's two moments, one of
    each trainable parameter's size and dtype}."""
    adapter = hasattr(model, "get_base_model")
    seen, weights = set(), 0
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.data_ptr() in seen or (adapter and not p.requires_grad):
            continue
        seen.add(p.data_ptr())
        weights += p.numel() * p.element_size()
    optimizer = sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"weights": weights, "optimizer": optimizer}


def run_plan(cfg: RunConfig, data, start: int, steps: int, prompts: int) -> dict:
    """How often each part of the run happens (training.py's rules): {"steps", "evals" (eval passes),
    "eval_batches" (per pass), "answers" (prompts answered, before and after), "saves"}."""
    eval_batches = len(data.eval_batches("cpu")) if hasattr(data, "eval_batches") else 0
    todo = steps - start
    evals = (start == 0) + periodic_steps(cfg.data.eval_every, start + 1, steps) if eval_batches else 0
    saves = periodic_steps(cfg.output.save_every, start + 1, steps) if cfg.output.output_dir is not None else 0
    return {"steps": max(todo, 0), "evals": evals, "eval_batches": eval_batches,
            "answers": prompts * ((start == 0) + 1) if prompts and todo > 0 else 0, "saves": saves}


def run_seconds(est: dict, token_s: float, plan: dict, max_new_tokens: int) -> dict:
    """The whole run's seconds by part: {"steps", "evals", "answers", "total"} (saves: seconds, left out)."""
    parts = {"steps": plan["steps"] * est["step_s"],
             "evals": plan["evals"] * plan["eval_batches"] * est["forward_s"],
             "answers": plan["answers"] * (max_new_tokens + 1) * token_s}
    return {**parts, "total": sum(parts.values())}


def duration(seconds: float) -> str:
    """'45 s', '3.2 min', '1.4 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread now."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class Heartbeat:
    """Forward pre-hooks on the decoder layers, and a hook on each layer's output gradient (the backward pass
    reaching that layer): a line at most every `every_s` seconds saying where the work is."""

    def __init__(self, model: nn.Module, grad_accum: int, first_step: int, every_s: float = HEARTBEAT_S, clock=None):
        self.layers = list(_layers_holder(model).layers)
        self.grad_accum, self.first_step, self.every_s = grad_accum, first_step, every_s
        self.clock = clock or time.perf_counter
        self.micro_batches = 0  # training forward passes begun
        self.started = self.last = self.clock()
        self.handles = []
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._forward(i)))
            self.handles.append(layer.register_forward_hook(lambda m, a, out, i=i: self._watch_backward(i, out)))

    def _forward(self, i: int) -> None:
        if _in_backward():  # gradient checkpointing runs the layer again inside backward
            self._beat(i, "backward (recomputing the layer)")
            return
        if i == 0 and torch.is_grad_enabled():  # a training micro-batch begins
            if self.micro_batches % self.grad_accum == 0:
                self.started = self.clock()
            self.micro_batches += 1
        self._beat(i, "forward" if torch.is_grad_enabled() else "forward without gradients (eval loss or answers)")

    def _watch_backward(self, i: int, out) -> None:
        t = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad, i=i: self._beat(i, "backward"))

    def _beat(self, i: int, what: str) -> None:
        now = self.clock()
        if now - self.last < self.every_s or not is_main():
            return
        self.last = now
        if what.startswith("forward without"):
            log(f"  ... {what}: decoder layer {i + 1} of {len(self.layers)}")
            return
        step = self.first_step + (self.micro_batches - 1) // self.grad_accum
        micro = "" if self.grad_accum == 1 else f", micro-batch {(self.micro_batches - 1) % self.grad_accum + 1}"
        log(f"  ... step {step}{micro}, {what}: decoder layer {i + 1} of {len(self.layers)}, "
            f"{duration(now - self.started)} into the step")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def saves_note(cfg: RunConfig, model: nn.Module, plan: dict) -> None:
    """Before the first save: how many checkpoints the run writes, and the disk each takes."""
    if not plan["saves"] or not is_main():
        return
    size = checkpoint_bytes(model)
    log(f"Checkpoints: {plan['saves']} to {cfg.output.output_dir}, ~{_mb(size['weights'] + size['optimizer'])} each "
        f"(weights {_mb(size['weights'])}, optimizer state {_mb(size['optimizer'])})"
        + (f"; --save-total-limit {cfg.output.save_total_limit} keeps the newest" if cfg.output.save_total_limit
           else ""))


def before_training(cfg: RunConfig, model: nn.Module, used: tuple, data, first_step: int, steps: int | None = None,
                    clock=time.perf_counter) -> Heartbeat | None:
    """Say how many checkpoints the run writes and their size; then, where `applies`: print the notice with the
    estimated step time and the whole run's, and return the heartbeat it installed (None for a step estimated
    under HEARTBEAT_FROM_S). Elsewhere: nothing more, None."""
    steps = first_step if steps is None else steps
    prompts = 0
    if cfg.output.sample_prompts is not None:
        from playbook.model import generate

        prompts = len(generate.read_prompts(cfg.output.sample_prompts))
    plan = run_plan(cfg, data, first_step - 1, steps, prompts)
    saves_note(cfg, model, plan)
    if not applies(cfg, used):
        return None
    log(f"note: without a GPU the kernels ({', '.join(used)}) run in Triton's interpreter, which executes each "
        "kernel in Python: fine for the tests and the llama-tiny demo, and far slower than PyTorch's own CPU "
        "operators on a model of this size. Estimating the step: the first micro-batch through the model cut to "
        "one decoder layer ...")
    if cfg.training.optimizer_in_backward:  # a backward would update the weights: no probe
        log("note: no estimate of the step time (--optimizer-in-backward updates the weights in every backward). "
            "To train this model on a CPU, drop the kernels: --kernels none; to train it with them, use a GPU.")
        return Heartbeat(model, cfg.training.grad_accum, first_step)
    batch = data.batch(0, cfg.run.device)
    est = estimate_step_seconds(model, batch, cfg.training.grad_accum, clock=clock)
    log(f"note: estimated time per training step here: ~{duration(est['step_s'])} (an extrapolation: one decoder "
        f"layer took {est['layer_s']:.1f} s forward and backward, the embedding, final norm and lm_head + loss "
        f"{est['rest_s']:.1f} s; x {est['layers']} layers, x {cfg.training.grad_accum} micro-batches, {est['tokens']:,} tokens "
        "per step); "
        "the eval loss and the sample answers run the same kernels. To train this model on a CPU, drop the "
        "kernels: --kernels none (or finetune_baseline.py); to train it with them, use a GPU.")

    token_s = estimate_token_seconds(model, batch, clock=clock) if plan["answers"] else 0.0
    secs = run_seconds(est, token_s, plan, MAX_NEW_TOKENS)
    parts = [f"{plan['steps']} step(s) {duration(secs['steps'])}"]
    if plan["evals"]:
        parts.append(f"{plan['evals']} eval pass(es) of {plan['eval_batches']} batch(es) {duration(secs['evals'])} "
                     f"(~{duration(est['forward_s'])} a batch)")
    if plan["answers"]:
        parts.append(f"{plan['answers']} sample answer(s) of up to {MAX_NEW_TOKENS} tokens {duration(secs['answers'])} "
                     f"(~{token_s:.1f} s a token)")
    if plan["saves"]:
        parts.append(f"{plan['saves']} checkpoint save(s) (not timed here: their disk is on the Checkpoints line)")
    log(f"note: estimated time of the whole run here: ~{duration(secs['total'])}: " + ", ".join(parts) + ".")
    if est["step_s"] < HEARTBEAT_FROM_S:
        return None
    log(f"A line at most every {HEARTBEAT_S:.0f} s says which decoder layer the step has reached.")
    return Heartbeat(model, cfg.training.grad_accum, first_step)
