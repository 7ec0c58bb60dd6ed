"""Tests of the fine-tuning workflow: kernels patched in correctly, the same training curve, and the
parts of a real fine-tuning run (accumulation, schedules, checkpoints and resume, compile).

    $ PYTHONPATH=. python tests/finetune_test.py       # a readable report
    $ pytest tests/finetune_test.py

Loss parity, the test that matters most: the baseline and the optimized model start from the same
seed and see the same batches (real text from a file of this repository, so the loss actually
falls) for 20 AdamW steps. bf16 training is not bit-reproducible across implementations, so the
test asks what testkit/__init__.py asks of every kernel: the optimized bf16 run may be at most twice as far
from an fp32 baseline run as the plain PyTorch bf16 run is, plus one bf16 ulp; for the loss at
every step and for every final parameter tensor.
"""

import contextlib
import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import pytest
import torch

from playbook.memory import options
from playbook.model import registry as ak
from playbook.runtime import common
from playbook.plan import oom
from playbook.store.files import RESULTS_DIR
from playbook.model import models
from playbook.run import training
from rmsnorm_kernel import TritonRMSNorm
from playbook.config import PROFILE, make_parser, parse_config
from playbook.model.presets import DEFAULT_MODEL, PRESETS
from core.kernel_utils import DEVICE  # the GPU where there is one (the kernels compile for it), else the CPU
import testkit
from testkit import close_to_reference, python_path, record, run_as_script, two_process_env
from playbook.optim.optimizer import make_optimizer
from playbook.run.start import make_run_data, batch_attention
from playbook.optim.schedule import LRSchedule

HERE = Path(__file__).resolve().parent.parent  # the repository root
STEPS = 12
TEXT = HERE / "examples" / "chat.jsonl"  # real text the tiny model can learn, in a file no code change edits


def config(*argv, script="finetune_optimized"):
    """A RunConfig from command-line words, exactly as the scripts build it, for the llama-tiny preset
    unless argv names another model (the default model is the 8B on a GPU)."""
    return parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), script,
                        ["--model", "llama-tiny", *argv])


def tiny(num_layers=None, dtype=torch.float32):
    return models.build_preset("llama-tiny", num_layers, DEVICE, dtype)


def text_data(cfg, model):
    return make_run_data(cfg, model, None)


@functools.lru_cache(maxsize=None)
def _train(kernels: str, dtype: torch.dtype, in_backward: bool = False):
    """Train the tiny preset for STEPS steps on the machine's device; return the loss curve and final
    parameters. Every run uses PyTorch's AdamW (foreach), named here: on a GPU the default set would
    switch the kernel run to the Triton AdamW, whose own parity adamw_test.py checks."""
    cfg = config("--kernels", kernels, "--batch-size", "4", "--seq-len", "64", "--data", str(TEXT), "--lr", "1e-3",
                 "--steps", str(STEPS), "--optimizer", "adamw-foreach",
                 *(["--optimizer-in-backward"] if in_backward else []))
    model = tiny(dtype=dtype)
    model.config.use_cache = False
    model.train()
    ak.apply_kernels(model, cfg.model.kernels)
    opt = make_optimizer(model, cfg.training, cfg.run)
    data = text_data(cfg, model)
    losses = [training.training_step(model, opt, [data.batch(i, DEVICE)])[0].float() for i in range(STEPS)]
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


# The optimizer-in-backward variant makes the same updates as AdamW after backward (checked exactly,
# in fp32, by test_optimizer_in_backward), so it needs no training run of its own here.
RUNS = [pytest.param("default", False, id="all kernels"),
        pytest.param("rmsnorm,cross_entropy,swiglu", False, id="cross-entropy on logits")]

# A child process runs `_train` for one kernel run and saves (losses, final parameters) to argv[3].
_TRAIN_IN_CHILD = ("import sys, torch, finetune_test as t; "
                   "torch.save(t._train(sys.argv[1], torch.bfloat16, sys.argv[2] == '1'), sys.argv[3])")


