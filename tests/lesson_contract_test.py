"""The contract of every lesson that patches a model, one test for all of them, driven by the registry.

    $ PYTHONPATH=. python tests/lesson_contract_test.py    # a readable report
    $ pytest tests/lesson_contract_test.py

Every registry entry of scope "model" (playbook/model/registry.py: what apply_kernels patches) is a lesson
whose kernel file has `patch_model(model) -> int`, `expected_patches(config) -> int` and `ideal_bytes(...)`;
a new entry is checked here without a line added. For each family the lesson's test file names
(`CONTRACT_FAMILIES`, llama when it names none), on a tiny random model of that family (testkit.tiny_model
at a smaller shape, SHAPE; fp32):

- patch_model returns what expected_patches says for the model's config;
- patching twice returns the same count (nothing wrapped twice);
- the Parameters stay the same objects under the same names (an optimizer made before patching trains the
  patched model, a state dict loads into it);
- the logits and the loss of a batch with labels match the unpatched model's by testkit's rule (at most 2x
  as far from a float64 copy as the fp32 model is, plus one fp32 ulp and the rounding of an fp32 sum of n
  terms, of the output's scale), with n the longest sum behind each value: hidden or MLP width for a logit,
  tokens x (vocabulary, hidden or width) for the loss;
- then the lesson's own checks, `check_patched(kind, model, count)` in its test file where it has one
  (what is specific to it: RMSNorm's offset and casting per family, SwiGLU's activation, the function RoPE
  swaps in).

And the docstring's byte counts: each `ideal_bytes(...) = N B` line of the kernel's docstring is what
ideal_bytes returns (the hand counts behind them stay in the lesson's test). A lesson whose docstring
states its counts another way is named in OWN_BYTE_CHECKS with the test that checks them.

The unpatched model, its outputs and its float64 reference are made once per family and shared by the
lessons: the contract costs one patched forward per lesson and family.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import ast
import copy
import functools
import importlib
import re
from pathlib import Path

import pytest
import torch

from playbook.model import registry
from core.kernel_utils import DEVICE
from testkit import close_to_reference, record, run_as_script, tiny_model

ROOT = Path(__file__).resolve().parent.parent
LESSONS = tuple(entry for entry in registry.OPTIMIZATIONS if entry.scope == "model")
CONTRACT = ("patch_model", "expected_patches", "ideal_bytes")
# Kernel files with a patch_model outside the contract, and why: their patch is not a drop-in of this form.
OUTSIDE = {
    "fp8_linear_kernel.py": "FP8 rounds every projection's inputs to 8 bits: its logits are not close by the fp32 "
                            "rule, and its count follows the recipe and layer sizes (fp8_linear_test.py)",
    "fp8_recipes_kernel.py": "the FP8 recipes (fp8_recipes_test.py), as fp8_linear_kernel.py",
    "fp8_producers_kernel.py": "the FP8 producers (fp8_producers_test.py), as fp8_linear_kernel.py",
    "lora_kernel.py": "patches a peft model's adapters, and counts them from the model, not its config (lora_test.py)",
}
# Lessons whose docstrings state their byte counts other than as `ideal_bytes(...) = N B`: where they are checked.
OWN_BYTE_CHECKS = {
    "cross_entropy": "cross_entropy_test.py::test_ideal_bytes_match_the_docstring (the hand expressions)",
    "linear_cross_entropy": "linear_cross_entropy_test.py::test_ideal_bytes_and_flops_match_the_docstring",
    "projections": "projections_test.py::test_flops_and_bytes (the docstring states no figure)",
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _lesson_test(entry):
    """The lesson's test module (rmsnorm_test for rmsnorm), where its contract families and own checks live."""
    return importlib.import_module(entry.test.removesuffix(".py"))


CASES = [(entry, kind) for entry in LESSONS for kind in getattr(_lesson_test(entry), "CONTRACT_FAMILIES", ("llama",))]


def _defines(path: Path) -> set:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_lesson_that_patches_a_model_is_under_the_contract():
    """Each model entry's kernel file has the contract; a kernel file of another entry with a patch_model is
    named in OUTSIDE with its reason (a new one fails here until it is placed)."""
    for entry in LESSONS:
        missing = set(CONTRACT) - _defines(ROOT / entry.kernel)
        assert not missing, f"{entry.name}: {entry.kernel} lacks {sorted(missing)} (registry.patch calls them)"
    others = {kernel for entry in registry.OPTIMIZATIONS if entry.scope != "model" for kernel, _ in entry.lessons
              if "patch_model" in _defines(ROOT / kernel)}
    assert others == set(OUTSIDE), f"patch_model outside the model entries, not placed: {sorted(others ^ set(OUTSIDE))}"
    record(f"{len(LESSONS)} lessons under the contract ({', '.join(e.name for e in LESSONS)}); "
           f"{len(OUTSIDE)} patch otherwise", 0.0, 0.0, True)


