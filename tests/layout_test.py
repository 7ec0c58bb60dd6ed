"""The repository's layout shows its architecture: lessons and scripts on top, the training library in playbook/, the ground under the lessons in core/.

    $ pytest tests/layout_test.py

- The top level holds what a learner runs or reads: the entry scripts and the kernel lessons
  (`<name>_kernel.py` / `<name>_test.py`, each named by the registry), nothing else.
- `playbook/` and `core/` are libraries: imported, never run (no `__main__` block), and importing the package
  itself imports no torch (the set-up check runs before torch is installed).
- No import cycles, counting the imports inside functions too: a reader can follow each one down.
- Layers, arrows pointing down only, inside functions too: `core/` at the ground, the lessons
  (`*_kernel.py`) above it (importing core and each other's public names only), the training
  library (`playbook/`) above them, the tools beside it (`benchmarks/`, `testkit/`), the scripts on top.
- Inside `playbook/`, one folder per concern, in an order (PLAYBOOK_ORDER): a part imports only the parts
  at or below its own; no more than three modules stand at the package's top.
- Importing any playbook module or lesson changes no environment variable, signal handler or third-party
  function; `playbook.startup.start()`, which every script calls first, does.
- `results/` holds evidence only (logs, JSON, CSV, PNG, text), each file listed in results/README.md.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from playbook.model import registry
from testkit import record, run_as_script, signals_as_from_a_shell

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"profile_baseline.py", "benchmark_kernels.py", "benchmark_finetune.py", "finetune_baseline.py", "finetune_optimized.py",
           "finetune_trainer.py", "distill.py", "walkthrough.py", "selfcheck.py", "chat.py", "export.py"}
EVIDENCE = {".log", ".json", ".csv", ".png", ".txt", ".md", ".jsonl"}


def test_top_level_is_scripts_and_lessons():
    lessons = {name for o in registry.OPTIMIZATIONS for pair in o.lessons for name in pair}
    found = {p.name for p in ROOT.glob("*.py")}
    extra = found - SCRIPTS - lessons - {"conftest.py"}
    assert not extra, f"library code at the top level: {sorted(extra)} (it belongs in playbook/)"
    assert SCRIPTS <= found, sorted(SCRIPTS - found)
    record(f"top level: {len(SCRIPTS)} scripts, {len(lessons)} lesson files, conftest.py", 0.0, 0.0, True)


def library_files(root: Path = ROOT) -> list:
    """Every module of playbook/ (its sub-packages too), of core/ and of the tools beside the library."""
    return sorted([*(root / "playbook").rglob("*.py"), *(root / "core").glob("*.py"), *(root / "benchmarks").glob("*.py"),
                   *(root / "testkit").glob("*.py")])


def test_the_library_is_never_run():
    for path in library_files():
        tree = ast.parse(path.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert not mains, f"{path.name} has a __main__ block: entry points are top-level scripts"
    code = "import sys, playbook, playbook.startup, playbook.runtime.signals; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    record("playbook/: no __main__ block; importing the package, its start-up and signals imports no torch",
           0.0, 0.0, True)


def import_graph() -> dict:
    """module -> the project's modules it imports, at module level or inside functions."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p
             for p in [*ROOT.glob("*.py"), *library_files()]}
    files = {name.removesuffix(".__init__"): p for name, p in files.items()}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module:
                deps |= {node.module} & files.keys()
                deps |= {f"{node.module}.{a.name}" for a in node.names} & files.keys()
        graph[name] = deps - {name, "playbook"}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, found, counter = {}, {}, [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert not found, f"import cycles: {detail}"
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]  # the check itself finds one
    record(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, no cycle", 0.0, 0.0, True)


CORE, LESSON, LIBRARY, TOOLS, SCRIPT = "core", "lesson", "the training library", "a tool beside the library", "script"


def layer_of(module: str, root: Path = ROOT) -> str | None:
    """The layer of a module name (a dotted name by its package), None for what is not the project's."""
    if module == "core" or module.startswith("core."):
        return CORE
    if module == "playbook" or module.startswith("playbook."):
        return LIBRARY
    top = module.split(".")[0]
    if top in ("benchmarks", "testkit") and (root / top / "__init__.py").is_file():
        return TOOLS
    if top.endswith("_kernel") and (root / f"{top}.py").is_file():
        return LESSON
    if f"{top}.py" in SCRIPTS:
        return SCRIPT
    return None


def imports_of(path: Path, root: Path = ROOT) -> list:
    """(module, name or None, line) for every import of the file, at module level and inside functions:
    `import a.b` gives ("a.b", None), `from a import b` ("a", "b") (and ("a.b", None) when a.b is a module
    of the project), and `m._x` read through a module imported whole gives (module, "_x")."""
    tree = ast.parse(path.read_text())
    found, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append((a.name, None, node.lineno))
                bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the file's package
                package = path.relative_to(root).with_suffix("").parts[:-node.level]
                module = ".".join([*package, module] if module else package)
            for a in node.names:
                found.append((module, a.name, node.lineno))
                submodule = f"{module}.{a.name}"
                if (root / Path(*submodule.split("."))).with_suffix(".py").is_file():
                    found.append((submodule, None, node.lineno))
                    bound[a.asname or a.name] = submodule
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            found.append((bound[node.value.id], node.attr, node.lineno))
    return found


def layering_violations(root: Path = ROOT) -> tuple[list, list]:
    """(upward imports, uses of another lesson's private names) in core, the lessons and the rest
    of playbook/ under `root`."""
    files = {f"core.{p.stem}": p for p in (root / "core").glob("*.py")}
    files |= {p.stem: p for p in root.glob("*_kernel.py")}
    for folder in ("playbook", "benchmarks", "testkit"):
        files |= {".".join(p.relative_to(root).with_suffix("").parts): p for p in (root / folder).rglob("*.py")}
    allowed = {CORE: {CORE}, LESSON: {CORE, LESSON}, LIBRARY: {CORE, LESSON, LIBRARY},
               TOOLS: {CORE, LESSON, LIBRARY, TOOLS}}
    upward, private = [], []
    for name, path in sorted(files.items()):
        name = name.removesuffix(".__init__")
        layer = layer_of(name, root)
        for module, imported, line in imports_of(path, root):
            target = layer_of(module, root)
            if module.split(".")[0] == "playbook" and imported is not None:  # from playbook.x import y: y's layer
                target = layer_of(f"{module}.{imported}", root)
            where = f"{path.relative_to(root)}:{line}"
            if target is not None and target not in allowed[layer]:
                upward.append(f"{where}: {name} ({layer}) imports {module}"
                              f"{'.' + imported if imported else ''} ({target})")
            elif (layer == LESSON and target == LESSON and module.split(".")[0] != name and imported
                  and imported.startswith("_") and not imported.endswith("__")):
                private.append(f"{where}: {name} uses {module}.{imported}, a private name of another lesson")
    return list(dict.fromkeys(upward)), list(dict.fromkeys(private))  # (from a import b: a.b once)


def test_imports_point_down_the_layers():
    upward, _ = layering_violations()
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)
    record("core, the lessons, the training library: no import from a lower layer to a higher one",
           0.0, 0.0, True)