def _set_nice(proc, nice: int) -> None:
    """Set a child's nice value, where the OS allows it (raising it always; lowering it takes root)."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no os.setpriority (Windows)
        os.setpriority(os.PRIO_PROCESS, proc.pid, nice)


def start_kernel_runs(items, tmp: Path) -> dict:
    """Start, each in a child process, the kernel runs that the selected loss-parity tests `items`
    need: {(kernels, bf16, in_backward): (process, result file, log file)}. conftest.py calls this when
    the session starts; `parity_runs` collects the results.

    Why: a kernel run keeps one core busy for one to two minutes on a CPU (its kernels run in Triton's
    interpreter, single-threaded Python), and the rest of the suite, one test after another, mostly
    keeps only one core busy too. Trained in child processes from the session's start, at a lower
    priority, the kernel runs use the cores the other tests leave idle. A child calls the same
    `_train` with the same arguments in the same environment (seed, data, step count, thread
    settings, transformers' own RoPE to start from, as conftest.py restores it after every test), so
    its losses and parameters are bit for bit those the run gives in this process (checked on this
    file's two kernel runs); only where and when the runs train changes."""
    wanted = sorted({(item.callspec.params["kernels"], item.callspec.params["in_backward"]) for item in items})
    children = {}
    for i, (kernels, in_backward) in enumerate(wanted):
        out, log = tmp / f"run{i}.pt", tmp / f"run{i}.log"
        with open(log, "w") as log_file:  # a file, not a pipe: a full pipe would stall the child
            proc = subprocess.Popen([sys.executable, "-c", _TRAIN_IN_CHILD, kernels, "1" if in_backward else "0",
                                     str(out)], cwd=HERE, stdout=log_file, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": python_path(HERE, HERE / "tests")})
        _set_nice(proc, 10)  # a lower priority: the run takes only the CPU time the tests leave idle
        children[kernels, torch.bfloat16, in_backward] = (proc, out, log)
    return children


@pytest.fixture(scope="module")
def parity_runs(kernel_runs_in_background):
    """Every run the loss-parity tests compare, trained once: a function (kernels, dtype, in_backward)
    -> (losses, final parameters), as `_train` returns them. The two baselines (a few seconds) train
    here; the kernel runs come from the child processes that conftest.py starts (start_kernel_runs)."""
    children = kernel_runs_in_background()  # started at the session's start, or now (in an xdist worker)
    runs = {key: _train(*key) for key in (("none", torch.float32, False), ("none", torch.bfloat16, False))}
    for proc, _, _ in children.values():
        # From here this process only waits: a run still training gets its normal priority back, so
        # that other load on the machine cannot starve it (where the OS allows; elsewhere it goes on
        # at nice 10, which an otherwise idle machine runs at full speed)
        _set_nice(proc, 0)
    for key, (proc, out, log) in children.items():
        code = proc.wait(timeout=1800)
        assert code == 0, f"training run {key} failed in its child process:\n{log.read_text()[-3000:]}"
        runs[key] = torch.load(out, map_location=DEVICE)
    return lambda kernels, dtype, in_backward=False: runs[kernels, dtype, in_backward]


def test_registry_names_and_report():
    """One spelling per kernel, one default; the report counts what was replaced."""
    assert ak.KERNEL_NAMES == ("rmsnorm", "cross_entropy", "linear_cross_entropy", "swiglu", "rope", "projections")
    for name in ak.KERNEL_NAMES:  # every registered kernel has its two files
        assert (HERE / f"{name}_kernel.py").is_file() and (HERE / f"{name}_test.py").is_file(), name
    model = tiny()
    report = ak.apply_kernels(model)  # the default set
    assert report.names == ak.DEFAULT_KERNELS
    norms = [m for m in model.modules() if isinstance(m, TritonRMSNorm)]
    assert report.replaced["rmsnorm"] == len(norms) == 2 * 2 + 1, "2 per layer + the final norm"
    assert report.replaced["swiglu"] == 2
    assert report.replaced["projections"] == 2 * 2, "q/k/v and gate/up joined in each layer"
    assert "rmsnorm x5" in report.describe()
    record("2 layers: 5 RMSNorms, 2 MLPs, 4 projection groups, the head and RoPE patched; report counts them",
           0.0, 0.0, True)


def test_kernel_list_errors():
    with pytest.raises(ValueError, match="choose one of cross_entropy / linear_cross_entropy"):
        ak.parse_kernels("rmsnorm,cross_entropy,linear_cross_entropy")
    with pytest.raises(ValueError, match="peer"):
        ak.parse_kernels("liger,rmsnorm")
    with pytest.raises(ValueError, match="unknown kernel name.*fast.*rmsnorm"):
        ak.parse_kernels("rmsnorm,fast")
    with pytest.raises(ValueError, match="twice"):
        ak.parse_kernels("rope,rope")
    for spec in ("rmsnorm,,swiglu", "rmsnorm,", ",rope"):  # a name left out: an unset shell variable, say
        with pytest.raises(ValueError, match="empty kernel name"):
            ak.parse_kernels(spec)
    assert ak.parse_kernels("liger") == ("liger",) and ak.parse_kernels("none") == ()
    assert ak.parse_kernels("rope,rmsnorm") == ("rmsnorm", "rope"), "registry order, whatever the order given"
    assert ak.parse_kernels("default") == ak.DEFAULT_KERNELS


def test_fused_head_and_rope_match_hugging_face():
    """linear_cross_entropy + rope on LLaMA: same loss and gradients as HF, with -100 labels and
    num_items_in_batch; no logits are returned when labels are given, HF's logits when they are not."""
    base, ours = tiny(2), tiny(2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, base.config.vocab_size, (2, 16), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    results = {}
    for tag, model in (("hf", base), ("ours", ours)):
        if tag == "ours":
            report = ak.apply_kernels(model, "linear_cross_entropy,rope")
            assert report.replaced == {"linear_cross_entropy": 1, "rope": 1}
        for n_items in (None, torch.tensor(23, device=DEVICE)):
            model.zero_grad()
            out = model(input_ids=ids, labels=labels, num_items_in_batch=n_items)
            out.loss.backward()
            results[tag, n_items is None] = (out.loss.detach(), model.lm_head.weight.grad.clone(),
                                             model.model.layers[0].self_attn.q_proj.weight.grad.clone(), out.logits)
        with torch.no_grad():
            results[tag, "logits"] = model(input_ids=ids).logits
    for mean in (True, False):
        (l_ours, w_ours, q_ours, logits), (l_hf, w_hf, q_hf, _) = results["ours", mean], results["hf", mean]
        what = "mean" if mean else "sum / num_items"
        assert logits is None, "with labels, the fused head returns no logits"
        # factor=0: fp32 against fp32 on identical inputs, only rounding-order differences (ulp + sqrt(n) terms)
        close_to_reference(f"loss ({what})", l_ours, l_hf, l_hf.double(), torch.float32, n=512, factor=0)
        close_to_reference(f"lm_head grad ({what})", w_ours, w_hf, w_hf.double(), torch.float32, n=32, factor=0)
        close_to_reference(f"layer-0 q_proj grad, through RoPE ({what})", q_ours, q_hf, q_hf.double(),
                           torch.float32, n=32, factor=0)
    close_to_reference("logits without labels", results["ours", "logits"], results["hf", "logits"],
                       results["hf", "logits"].double(), torch.float32, n=64, factor=0)


def test_cross_entropy_on_logits_equals_hugging_face_loss():
    """The patched loss_function: same value and gradients as HF's ForCausalLMLoss (shift, -100, num_items)."""
    base, ours = tiny(1), tiny(1)
    ak.apply_kernels(ours, "cross_entropy")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 9), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    for n_items in (None, torch.tensor(11, device=DEVICE)):
        losses, grads = [], []
        for model in (ours, base):
            model.zero_grad()
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append(model.model.norm.weight.grad.clone())
        close_to_reference(f"HF causal-LM loss, num_items={n_items}", losses[0], losses[1], losses[1].double(),
                           torch.float32, n=512, factor=0)  # fp32 vs fp32: rounding order only
        close_to_reference(f"final-norm grad, num_items={n_items}", grads[0], grads[1], grads[1].double(),
                           torch.float32, n=18, factor=0)


def test_fused_head_with_tied_embeddings():
    """LLaMA 3.2-style tied embeddings: the fused head must use (and train) the shared weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**PRESETS["llama-tiny"], "tie_word_embeddings": True})
    torch.manual_seed(3)
    base = LlamaForCausalLM(cfg).to(DEVICE)
    ours = LlamaForCausalLM(cfg).to(DEVICE)
    ours.load_state_dict(base.state_dict())
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr(), "weights must be tied"
    ak.apply_kernels(ours, "linear_cross_entropy")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    losses, grads = [], []
    for model in (ours, base):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.model.embed_tokens.weight.grad)
    close_to_reference("tied: loss", losses[0], losses[1], losses[1].double(), torch.float32, n=cfg.vocab_size, factor=0)
    close_to_reference("tied: embedding gradient (lookup + head)", grads[0], grads[1], grads[1].double(),
                       torch.float32, n=24, factor=0)


def test_gradient_accumulation_scales_by_tokens():
    """Two micro-batches with different numbers of target tokens: the accumulated gradient equals the
    gradient of the token mean over both (not the mean of the two micro-batch means)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 512, (4, 16), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :12] = -100  # micro-batch 1 keeps few targets, micro-batch 2 all of them
    labels[1, :10] = -100
    full, acc = tiny(1), tiny(1)
    for model in (full, acc):
        ak.apply_kernels(model, "rmsnorm,linear_cross_entropy")
    full(input_ids=ids, labels=labels).loss.backward()  # HF mean over all target tokens of the batch
    micro = [{"input_ids": ids[:2], "labels": labels[:2]}, {"input_ids": ids[2:], "labels": labels[2:]}]
    assert int(training.count_targets(micro)) == int((labels[:, 1:] != -100).sum()) == 4 * 15 - 11 - 9
    n = training.count_targets(micro)
    for b in micro:
        acc(**b, num_items_in_batch=n).loss.backward()
    naive = tiny(1)
    ak.apply_kernels(naive, "rmsnorm,linear_cross_entropy")
    for b in micro:
        (naive(**b).loss / 2).backward()  # the mean of means: what a naive loop does
    p = "model.layers.0.mlp.down_proj.weight"
    grads = {name: dict(m.named_parameters())[p].grad for name, m in (("full", full), ("acc", acc), ("naive", naive))}
    close_to_reference("accumulated grad == full-batch grad", grads["acc"], grads["full"], grads["full"].double(),
                       torch.float32, n=64, factor=0)  # fp32, same math in another order
    assert (grads["naive"] - grads["full"]).abs().max() > 100 * (grads["acc"] - grads["full"]).abs().max(), \
        "the test must tell token scaling from micro-batch averaging"


def test_learning_rate_schedules():
    for kind, mid, last in (("constant", 1.0, 1.0), ("linear", 0.5, 0.1), ("cosine", 0.5, 0.0244717)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
        s = LRSchedule(opt, total_steps=12, warmup_steps=2, kind=kind)
        assert s.factor(0) == 0.5 and s.factor(1) == 1.0, "linear warm-up over 2 steps"
        assert abs(s.factor(7) - mid) < 1e-6 and abs(s.factor(11) - last) < 1e-6, (kind, s.factor(7), s.factor(11))
        assert abs(s.apply(7) - 0.1 * mid) < 1e-9 and abs(opt.param_groups[0]["lr"] - 0.1 * mid) < 1e-9
        # the applied rate as the metrics row and the step line give it
        assert s.metrics() == {"lr": s.rate} and s.text() == f"lr {0.1 * mid:.2e}", (s.metrics(), s.text())
    record("constant / linear / cosine with warm-up", 0.0, 0.0, True)


def test_optimizer_in_backward():
    """Same updates as AdamW after backward; no gradient left after the step; accumulation refused."""
    params = {}
    for in_backward in (False, True):
        cfg = config("--data", str(TEXT), "--kernels", "none", "--batch-size", "2", "--seq-len", "64",
                     *(["--optimizer-in-backward"] if in_backward else []))
        model = tiny(1)
        opt = make_optimizer(model, cfg.training, cfg.run)
        data = text_data(cfg, model)
        for i in range(3):
            training.training_step(model, opt, [data.batch(i, DEVICE)])
        params[in_backward] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if in_backward:
            assert all(p.grad is None for p in model.parameters()), "gradients must be freed in backward"
            with pytest.raises(RuntimeError, match="accumulation"):  # two backwards, no step in between
                for _ in range(2):
                    model(**data.batch(0, DEVICE)).loss.backward()
    for name, p in params[False].items():
        close_to_reference(name, params[True][name], p, p.double(), torch.float32, factor=0)
    for clash in (["--max-grad-norm", "1"], ["--grad-accum", "2"]):
        with pytest.raises(SystemExit) as info:
            config("--optimizer-in-backward", *clash)
        assert info.value.code == 2
    record("in-backward AdamW == AdamW after backward; grads freed; clip/accumulation refused", 0.0, 0.0, True)


def test_out_of_memory_is_recognised():
    """cuBLAS reports a full GPU as a RuntimeError; it must get the same advice as PyTorch's OOM."""
    assert common.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert common.is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not common.is_out_of_memory(RuntimeError("shape mismatch"))
    assert "--batch-size" in oom.oom_message(config(), RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"))


def test_out_of_memory_advice_names_what_the_run_left_out():
    """The advice lists the memory options the run does not use yet, and none it already uses."""
    import dataclasses

    def advice(*argv, **fields):
        cfg = config(*argv).changed(**fields)
        return oom.oom_message(cfg, torch.cuda.OutOfMemoryError("CUDA out of memory."))

    full = advice("--seq-len", "2048")
    for want in ("--gradient-checkpointing", "--optimizer-in-backward", "--lora-r 16", "docs/memory.md"):
        assert want in full, (want, full)
    assert "--offload-activations" not in full and "--mlp-chunk-tokens" not in full and "--load-in-4bit" not in full
    lora = advice("--lora-r", "16", "--gradient-checkpointing", "--seq-len", "32768")
    for want in ("--offload-activations", "--mlp-chunk-tokens 16384", "--load-in-4bit"):
        assert want in lora, (want, lora)
    assert "--optimizer-in-backward" not in lora and "--lora-r 16 instead" not in lora
    assert "--gradient-checkpointing (" not in lora
    # QLoRA set on the config itself: the command line refuses --load-in-4bit where bitsandbytes is not
    # installed, and the advice does not depend on the package
    longest = advice("--lora-r", "16", "--gradient-checkpointing", "--offload-activations",
                     "--mlp-chunk-tokens", "16384", "--seq-len", "32768", load_in_4bit=True)
    for gone in ("--offload-activations", "--mlp-chunk-tokens", "--load-in-4bit", "--gradient-checkpointing ("):
        assert gone not in longest, (gone, longest)
    assert "--batch-size" in longest and "torchrun" in longest and "--keep-attention" not in longest
    kept = advice("--lora-r", "16", "--gradient-checkpointing", "--keep-attention", "--seq-len", "32768")
    assert "no --keep-attention" in kept, kept
    record("out-of-memory advice: full fine-tune, LoRA with checkpointing, QLoRA with every option", 0.0, 0.0, True)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_apply_kernels_on_other_families(family):
    """Same-family models are patched too (Qwen3 adds q_norm / k_norm: 4 per layer + 1)."""
    import transformers

    cfg_cls = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family]
    lm_cls = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    cfg = getattr(transformers, cfg_cls)(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    base = getattr(transformers, lm_cls)(cfg).to(DEVICE).eval()
    patched = getattr(transformers, lm_cls)(cfg).to(DEVICE).eval()
    patched.load_state_dict(base.state_dict())
    ids = torch.randint(0, 128, (2, 12)).to(DEVICE)
    with torch.no_grad():
        ref = base(input_ids=ids, labels=ids).loss  # before patching: RoPE is a module-level swap
    report = ak.apply_kernels(patched)
    assert report.replaced["rmsnorm"] == (4 if family == "qwen3" else 2) * 2 + 1
    assert report.replaced["swiglu"] == 2
    with torch.no_grad():
        ours = patched(input_ids=ids, labels=ids).loss
    # fp32 vs fp32 on identical weights: only rounding order differs
    close_to_reference(f"{family}: loss with kernels vs without", ours, ref, ref.double(), torch.float32, n=128, factor=0)


def test_unsupported_model_is_refused_clearly():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(NotImplementedError, match="gpt2"):
        ak.apply_kernels(model)


@contextlib.contextmanager
def _offline():
    import huggingface_hub.constants as hub

    old, old_const = os.environ.get("HF_HUB_OFFLINE"), hub.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"  # fail fast and the same way with or without a network
    hub.HF_HUB_OFFLINE = True  # the hub reads the variable once, at import time
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = old_const
        os.environ.pop("HF_HUB_OFFLINE") if old is None else os.environ.__setitem__("HF_HUB_OFFLINE", old)


def test_default_model_unavailable_falls_back_to_the_preset():
    """No token / offline: one clear paragraph, then the 8B preset (here on the meta device)."""
    import dataclasses

    cfg = config("--num-layers", "1").changed(model=DEFAULT_MODEL, model_explicit=False, device=torch.device("meta"))
    printed = io.StringIO()
    with _offline(), contextlib.redirect_stdout(printed):
        model, name, desc = models.load_model(cfg)
    out = printed.getvalue()
    assert name == "llama-3.1-8b" and "unavailable" in desc
    assert model.config.hidden_size == 4096 and model.config.num_hidden_layers == 1
    assert "HF_TOKEN" in out and "loss values are not meaningful" in out, out
    record("fallback to the llama-3.1-8b preset with advice", 0.0, 0.0, True)


def test_explicit_unavailable_model_is_a_clear_error():
    """A gated model without a token (or offline) ends with advice, not a traceback; a missing local
    directory is named as such (not as a bad hub id)."""
    with _offline(), pytest.raises(SystemExit) as info:
        models.load_model(config("--model", "meta-llama/Llama-3.1-8B"))
    assert "HF_TOKEN" in str(info.value) and "--model llama-3.1-8b" in str(info.value), info.value
    with pytest.raises(SystemExit, match="no such local directory"):
        models.load_model(config("--model", "./no/such/model_dir"))
    record("clear advice instead of a traceback", 0.0, 0.0, True)


def test_preset_matches_llama_3_1_8b():
    """The preset has the real architecture: build it on the meta device and count parameters."""
    from transformers import LlamaForCausalLM

    cfg = models.preset_config("llama-3.1-8b")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    n = models.count_params(model)
    assert n == 8_030_261_248, f"LLaMA 3.1 8B has 8,030,261,248 parameters, the preset {n:,}"
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.num_key_value_heads == 8
    record(f"preset has {n:,} parameters", 0.0, 0.0, True)


def _run(*argv, tag):
    """One whole run of finetune_optimized in this process; returns the summary JSON."""
    cfg = config("--tag", tag, "--overwrite", *argv)
    try:
        return training.train(cfg)
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)


def test_resume_reproduces_the_uninterrupted_curve(tmp_path):
    """Train 2N steps saving at N; resume from step N and train to 2N: the same losses at every step."""
    out = tmp_path / "ckpt"
    args = ["--data", str(TEXT), "--steps", "4", "--timing-warmup-steps", "1", "--lr", "1e-3", "--lr-schedule", "cosine",
            "--lr-warmup-steps", "1", "--grad-accum", "2", "--kernels", "rmsnorm,linear_cross_entropy",
            "--batch-size", "2", "--seq-len", "32", "--output-dir", str(out)]
    whole = _run(*args, "--save-every", "2", tag="test_resume_whole")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (out / "latest").read_text().strip().endswith("checkpoint-4")
    resumed = _run(*args, "--resume", str(out / "checkpoint-2"), tag="test_resume_second")
    assert len(resumed["losses"]) == 4
    # identical data, RNG, optimizer and schedule state: the same float32 arithmetic in the same order
    assert resumed["losses"] == whole["losses"], (resumed["losses"], whole["losses"])
    record("2N steps == N + resume + N (bit for bit)", 0.0, 0.0, True)


@pytest.mark.parametrize("kernels", ["default"])  # (cross_entropy's own tests compile it: cross_entropy_test.py)
def test_compile_matches_eager(kernels):
    """--compile with the kernels: the compiled model's losses follow the eager ones."""
    args = ["--data", str(TEXT), "--steps", "3", "--timing-warmup-steps", "1", "--kernels", kernels, "--lr", "1e-3",
            "--batch-size", "2", "--seq-len", "32"]
    eager = _run(*args, tag="test_compile_eager")
    compiled = _run(*args, "--compile", tag="test_compile_compiled")
    # identical inputs: inductor reorders and fuses the surrounding math, so each loss may move by rounding
    # noise that grows over steps. On a CPU the tiny model is fp32: 1e-4 relative, far above fp32 reordering
    # noise (~1e-6). On a GPU it trains in bf16 (8 mantissa bits): up to one bf16 ulp of the loss, 2^-8
    # relative. Both are far below the loss change of one training step here (~2%)
    tol = 2.0**-8 if torch.cuda.is_available() else 1e-4
    for a, b in zip(compiled["losses"], eager["losses"]):
        assert abs(a - b) <= tol * abs(b), (compiled["losses"], eager["losses"])
    record(f"--compile ({kernels}): losses match eager", max(abs(a - b) for a, b in
                                                             zip(compiled["losses"], eager["losses"])), 0.0, True)


def _trainer_rows(tmp_path):
    rows = tmp_path / "chat.jsonl"
    qa = [("What is 2 + 2?", "4."), ("Name a colour.", "Blue."), ("Capital of France?", "Paris."),
          ("Opposite of hot?", "Cold."), ("A fruit?", "An apple."), ("Say hi.", "Hi!")] * 3
    rows.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                         {"role": "assistant", "content": a}]}) for q, a in qa))
    return rows