# Smaller than testkit's tiny model and batch (the kernels run in Triton's interpreter without a GPU): 2 layers,
# hidden 32, MLP width 48, 2 query heads and 1 KV head of 16, vocabulary 128; 2 sequences of 9 tokens.
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16)
BATCH, SEQ = 2, 9


@functools.cache
def _unpatched(kind: str):
    """The tiny model of the family, a batch, and its outputs in fp32 and float64: made once, shared by the lessons.
    Under pytest, conftest.py restores Hugging Face's RoPE functions after each test: this runs unpatched."""
    model = tiny_model(kind, **SHAPE)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=g)
    labels = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.25, -100, ids)  # about a quarter ignored
    ids, labels = ids.to(DEVICE), labels.to(DEVICE)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        ref = copy.deepcopy(model).double()(input_ids=ids, labels=labels)
    return model, ids, labels, (out.logits, out.loss), (ref.logits, ref.loss)


@pytest.mark.parametrize("entry, kind", CASES, ids=[f"{e.name}-{k}" for e, k in CASES])
def test_patch_model_contract(entry, kind):
    module = entry.module
    base, ids, labels, (logits, loss), (ref_logits, ref_loss) = _unpatched(kind)
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    count = module.patch_model(model)
    assert count == module.expected_patches(model.config), f"{entry.name} on {kind}: {count} patched, expected " \
                                                           f"{module.expected_patches(model.config)}"
    assert module.patch_model(model) == count, "patching twice must neither wrap twice nor change the count"
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is p for n, p in params.items()), \
        f"{entry.name} on {kind}: the Parameters must stay the same objects under the same names"
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    config = model.config
    tag = f"{entry.name} x{count}, {kind}: patched"
    if out.logits is not None:  # linear_cross_entropy builds no logits when it has labels
        close_to_reference(f"{tag} logits", out.logits, logits, ref_logits, torch.float32,
                           n=max(config.hidden_size, config.intermediate_size))
    close_to_reference(f"{tag} loss", out.loss, loss, ref_loss, torch.float32,
                       n=ids.numel() * max(config.vocab_size, config.hidden_size, config.intermediate_size))
    check = getattr(_lesson_test(entry), "check_patched", None)
    if check is not None:
        check(kind, model, count)


def _stated_counts(doc: str) -> list:
    """Every `ideal_bytes(args) = N B` of a docstring, as (the call's text, args, keywords, N)."""
    found = []
    for call, counted in re.findall(r"(ideal_bytes\([^)]*\))\s*=\s*([\d,]+) B\b", doc):
        node = ast.parse(call, mode="eval").body
        value = lambda a: DTYPES[a.id] if isinstance(a, ast.Name) else ast.literal_eval(a)  # noqa: E731
        found.append((call, [value(a) for a in node.args], {k.arg: value(k.value) for k in node.keywords},
                      int(counted.replace(",", ""))))
    return found


@pytest.mark.parametrize("entry", LESSONS, ids=lambda e: e.name)
def test_docstring_byte_counts_are_ideal_bytes(entry):
    module = entry.module
    stated = _stated_counts(module.__doc__)
    if entry.name in OWN_BYTE_CHECKS:
        assert not stated, f"{entry.name} states `ideal_bytes(...) = N B` now: check it here, not in OWN_BYTE_CHECKS"
        where, test = OWN_BYTE_CHECKS[entry.name].split()[0].split("::")
        assert test in _defines(ROOT / where), f"{entry.name}: no {test} in {where} (OWN_BYTE_CHECKS)"
        record(f"{entry.name}: its byte counts are checked by {OWN_BYTE_CHECKS[entry.name]}", 0.0, 0.0, True)
        return
    assert {kw.get("backward", False) for _, _, kw, _ in stated} == {False, True}, \
        f"{entry.name}: the docstring must state ideal_bytes(...) = N B for the forward and for forward + backward"
    for call, args, keywords, counted in stated:
        computed = module.ideal_bytes(*args, **keywords)
        assert computed == counted, f"{entry.name}: the docstring's {call} = {counted:,} B; ideal_bytes: {computed:,}"
        record(f"{entry.name}: {call} = {computed / 1e6:.1f} MB, as the docstring states", 0.0, 0.0, True)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "The lessons' patch_model and byte-count contract: test report"))