def test_no_guessed_config_fields():
    """The RunConfig is typed (playbook/sections.py): no `getattr(cfg, ...)` in playbook/ or the scripts guesses at a
    field that may not exist (#61)."""
    found = [f"{path.relative_to(ROOT)}:{i}" for path in [*(ROOT / "playbook").rglob("*.py"), *ROOT.glob("*.py")]
             for i, line in enumerate(path.read_text().splitlines(), 1) if "getattr(cfg" in line]
    assert not found, "getattr(cfg, ...) guesses at a config field:\n" + "\n".join(found)
    record("playbook/ and the scripts: 0 getattr(cfg, ...)", 0.0, 0.0, True)


# playbook/'s parts from the bottom up: a folder (a sub-package) or a module at the package's top. A part imports
# only the parts at or below its own (and the layers under the library), at module level or inside functions.
PLAYBOOK_ORDER = ("sections", "runtime", "store", "memory", "optim", "model", "data", "plan", "config", "run",
                  "startup")


def playbook_order_violations(root: Path = ROOT) -> list:
    """Imports from a part of playbook/ to a part above it, and files in a part PLAYBOOK_ORDER does not name."""
    found = []
    for path in sorted((root / "playbook").rglob("*.py")):
        parts = path.relative_to(root / "playbook").with_suffix("").parts
        if parts == ("__init__",):
            continue
        part = parts[0]
        if part not in PLAYBOOK_ORDER:
            found.append(f"{path.relative_to(root)}: in {part}, which PLAYBOOK_ORDER does not place")
            continue
        for module, imported, line in imports_of(path, root):
            names = module.split(".")
            if names[0] != "playbook":
                continue
            target = names[1] if len(names) > 1 else imported
            if target in PLAYBOOK_ORDER and PLAYBOOK_ORDER.index(target) > PLAYBOOK_ORDER.index(part):
                found.append(f"{path.relative_to(root)}:{line}: {part} imports {module}"
                             f"{'.' + imported if imported else ''} ({target}, above it)")
    return list(dict.fromkeys(found))


