"""Every GPU figure in README.md's tables is in the results file its row cites.

    $ python -m pytest -q tests/readme_figures_test.py       # < 1 s, reads files only

A README table that cites its evidence has a column whose header names "source" (its header may name the folder,
e.g. "source (`results/runs/`)"; a cell may name several files). For each row, every figure of the other
columns (a number, with or without a unit or bold) must appear in one of the files the row cites: as written
in a log or a markdown table, or as a number of a JSON file (a manifest of `make bench`, a script's summary)
that rounds to it. Ratio columns ("vs ...", "... x") are worked out from the figures beside them and are not
looked up. A figure typed by hand, or left behind when its file was measured again, fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\w.])")


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of a text: each a list of rows (the header first), each row its cells, separator left out."""
    out, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                current.append(cells)
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def cited_tables(text: str):
    """(header, rows, source column index, folder) of each table with a source column."""
    for table in tables(text):
        header = table[0]
        for i, name in enumerate(header):
            if name.lower().startswith("source"):
                folder = re.search(r"`([^`]+/)`", name)
                yield header, table[1:], i, ROOT / (folder.group(1) if folder else "")


def cited_files(cell: str, folder: Path) -> list[Path]:
    names = re.findall(r"`([^`]+\.(?:log|json|md|csv|txt))`", cell) + re.findall(r"\]\(([^)]+)\)", cell)
    return [(ROOT / n if n.startswith("results/") else folder / n) for n in names]


def figures(cell: str) -> list[str]:
    """The numbers a cell states, as written ("10,126", "809.0"); none in a code span (a command's options)."""
    plain = re.sub(r"`[^`]*`", "", cell).replace("*", "")
    return [m.group(1) + (m.group(2) or "") for m in NUMBER.finditer(plain)]


def json_numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in json_numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in json_numbers(v)]
    return []


def found(figure: str, path: Path) -> bool:
    """The figure as written in the file's text, or a number of a JSON file that rounds to it."""
    text = path.read_text(errors="replace")
    if re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d])", text):
        return True
    if path.suffix == ".json":
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        want = float(figure.replace(",", ""))
        return any(abs(x - want) <= 0.5 * 10 ** -decimals + 1e-12 for x in json_numbers(json.loads(text)))
    return False


def shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def check(text: str) -> list[str]:
    """One line per figure of a cited table that is not in its row's files (or a cited file that is missing)."""
    problems = []
    for header, rows, src, folder in cited_tables(text):
        for row in rows:
            files = cited_files(row[src], folder)
            missing = [p for p in files if not p.is_file()]
            if not files or missing:
                problems.append(f"row '{row[0]}': cites {', '.join(map(str, missing)) or 'no file'}")
                continue
            for col, cell in enumerate(row):
                name = header[col].lower() if col < len(header) else ""
                if col == src or name.startswith("vs") or "script" in name or "command" in name or col == 0:
                    continue
                for figure in figures(cell):
                    if re.fullmatch(r"\d+(\.\d+)?x", cell.replace("*", "").strip()):
                        continue  # a ratio
                    if not any(found(figure, p) for p in files):
                        problems.append(f"row '{row[0]}', {header[col]}: {figure} is not in "
                                        f"{', '.join(shown(p) for p in files)}")
    return problems


def test_readme_figures_are_in_their_results_files():
    text = (ROOT / "README.md").read_text()
    assert list(cited_tables(text)), "README.md has no table with a source column"
    problems = check(text)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("figure, ok", [("10,126", True), ("10,127", False), ("809.0", True), ("113.8", True)])
def test_the_check_fails_on_a_figure_not_in_its_file(tmp_path, figure, ok):
    """The same check on a small table: a figure changed by one is found missing."""
    (tmp_path / "run.log").write_text("| tokens/s (job) | 10,126 |\n| step time median (ms) | 809.0 |\n")
    (tmp_path / "run.json").write_text(json.dumps({"summary": {"peak GPU memory (GB)": 113.8312}}))
    rel = tmp_path.relative_to(ROOT) if tmp_path.is_relative_to(ROOT) else None
    folder = f"{rel.as_posix()}/" if rel else None
    if folder is None:  # the check resolves cited files under the repository: link them by absolute path instead
        cite = f"[log]({tmp_path / 'run.log'}) [json]({tmp_path / 'run.json'})"
    else:
        cite = "`run.log` `run.json`"
    text = (f"| configuration | tokens/s | source{f' (`{folder}`)' if folder else ''} |\n|---|---:|---|\n"
            f"| a row | {figure} | {cite} |\n")
    assert (check(text) == []) is ok


def test_documents_cite_only_scripts_in_the_tree():
    """README.md, docs/ and results/README.md: every `python <file>.py` / `bash <file>.sh` they name exists, and none
    sends the reader to a script outside the tree (git history, a machine's own folder)."""
    pages = [ROOT / "README.md", ROOT / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = []
    for page in pages:
        text = page.read_text()
        for pattern in (r"git show [0-9a-f]{6,}:", r"\bdevrun/", r"repository's history"):
            problems += [f"{page.relative_to(ROOT)}: '{m.group(0)}'" for m in re.finditer(pattern, text)]
        for m in re.finditer(r"(?:python3?|bash)\s+((?:[\w.-]+/)*[\w.-]+\.(?:py|sh))\b", text):
            if not (ROOT / m.group(1)).is_file():
                problems.append(f"{page.relative_to(ROOT)}: {m.group(0)} (no such file)")
    assert not problems, "\n".join(problems)