def test_trainer_uses_the_fused_loss(tmp_path, monkeypatch, capsys):
    """The Hugging Face Trainer passes labels to the model: its loss must come from the fused linear
    cross-entropy (counted here), and training must lower it."""
    import finetune_trainer
    import linear_cross_entropy_kernel as lce

    calls = []
    fused = lce.linear_cross_entropy
    monkeypatch.setattr(lce, "linear_cross_entropy", lambda *a, **k: calls.append(a[0].shape) or fused(*a, **k))
    rows = _trainer_rows(tmp_path)
    trainer, metrics = finetune_trainer.main(["--model", "llama-tiny", "--dataset", str(rows), "--steps", "6",
                                              "--lr", "3e-3", "--seq-len", "64", "--batch-size", "2", "--log-every", "1", "--output-dir", str(tmp_path / "o")])
    printed = capsys.readouterr().out
    assert "18 rows: 18 kept whole" in printed and "17 train, 1 eval" in printed, printed  # the real split (5% held out)
    assert "1 process" in printed, printed
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(calls) >= 6, f"the fused loss ran {len(calls)} times in 6 steps"
    assert losses[-1] < losses[0], losses
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "o" / "final")  # loadable with no project code
    assert saved.config.num_hidden_layers == 2
    record(f"Trainer: fused loss called {len(calls)} times, loss {losses[0]:.3f} -> {losses[-1]:.3f}", 0.0, 0.0, True)


