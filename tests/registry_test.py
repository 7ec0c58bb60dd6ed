"""The registry of optimizations (playbook/model/registry.py): every entry complete, the same names everywhere.

    $ pytest tests/registry_test.py

Adding a kernel is a kernel file, its test file, one registry line and one row of
docs/optimizations.md: each test below fails when one of them is missing, and when a script stops
taking a registry name.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import re
import subprocess
import sys
from pathlib import Path

import pytest

from playbook.model import registry
from playbook.sections import RunConfig
from testkit import expect_error, record, run_as_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("finetune_optimized.py", "profile_baseline.py", "finetune_trainer.py", "distill.py")


@pytest.mark.parametrize("entry", registry.OPTIMIZATIONS, ids=lambda o: o.name)
def test_entry_has_its_lesson_benchmark_and_docs_row(entry):
    import benchmark_kernels

    for kernel, test in entry.lessons:
        assert (ROOT / kernel).is_file(), f"{entry.name}: no {kernel}"
        assert (ROOT / test).is_file(), f"{entry.name}: no {test}"
    assert entry.module.__file__ == str(ROOT / entry.kernel), (entry.name, entry.module.__file__)
    if entry.scope in ("model", "lora"):  # what patches a model says how many replacements to expect
        assert callable(entry.module.patch_model) and callable(entry.module.expected_patches), entry.name
    for name in entry.benchmarks:
        assert name in benchmark_kernels.SPECS, f"{entry.name}: benchmark {name!r} is not in benchmark_kernels.SPECS"
    docs = (ROOT / "docs" / "optimizations.md").read_text()
    row = re.search(rf"^\| `{entry.name}` \|(.+)\|$", docs, re.M)
    assert row, f"{entry.name}: no row in docs/optimizations.md"
    for kernel, test in entry.lessons:
        assert kernel in row.group(1) and test in row.group(1), (entry.name, row.group(1))
    record(f"{entry.name}: {entry.kernel}, {entry.test}, {len(entry.benchmarks)} benchmark(s), docs row", 0.0, 0.0, True)


def test_no_kernel_file_outside_the_registry():
    """A `<name>_kernel.py` that no entry names would be a lesson no script can switch on."""
    files = {p.name for p in ROOT.glob("*_kernel.py")}
    named = {kernel for o in registry.OPTIMIZATIONS for kernel, _ in o.lessons}
    assert files == named, (sorted(files - named), sorted(named - files))
    tests = {p.name for p in ROOT.glob("*_test.py")}
    listed = {test for o in registry.OPTIMIZATIONS for _, test in o.lessons}
    assert listed == tests, sorted(tests ^ listed)
    record(f"{len(files)} kernel files, {len(tests)} lesson tests, all in the registry", 0.0, 0.0, True)


def test_names_and_sets():
    assert len(registry.NAMES) == len(set(registry.NAMES)) == len(registry.OPTIMIZATIONS)
    assert set(registry.DEFAULT_KERNELS) <= set(registry.NAMES)
    assert registry.parse_kernels("default") == registry.DEFAULT_KERNELS
    more = registry.parse_kernels("default,fp8,adamw")
    assert set(more) == set(registry.DEFAULT_KERNELS) | {"fp8", "adamw"}
    assert list(more) == sorted(more, key=registry.NAMES.index), "registry order"
    assert registry.parse_kernels("none") == ()
    assert "choose from" in expect_error(ValueError, registry.parse_kernels, "rmsnorm,bogus")
    assert "both replace the loss" in expect_error(ValueError, registry.parse_kernels, "cross_entropy,linear_cross_entropy")
    assert "cannot be mixed" in expect_error(ValueError, registry.parse_kernels, "liger,rmsnorm")
    record(f"{len(registry.NAMES)} names; default {','.join(registry.DEFAULT_KERNELS)}", 0.0, 0.0, True)


def test_api_misuse_is_named():
    """apply_kernels(model, None), and a selection of entries that act outside the model's modules alone
    (fp8, adamw, lora: apply_kernels would replace nothing), are refused saying what to pass or call
    instead; so is 'none' among other names."""
    from testkit import tiny_model

    model = tiny_model("llama")
    assert "'none' (or ()) for plain PyTorch" in expect_error(TypeError, registry.apply_kernels, model, None)
    for spec, where in (("fp8", "apply_fp8"), ("adamw,lora", "TritonAdamW")):
        assert where in expect_error(ValueError, registry.apply_kernels, model, spec)
    assert registry.apply_kernels(model, "fp8", others_applied=True).replaced == {}  # what prepare_model passes
    for spec in ("none,rmsnorm", "default,none"):
        assert "'none' alone" in expect_error(ValueError, registry.parse_kernels, spec)
    record("apply_kernels(None), apply_kernels('fp8'), 'none,rmsnorm': refused by name", 0.0, 0.0, True)


def _alias_and_flag(capsys, alias: list, flag: list) -> tuple[RunConfig, list, RunConfig, list]:
    """The RunConfigs of a deprecated --kernels spelling and of its flag, and the notes each printed."""
    from playbook.config import OPTIMIZED, make_parser, parse_config

    parser = make_parser("test", kernels_default=registry.DEFAULT_KERNELS)
    capsys.readouterr()
    old = parse_config(parser, OPTIMIZED, alias)
    old_notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    new = parse_config(parser, OPTIMIZED, flag)
    new_notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    return old, old_notes, new, new_notes


def test_kernels_fp8_is_a_deprecated_spelling_of_the_fp8_flag(capsys):
    old, notes, new, none = _alias_and_flag(capsys, ["--kernels", "default,fp8"], ["--kernels", "default", "--fp8"])
    assert notes == ["note: --kernels fp8 is deprecated: it is --fp8"], notes
    assert not none
    assert old.model.fp8 and old == new, (old.as_dict(), new.as_dict())
    record("--kernels default,fp8: one line saying so, then the run of --fp8", 0.0, 0.0, True)


def test_kernels_adamw_is_a_deprecated_spelling_of_the_triton_optimizer(capsys):
    from playbook.config import make_parser, parse_config

    old, notes, new, none = _alias_and_flag(capsys, ["--kernels", "rmsnorm,adamw"],
                                            ["--kernels", "rmsnorm", "--optimizer", "adamw-triton"])
    assert notes == ["note: --kernels adamw is deprecated: it is --optimizer adamw-triton"], notes
    assert not none
    assert old.training.optimizer == "adamw-triton" and old == new, (old.as_dict(), new.as_dict())
    parser = make_parser("test", kernels_default=registry.DEFAULT_KERNELS)
    with pytest.raises(SystemExit) as err:
        parse_config(parser, "finetune_optimized", ["--kernels", "adamw", "--optimizer", "adamw-foreach"])
    assert err.value.code == 2
    # adamw brought in by 'default' is the default set's, not the alias: no line, the optimizer as the script says
    cfg = parse_config(parser, "finetune_optimized", ["--kernels", "default"])
    assert "note:" not in capsys.readouterr().err and "adamw" in cfg.model.kernels
    record("--kernels rmsnorm,adamw: one line saying so, then the run of --optimizer adamw-triton", 0.0, 0.0, True)


def test_registry_flags_are_the_aliases_the_scripts_take():
    from playbook.config import KERNEL_ALIASES

    assert registry.FLAGS == KERNEL_ALIASES == {"fp8": "--fp8", "adamw": "--optimizer adamw-triton"}
    record("fp8 and adamw: the flags --fp8 and --optimizer adamw-triton", 0.0, 0.0, True)


def test_distillation_names_only_in_distill():
    from playbook.config import make_parser, parse_config

    parser = make_parser("test", kernels_default=registry.DEFAULT_KERNELS)
    with pytest.raises(SystemExit) as err:
        parse_config(parser, "finetune_optimized", ["--kernels", "distillation"])
    assert err.value.code == 2
    record("--kernels distillation: only in distill.py", 0.0, 0.0, True)


def test_each_entry_says_whether_a_run_selects_it_and_applies_itself():
    """Every entry with an `apply` applies itself to a model; selected(cfg) follows its one switch."""
    from playbook.config import make_parser, parse_config
    from testkit import tiny_model

    parser = make_parser("test", kernels_default=registry.DEFAULT_KERNELS)
    cfg = parse_config(parser, "finetune_optimized", ["--kernels", "rmsnorm", "--fp8", "--lora-r", "4"])
    assert [o.name for o in registry.OPTIMIZATIONS if o.selected(cfg)] == ["rmsnorm", "fp8"]
    assert [o.name for o in registry.conversions(cfg)] == ["fp8"]
    cfg = parse_config(parser, "finetune_optimized", ["--lora-r", "4", "--optimizer", "adamw-triton"])
    assert {"lora", "adamw"} <= {o.name for o in registry.OPTIMIZATIONS if o.selected(cfg)}
    assert registry.conversions(cfg) == ()
    model = tiny_model("llama")
    entry = registry.BY_NAME["rmsnorm"]
    assert entry.apply_to(model) == entry.module.expected_patches(model.config)
    assert "acts outside" in expect_error(ValueError, registry.BY_NAME["adamw"].apply_to, model)
    assert all(o.apply is not None for o in registry.OPTIMIZATIONS if o.scope in ("model", "fp8"))
    record("selected(cfg) per entry; rmsnorm applies itself with its count checked", 0.0, 0.0, True)


def test_the_lora_fusion_follows_its_registry_name(monkeypatch):
    """prepare_model fuses the LoRA layers exactly when `lora` is among the selected names."""
    from playbook.model import lora, models
    from playbook.config import make_parser, parse_config

    seen = []
    monkeypatch.setattr(lora, "lora_from_config", lambda model, cfg, fuse: seen.append(fuse) or model)
    parser = make_parser("test", kernels_default=registry.DEFAULT_KERNELS)
    for words, fused in ((["--kernels", "default"], True), (["--kernels", "rmsnorm"], False)):
        cfg = parse_config(parser, "finetune_optimized", ["--model", "llama-tiny", "--lora-r", "4", "--num-layers", "1",
                                                          *words])
        models.prepare_model(cfg)
        assert seen[-1] is fused, (words, seen)
    record("LoRA fused with 'lora' selected, peft's own forward without", 0.0, 0.0, True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_takes_the_registry_names(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    flat = " ".join(out.stdout.split())
    assert "--kernels" in flat, f"{script} has no --kernels"
    missing = [n for n in registry.NAMES if n not in flat]
    assert not missing, f"{script} --help does not name {missing}"
    record(f"{script} --kernels lists all {len(registry.NAMES)} names", 0.0, 0.0, True)


def test_benchmark_takes_the_registry_names():
    import benchmark_kernels as bk

    for entry in registry.OPTIMIZATIONS:
        if entry.benchmarks:
            assert bk.kernel_list(entry.name) == tuple(n for n in bk.SPECS if n in entry.benchmarks), entry.name
        else:
            assert "training step" in expect_error(Exception, bk.kernel_list, entry.name)
    record("benchmark_kernels.py --kernels takes every registry name", 0.0, 0.0, True)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "The optimization registry: test report"))