def test_playbook_is_folders_by_concern_in_order(tmp_path):
    found = playbook_order_violations()
    assert not found, "playbook/ parts importing a part above them:\n" + "\n".join(found)
    top = sorted(p.name for p in (ROOT / "playbook").glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in (ROOT / "playbook").iterdir() if (p / "__init__.py").is_file())
    assert len(top) <= 3 and len(folders) >= 5, (top, folders)
    assert set(folders) | {p.removesuffix(".py") for p in top} == set(PLAYBOOK_ORDER), (folders, top)
    # the check itself, on made-up files: an upward import inside a function, and a folder the order does not place
    for stub, text in {"playbook/model/x.py": "def f():\n    from playbook.run import training\n",
                       "playbook/run/training.py": "", "playbook/extra/y.py": ""}.items():
        (tmp_path / stub).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / stub).write_text(text)
    made = playbook_order_violations(tmp_path)
    assert len(made) == 2 and "model imports playbook.run.training (run, above it)" in made[1], made
    record(f"playbook/: {len(folders)} folders and {len(top)} top modules in order "
           f"({' < '.join(PLAYBOOK_ORDER)}), no import upward", 0.0, 0.0, True)


def test_every_script_starts_its_run_in_one_place():
    """A run's start (the data checked, the processes connected, the memory plan, the rounding decided, the run's
    data built) is playbook/run/start.py's: no script and no other module of the library does it itself."""
    own = {"check.start(": (), "check_run_data(": (), "make_run_data(": (),
           "agree_on_rounding(": ("playbook/plan/check.py",), "choose_rounding(": ("playbook/plan/check.py",)}
    found = []
    for path in sorted([*ROOT.glob("*.py"), *(ROOT / "playbook").rglob("*.py")]):
        where = str(path.relative_to(ROOT))
        if path.name.endswith("_test.py") or where == "playbook/run/start.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{where}:{number}: {call}" for call, allowed in own.items()
                      if call in line and where not in allowed and f"def {call}" not in line]
    assert not found, "a run started outside playbook/run/start.py:\n" + "\n".join(found)
    record("every script starts its run through playbook/run/start.py (settle, build)", 0.0, 0.0, True)


