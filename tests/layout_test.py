"""The repository's layout shows its architecture: lessons and scripts on top, the library in playbook/.

    $ pytest tests/layout_test.py

- The top level holds what a learner runs or reads: the entry scripts and the kernel lessons
  (`<name>_kernel.py` / `<name>_test.py`, each named by the registry), nothing else.
- `playbook/` is a library: imported, never run (no `__main__` block), and importing the package
  itself imports no torch (the set-up check runs before torch is installed).
- No import cycles, counting the imports inside functions too: a reader can follow each one down.
- `results/` holds evidence only (logs, JSON, CSV, PNG, text), each file listed in results/README.md.
"""

import ast
import subprocess
import sys
from pathlib import Path

from playbook import registry
from playbook.testkit import record, run_as_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"profile_baseline.py", "benchmark_kernels.py", "finetune_baseline.py", "finetune_optimized.py",
           "finetune_trainer.py", "distill.py", "walkthrough.py", "selfcheck.py", "chat.py", "export.py"}
EVIDENCE = {".log", ".json", ".csv", ".png", ".txt", ".md", ".jsonl"}


def test_top_level_is_scripts_and_lessons():
    lessons = {name for o in registry.OPTIMIZATIONS for pair in o.lessons for name in pair}
    found = {p.name for p in ROOT.glob("*.py")}
    extra = found - SCRIPTS - lessons - {"conftest.py"}
    assert not extra, f"library code at the top level: {sorted(extra)} (it belongs in playbook/)"
    assert SCRIPTS <= found, sorted(SCRIPTS - found)
    record(f"top level: {len(SCRIPTS)} scripts, {len(lessons)} lesson files, conftest.py", 0.0, 0.0, True)


def test_the_library_is_never_run():
    for path in sorted((ROOT / "playbook").glob("*.py")):
        tree = ast.parse(path.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert not mains, f"{path.name} has a __main__ block: entry points are top-level scripts"
    out = subprocess.run([sys.executable, "-c", "import sys, playbook; print('torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    record("playbook/: no __main__ block; importing the package imports no torch", 0.0, 0.0, True)


def import_graph() -> dict:
    """module -> the project's modules it imports, at module level or inside functions."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p
             for p in [*ROOT.glob("*.py"), *(ROOT / "playbook").glob("*.py")]}
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
    run_as_script(sys.modules[__name__])