def test_trainer_under_torchrun_two_processes(tmp_path):
    """`torchrun --nproc-per-node 2 finetune_trainer.py`: the Trainer runs data-parallel over two
    processes (one GPU each where there are two, else two CPU processes with gloo: two_process_env) with
    the kernels on, both ranks train, and rank 0 saves a loadable model."""
    import subprocess

    rows = _trainer_rows(tmp_path)
    out = subprocess.run(testkit.torchrun("finetune_trainer.py",
                          "--model", "llama-tiny", "--dataset", str(rows), "--steps", "2", "--timing-warmup-steps", "0", "--seq-len", "64", "--batch-size", "2",
                          "--eval-fraction", "0", "--output-dir", str(tmp_path / "o")),
                         cwd=HERE, capture_output=True, text=True, timeout=600, env=two_process_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 processes" in out.stdout, out.stdout[-3000:]
    # each process takes half of the 18 rows: 9 rows in batches of 2 = 5 steps per epoch, so 2 steps are
    # epoch 0.4 (one process alone: 9 steps per epoch, epoch 0.2222)
    assert "epoch 0.4" in out.stdout, out.stdout[-3000:]
    assert (tmp_path / "o" / "final" / "config.json").is_file()
    record("Trainer under torchrun: 2 processes, epoch 0.4 after 2 steps, model saved", 0.0, 0.0, True)


# ---------------------------------------------------------------------------- models.prepare_model
PREPARATION_ORDER = ["kernels", "fp8", "gradient_checkpointing", "lora", "compile"]


def test_prepare_model_applies_its_steps_in_order(monkeypatch):
    """Every switch on: prepare_model runs each step once, in the documented order (gradient
    checkpointing on the Hugging Face model, before peft wraps it in LoRA). FP8 and compile are
    recorded, not run (FP8 needs a capable GPU or the slow CPU path; compile would only trace)."""
    calls = []

    def spy(name, run=None):
        def step(model, *args, **kwargs):
            calls.append((name, type(model).__name__))
            return run(model, *args, **kwargs) if run else None
        return step

    monkeypatch.setattr(ak, "apply_kernels", spy("kernels", ak.apply_kernels))
    monkeypatch.setattr(ak, "apply_fp8", spy("fp8"))
    monkeypatch.setattr(options, "apply_gradient_checkpointing", spy("gradient_checkpointing",
                                                                     options.apply_gradient_checkpointing))
    monkeypatch.setattr(models, "apply_lora", spy("lora", models.apply_lora))
    monkeypatch.setattr(models, "apply_compile", spy("compile"))
    cfg = config("--kernels", "rmsnorm", "--fp8", "--fp8-recipe", "rowwise", "--gradient-checkpointing", "--lora-r", "4", "--compile",
                 "--seq-len", "32")
    model = models.prepare_model(cfg)[0]
    assert [name for name, _ in calls] == PREPARATION_ORDER, calls
    assert dict(calls)["gradient_checkpointing"] == "LlamaForCausalLM", "checkpointing must be set before peft wraps"
    assert dict(calls)["compile"].startswith("Peft"), "compile must see the adapters"
    assert models.decoder_layers(model)[0].gradient_checkpointing
    record(f"prepare_model: {' -> '.join(PREPARATION_ORDER)}", 0.0, 0.0, True)


def test_the_seed_draws_the_adapters():
    """LoRA's A matrices were drawn from whatever state torch's generator was in, so one set of flags gave runs with
    other first gradients (in the fine-tuning scripts: the same loss at step 1, another grad norm); --seed draws them."""
    def adapters(seed, state_before):
        torch.manual_seed(state_before)  # the state anything before the build left
        model = models.prepare_model(config("--lora-r", "2", "--seq-len", "32", "--seed", str(seed)))[0]
        return torch.cat([p.detach().flatten() for n, p in model.named_parameters() if "lora_A" in n])

    first = adapters(0, state_before=1)
    assert first.abs().sum() > 0 and torch.equal(first, adapters(0, state_before=2))
    assert not torch.equal(first, adapters(1, state_before=1))


def test_lora_with_gradient_checkpointing_trains():
    """--lora-r 4 --gradient-checkpointing on the tiny model, the kernels on: each decoder layer is
    recomputed in backward, two AdamW steps give finite losses, and every adapter gets a gradient
    (frozen embeddings must not cut the adapters of the checkpointed layers off from the loss)."""
    cfg = config("--lora-r", "4", "--gradient-checkpointing", "--steps", "2", "--timing-warmup-steps", "0",
                 "--batch-size", "2", "--seq-len", "32", "--lr", "1e-2")
    model = models.prepare_model(cfg)[0]
    opt = make_optimizer(model, cfg.training, cfg.run)
    data = make_run_data(cfg, model)
    losses = [training.training_step(model, opt, [data.batch(i, DEVICE)])[0].item() for i in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    forwards = []  # a module inside the checkpointed layer's forward runs again when backward recomputes it
    models.decoder_layers(model)[0].post_attention_layernorm.register_forward_hook(lambda *_: forwards.append(1))
    batch = data.batch(2, DEVICE)
    model(**batch).loss.backward()
    assert len(forwards) == 2, f"layer 0's norm ran {len(forwards)} times in forward + backward: not recomputed"
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(p.requires_grad for p in adapters.values())
    no_grad = [n for n, p in adapters.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"adapters without a gradient: {no_grad[:4]}"
    frozen = [n for n, p in model.named_parameters() if "lora_" not in n and p.grad is not None]
    assert not frozen, frozen[:4]
    record(f"LoRA + gradient checkpointing: losses {losses[0]:.3f}, {losses[1]:.3f}; {len(adapters)} adapter "
           "tensors with gradients", 0.0, 0.0, True)


def test_trainer_builds_its_model_through_prepare_model(tmp_path, monkeypatch):
    """finetune_trainer.py prepares its model with the shared prepare_model, leaving the processes to the
    Trainer (shard=False); with LoRA and gradient checkpointing, training lowers the loss."""
    import finetune_trainer

    calls = []
    prepare = models.prepare_model
    monkeypatch.setattr(models, "prepare_model", lambda cfg, **kw: calls.append(kw) or prepare(cfg, **kw))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "best").write_text("checkpoint-9\n")  # an earlier run's, with --load-best-model-at-end
    trainer, _ = finetune_trainer.main(["--model", "llama-tiny", "--dataset", str(_trainer_rows(tmp_path)),
                                        "--steps", "4", "--lr", "1e-2",
                                        "--seq-len", "64", "--batch-size", "2", "--log-every", "1",
                                        "--eval-fraction", "0", "--lora-r", "4", "--gradient-checkpointing",
                                        "--output-dir", str(tmp_path / "o")])
    assert calls == [{"shard": False}], calls
    assert models.decoder_layers(trainer.model)[0].gradient_checkpointing
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(loss == loss for loss in losses) and losses[-1] < losses[0], losses
    # no --save-every: the run's final/ is what its --output-dir stands for in export.py and chat.py, by its step
    from playbook.model import saved_run

    assert (tmp_path / "o" / "latest").read_text() == "final\n" and not (tmp_path / "o" / "best").exists()
    folder, what = saved_run.find(str(tmp_path / "o"), follow_latest=True)
    assert folder == tmp_path / "o" / "final" and what.endswith("(the run's final weights, step 4)"), what
    record(f"Trainer through prepare_model (LoRA + checkpointing): loss {losses[0]:.3f} -> {losses[-1]:.3f}",
           0.0, 0.0, True)


def test_distill_builds_both_models_through_prepare_model(monkeypatch):
    """distill.py prepares the teacher and the student with the shared prepare_model: the kernels on
    both; LoRA and gradient checkpointing on the student only; the teacher stays frozen."""
    import distill

    roles = []
    prepare = models.prepare_model

    def spy(cfg, **kw):
        model, *rest = prepare(cfg, **kw)
        roles.append((cfg, kw))
        return (model, *rest)

    monkeypatch.setattr(distill, "prepare_model", spy)
    tag = "test_distill_prepare"
    try:
        payload = distill.main(["--teacher", "llama-tiny", "--student", "llama-tiny-student", "--mode", "baseline",
                                "--steps", "2", "--timing-warmup-steps", "1", "--batch-size", "1", "--seq-len", "16",
                                "--kernels", "rmsnorm", "--lora-r", "4", "--gradient-checkpointing",
                                "--tag", tag, "--overwrite"])
    finally:
        (RESULTS_DIR / f"{tag}.json").unlink(missing_ok=True)
    (teacher, t_kw), (student, s_kw) = roles
    assert t_kw["shard"] is False and s_kw["shard"] is False  # one process: distill.py runs no torchrun
    assert (teacher.model.model, student.model.model) == ("llama-tiny", "llama-tiny-student")
    assert teacher.model.kernels == student.model.kernels == ("rmsnorm",)
    assert (teacher.model.lora_r, teacher.memory.gradient_checkpointing) == (0, False)
    assert (student.model.lora_r, student.memory.gradient_checkpointing) == (4, True)
    losses = payload["modes"]["baseline"]["losses"]
    assert len(losses) == 2 and all(loss == loss for loss in losses), losses
    assert payload["config"]["extra"]["teacher"] == "llama-tiny" and payload["config"]["lr"] == 1e-4
    record("distill.py: teacher and student through prepare_model (LoRA + checkpointing on the student)",
           0.0, 0.0, True)


@pytest.mark.parametrize("argv, says", [
    (["--batch-size", "0"], "--batch-size: 0 must be >= 1"),
    (["--steps", "2", "--timing-warmup-steps", "2"], "leaves no timed step"),
    (["--kernels", "no_such_kernel"], "--kernels"),
    (["--alpha", "1.5"], "--alpha: 1.5 must be in [0, 1]"),
    (["--grad-accum", "2"], "distill.py does not use --grad-accum"),
    (["--model", "llama-tiny"], "--teacher and --student"),
], ids=["batch-size", "warmup", "kernels", "alpha", "unused", "model"])
def test_distill_refuses_bad_arguments(argv, says, capsys):
    """distill.py's command line is the shared one: a bad value exits with code 2 and says why, as in
    the other scripts; a shared option distill.py has no use for is refused rather than ignored."""
    import distill

    with pytest.raises(SystemExit) as exc:
        distill.parse_args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_the_scripts_defaults_decide_never_their_name():
    """What differs between the scripts is each one's ScriptDefaults: the baseline's eager steps, Hugging Face's
    attention and its memory hint follow its defaults under any name, and its name alone changes nothing."""
    import dataclasses

    from playbook.config import BASELINE, ScriptDefaults

    renamed = config(script=dataclasses.replace(BASELINE, name="my_baseline"))
    assert renamed.run.script == "my_baseline" and renamed.training.cuda_graphs == "off"
    assert batch_attention(renamed, None).causal_padding is False
    assert BASELINE.memory_hint in oom.memory_hints(renamed)
    named = config(script=ScriptDefaults("finetune_baseline"))
    assert named.training.cuda_graphs == "auto" and batch_attention(named, None).causal_padding is True
    assert BASELINE.memory_hint not in oom.memory_hints(named)
    assert config(script="finetune_baseline").run.defaults == BASELINE  # a name: the project's script of that name
    record("the baseline's eager steps, attention and memory hint follow its ScriptDefaults, not its name",
           0.0, 0.0, True)


def test_timing_warmup_left_out_leaves_a_timed_step():
    """--timing-warmup-steps left out is 2, fewer where --steps leaves none timed (--steps 2: 1, --steps 1: 0);
    given, it is kept, and a value that leaves no timed step is refused (test_distill_refuses_bad_arguments, the
    probe's case)."""
    for steps, warmup in ((None, 2), ("3", 2), ("2", 1), ("1", 0)):
        cfg = config(*(["--steps", steps] if steps else []))
        assert cfg.training.warmup_steps == warmup and type(cfg.training.warmup_steps) is int, (steps,
                                                                                                cfg.training.warmup_steps)
    assert config("--steps", "5", "--timing-warmup-steps", "3").training.warmup_steps == 3
    assert config("--steps", "1",
                  script=PROFILE).training.warmup_steps == 2  # the profile's --steps come after its warm-up
    with pytest.raises(SystemExit):
        config("--steps", "2", "--timing-warmup-steps", "2")
    record("--timing-warmup-steps left out: 2, or 1 with --steps 2 and 0 with --steps 1; given: kept or refused",
           0.0, 0.0, True)


def test_distill_defaults():
    """distill.py's own defaults on the shared command line: 3 steps (1 untimed) and lr 1e-4 on a CPU,
    and at least one timed step whatever --steps is."""
    import distill

    cfg = distill.parse_args([])
    if not cfg.on_gpu:
        assert (cfg.training.steps, cfg.training.warmup_steps, cfg.training.lr, cfg.data.batch_size,
                cfg.data.seq_len) == (3, 1, 1e-4, 2, 64)
        assert (cfg.extra.teacher, cfg.extra.student) == ("llama-tiny", "llama-tiny-student")
    assert distill.parse_args(["--steps", "1"]).training.warmup_steps == 0
    assert cfg.model.kernels == () and cfg.extra.mode == "both" and cfg.extra.alpha == 0.5


def test_fsdp2_two_processes():
    """torchrun with 2 processes shards the model with FSDP2: one GPU each (NCCL) where there are two, else
    two CPU processes (gloo: the same code path; two_process_env)."""
    import subprocess

    tag = "test_fsdp2_two"
    out = subprocess.run(testkit.torchrun("finetune_optimized.py", "--model", "llama-tiny", "--steps", "3", "--timing-warmup-steps", "1",
                          "--grad-accum", "2", "--batch-size", "2", "--seq-len", "32", "--tag", tag, "--overwrite"),
                         cwd=HERE, capture_output=True, text=True, timeout=600, env=two_process_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    path = RESULTS_DIR / f"{tag}.json"
    result = json.loads(path.read_text())
    for suffix in (".json", ".png", ".metrics.jsonl"):
        (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)
    assert result["world_size"] == 2 and result["summary"]["tokens/s (job)"] > 0
    assert all(loss == loss for loss in result["losses"]), "loss is NaN"
    record("2-process FSDP2 run: finite losses, job tokens/s reported", 0.0, 0.0, True)



def test_attention_order():
    """The SDPA order the scripts set on Hopper names real backends; for a CPU nothing is changed. (On a
    Hopper GPU an earlier test of this process may have set the order already: it is kept for the
    process's life, so the check is that the CPU call leaves it as it was.)"""
    from torch.nn.attention import SDPBackend

    assert all(hasattr(SDPBackend, name) for name in models.ATTENTION_PRIORITY)
    before = list(models._attention_order)
    line = models.prefer_fast_attention(torch.device("cpu"))
    assert "no GPU" in line and models._attention_order == before
    record(line, 0.0, 0.0, True)


# The loss-parity tests (see the file's docstring), last in this file: their kernel runs train in the
# background from the start of the session (start_kernel_runs), and are then the most likely to be done.
# Under pytest-xdist they run in one worker (conftest.py), which starts the kernel runs once.
PARITY = pytest.mark.xdist_group("parity_runs")


@PARITY
@pytest.mark.parametrize("kernels, in_backward", RUNS)
def test_loss_curve_matches_baseline(kernels, in_backward, parity_runs):
    ref_losses, _ = parity_runs("none", torch.float32)
    base_losses, _ = parity_runs("none", torch.bfloat16)
    ours_losses, _ = parity_runs(kernels, torch.bfloat16, in_backward)
    assert ref_losses[-1] < ref_losses[0] - 0.5, "the tiny model should learn the text (else parity is vacuous)"
    close_to_reference(f"loss at each of {STEPS} steps (bf16)", ours_losses, base_losses, ref_losses, torch.bfloat16)


@PARITY
@pytest.mark.parametrize("kernels, in_backward", RUNS)
def test_final_parameters_match_baseline(kernels, in_backward, parity_runs):
    """After 20 bf16 steps every parameter tensor must have drifted from the fp32 run at most twice as
    far as PyTorch's own bf16 run has, plus one bf16 ulp of the tensor's size.

    Drift is measured as the tensor's L2 norm of (run - fp32 run), not its largest element: after 20
    chaotic bf16 steps the largest element difference of a ~10^4-element tensor is one outlier
    trajectory whose size changes with the data; the norm measures the whole tensor's drift. (Per
    element, the RMSNorm kernel alone, bit-identical in output to its earlier version, reaches 1.4x
    the 2x-PyTorch bound on one of 21 tensors on the batches of an earlier training text, this
    repository's cross_entropy_kernel.py.)"""
    _, ref = parity_runs("none", torch.float32)
    _, base = parity_runs("none", torch.bfloat16)
    _, ours = parity_runs(kernels, torch.bfloat16, in_backward)
    worst, worst_ratio = None, -1.0
    for name in ref:  # every tensor is checked; the report shows the one closest to its bound
        r = ref[name].double()
        err = torch.linalg.vector_norm(ours[name].double() - r).item()
        tol = 2 * torch.linalg.vector_norm(base[name].double() - r).item() + 2.0**-7 * torch.linalg.vector_norm(r).item()
        if err / tol > worst_ratio:
            worst, worst_ratio = (name, err, tol), err / tol
        assert err <= tol, f"{name}: drift {err:.3e} > {tol:.3e}"
    record(f"final params (L2 drift), worst: {worst[0]}", worst[1], worst[2], True)
    record(f"all {len(ref)} parameter tensors within tolerance", 0.0, 0.0, True)


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "Fine-tuning workflow: test report"))