def test_the_layer_check_finds_each_kind_of_upward_import(tmp_path):
    """The check itself, on made-up files: each rule of the layering is caught, inside a function too."""
    cases = {  # (file, source) -> what the check must say
        ("core/x.py", "def f():\n    import rmsnorm_kernel\n"): "imports rmsnorm_kernel (lesson)",
        ("core/x.py", "from playbook.run import training\n"): "imports playbook.run.training (the training library)",
        ("playbook/run/training.py", "import testkit\n"): "imports testkit (a tool beside the library)",
        ("core/x.py", "from playbook.model.presets import PRESETS\n"): "imports playbook.model.presets.PRESETS (the",
        ("rope_kernel.py", "def f():\n    from playbook.runtime.common import usage_error\n"): "(the training library)",
        ("rope_kernel.py", "import finetune_optimized\n"): "(script)",
        ("playbook/run/training.py", "def f():\n    import walkthrough\n"): "(script)",
    }
    stubs = ["rmsnorm_kernel.py", "swiglu_kernel.py", "rope_kernel.py", "playbook/__init__.py", "playbook/model/presets.py",
             "playbook/run/training.py", "playbook/runtime/common.py", "core/__init__.py", "core/kernel_utils.py",
             "testkit/__init__.py"]
    for (made, text), says in cases.items():
        root = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        for stub in stubs:
            (root / stub).parent.mkdir(parents=True, exist_ok=True)
            (root / stub).write_text("")
        (root / made).write_text(text)
        upward, _ = layering_violations(root)
        assert len(upward) == 1 and says in upward[0], (made, text, upward)
        if made == "rope_kernel.py":  # what a lesson may import
            (root / made).write_text("import torch, triton\nimport rmsnorm_kernel\nfrom rmsnorm_kernel import rmsnorm\n"
                                     "from core.kernel_utils import DEVICE\nfrom core import kernel_utils\n")
            assert layering_violations(root) == ([], [])
            (root / made).write_text("import rmsnorm_kernel as r\nfrom swiglu_kernel import _act_out\n"
                                     "x = r._normalize_rows\ny = r.__doc__\n")
            _, private = layering_violations(root)
            assert len(private) == 2 and "swiglu_kernel._act_out" in " ".join(private), private
    record("the layer check finds core -> lesson, core -> library, lesson -> library, -> a script, private names",
           0.0, 0.0, True)


def _loads_more_than_the_standard_library(node) -> bool:
    """Whether an import statement loads more than Python's standard library, pytest and the start-up."""
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(name.split(".")[0] not in sys.stdlib_module_names | {"pytest", "__future__"}
               and name != "playbook.startup" for name in names)


def test_every_test_file_run_as_a_script_starts_up_first():
    """A test file run as a script (its report: `python rmsnorm_test.py`; a torchrun worker of a two-process
    test) has no conftest.py to call the start-up: it calls playbook.startup.start() itself, before the
    kernels load (without it, on a machine without a GPU, the kernels are refused or the interpreter lacks
    its fix-ups)."""
    missing = []
    for path in sorted([*ROOT.glob("*_test.py"), *(ROOT / "tests").glob("*_test.py")]):
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
            continue
        calls = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)
                 and "start(" in ast.unparse(n)]
        first_import = next((n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                             and _loads_more_than_the_standard_library(n)), None)
        if not calls or (first_import is not None and calls[0].lineno > first_import):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"run as scripts without the start-up first: {missing}"
    record("every test file run as a script calls the start-up before its imports", 0.0, 0.0, True)


def test_lessons_use_only_each_others_public_names():
    _, private = layering_violations()
    assert not private, "a lesson uses another lesson's private names:\n" + "\n".join(private)
    record("the lessons use each other's public names only", 0.0, 0.0, True)


# In a fresh process: import every module of core/ and playbook/ and every lesson, and compare what a start-up would
# change (the environment, the SIGINT and SIGTERM handlers, Triton's functions that the interpreter's
# fix-ups replace, transformers' rotary embedding that the rope lesson patches) before and after.
_IMPORT_EVERYTHING = """
import importlib, json, os, signal, sys
from pathlib import Path

import triton.runtime.interpreter as interpreter
from triton.runtime.jit import JITFunction
import transformers.models.llama.modeling_llama as llama

def snapshot():
    return {"environ": dict(os.environ),
            "signals": {name: repr(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM")},
            "functions": {"JITFunction.__call__": repr(JITFunction.__call__), "JITFunction.run": repr(JITFunction.run),
                          "interpreter._patch_lang_tensor": repr(getattr(interpreter, "_patch_lang_tensor", None)),
                          "llama.apply_rotary_pos_emb": repr(llama.apply_rotary_pos_emb)}}

before = snapshot()
root = Path.cwd()
names = ["playbook", "core"] + [".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                                for p in sorted([*(root / "core").glob("*.py"), *(root / "playbook").rglob("*.py"),
                                                 *root.glob("*_kernel.py")])]
for name in names:
    importlib.import_module(name)
after = snapshot()
print(json.dumps({"imported": names, "before": before, "after": after}, default=str))
"""


def test_importing_changes_nothing():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_SCALE_LAUNCH_QUEUES",
                                                           "PYTORCH_CUDA_ALLOC_CONF", "HF_HUB_DISABLE_PROGRESS_BARS")}
    out = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = got["before"], got["after"]
    changed = {k: (before["environ"].get(k), v) for k, v in after["environ"].items() if before["environ"].get(k) != v}
    changed |= {k: (v, None) for k, v in before["environ"].items() if k not in after["environ"]}
    assert not changed, f"importing changed the environment: {changed}"
    assert after["signals"] == before["signals"], (before["signals"], after["signals"])
    assert after["functions"] == before["functions"], (before["functions"], after["functions"])
    lessons = [n for n in got["imported"] if n.endswith("_kernel")]
    assert len(lessons) >= 9 and "core.kernel_utils" in got["imported"], got["imported"]
    record(f"importing {len(got['imported'])} modules ({len(lessons)} lessons) changes no environment variable, "
           "signal handler or third-party function", 0.0, 0.0, True)


# In a fresh process without the start-up's variables: what start() sets, and what it keeps.
_START = """
import json, os, signal, sys
user = sys.argv[1] == "user"
import triton  # imported first, by another library: the interpreter's fix-up of Triton's own helpers is needed
from triton.runtime.jit import JITFunction
gpu_call = JITFunction.__call__
from playbook.startup import start
start()
handlers = [repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)]
start()  # again: nothing more
call = JITFunction.__call__
from core import kernel_utils
import rmsnorm_kernel, torch
names = ("CUDA_SCALE_LAUNCH_QUEUES", "PYTORCH_CUDA_ALLOC_CONF", "HF_HUB_DISABLE_PROGRESS_BARS", "TRITON_INTERPRET")
out = {"env": {n: os.environ.get(n) for n in names}, "gpu": torch.cuda.is_available(),
       "interpret": kernel_utils.INTERPRET, "knob": bool(triton.knobs.runtime.interpret),
       "patched_once": call is JITFunction.__call__ and call is not gpu_call,
       "handlers_kept": handlers == [repr(signal.default_int_handler), repr(signal.SIG_DFL)]}
if out["interpret"]:
    x = torch.randn(4, 64)
    out["kernel_ran"] = bool(torch.allclose(rmsnorm_kernel.rmsnorm(x, torch.ones(64)),
                                            rmsnorm_kernel.rmsnorm_ref(x, torch.ones(64)), atol=1e-4))
start("while starting")
out["while_starting"] = getattr(signal.getsignal(signal.SIGINT), "while_starting", False)
print(json.dumps(out))
"""


def test_start_does_what_importing_used_to():
    """playbook.startup.start(): the environment defaults (a value already set is kept), Ctrl-C while starting
    when asked, and without a GPU Triton's interpreter, in which a lesson imported afterwards runs on the CPU."""
    names = ("CUDA_SCALE_LAUNCH_QUEUES", "PYTORCH_CUDA_ALLOC_CONF", "HF_HUB_DISABLE_PROGRESS_BARS", "TRITON_INTERPRET")
    bare = {k: v for k, v in os.environ.items() if k not in names}
    results = {}
    for who, env in (("bare", bare), ("user", dict(bare, CUDA_SCALE_LAUNCH_QUEUES="2x", HF_HUB_DISABLE_PROGRESS_BARS="0",
                                                   PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False"))):
        out = subprocess.run([sys.executable, "-c", _START, who], cwd=ROOT, preexec_fn=signals_as_from_a_shell, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        results[who] = json.loads(out.stdout.strip().splitlines()[-1])
    got, kept = results["bare"], results["user"]
    assert got["env"]["CUDA_SCALE_LAUNCH_QUEUES"] == "4x" and kept["env"]["CUDA_SCALE_LAUNCH_QUEUES"] == "2x", results
    assert got["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True", got
    assert kept["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False", kept
    assert got["env"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and kept["env"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"
    assert got["handlers_kept"] and got["while_starting"], got  # start() leaves them; start(what) sets them
    if got["gpu"]:
        assert not got["interpret"] and got["env"]["TRITON_INTERPRET"] is None, got
    else:
        assert got["env"]["TRITON_INTERPRET"] == "1" and got["interpret"] and got["knob"], got
        assert got["patched_once"] and got["kernel_ran"], got
    record(f"start(): {got['env']} ({'GPU' if got['gpu'] else 'no GPU: the interpreter, a lesson ran'}); "
           "a user's values kept", 0.0, 0.0, True)


def test_start_keeps_a_user_switch_and_refuses_a_lesson_imported_before_it():
    """TRITON_INTERPRET=0 set by the user is kept; without a GPU, a lesson imported before start() holds
    kernels made for the GPU: its first launch on CPU tensors, or start() itself, says to call start() first."""
    code = ("import os; from playbook.startup import start; start(); "
            "from core import kernel_utils; print(os.environ['TRITON_INTERPRET'], kernel_utils.INTERPRET)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="0"),
                         capture_output=True, text=True, timeout=600)
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr[-2000:]
    import torch

    if torch.cuda.is_available():
        pytest.skip("a lesson imported before start() is what a GPU runs")
    bare = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for code in ("import torch, rmsnorm_kernel; rmsnorm_kernel.rmsnorm(torch.ones(2, 8), torch.ones(8))",
                 "import rmsnorm_kernel; from playbook.startup import start; start()"):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=bare, capture_output=True, text=True,
                             timeout=600)
        last = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 1 and "RuntimeError" in last and "playbook.startup.start()" in last, out.stderr[-2000:]
    record("a user's TRITON_INTERPRET=0 kept; a lesson imported before start(): one error naming start()",
           0.0, 0.0, True)


def test_results_hold_evidence_listed_in_the_index():
    files = [p for p in (ROOT / "results").rglob("*") if p.is_file() and "traces" not in p.parts]
    tracked = set(subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.split())
    files = [p for p in files if str(p.relative_to(ROOT)) in tracked] if tracked else files
    code = [p.name for p in files if p.suffix not in EVIDENCE]
    assert not code, f"results/ holds evidence only, not {code}"
    index = (ROOT / "results" / "README.md").read_text()
    # listed by its name, or as `stem.json`, `.log` (the index's shorthand for one run's files)
    unlisted = [str(p.relative_to(ROOT / "results")) for p in files if p.name != "README.md"
                and p.name not in index and not (p.stem in index and f"`{p.suffix}`" in index)]
    assert not unlisted, f"not in results/README.md: {unlisted}"
    record(f"results/: {len(files)} evidence files, each in the index", 0.0, 0.0, True)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Repository layout: test report"))
