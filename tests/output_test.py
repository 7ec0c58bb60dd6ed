"""Tests of the scripts' output when it cannot be written: a reader that went away, a full disk.

    $ PYTHONPATH=. python tests/output_test.py     # a readable report
    $ pytest tests/output_test.py

What playbook/runtime/output.py promises (docs/troubleshooting.md): a closed stdout (`| head`) silences the output
and the script goes on to its end, writing its checkpoints and results/ files, with its own exit code; stdout
on a full disk is one line on stderr naming where it went, then the same; a results/ file that cannot be
written for want of space is one line naming it and what was kept, exit code 1. Checked:

- the mechanism in this process, on a pipe whose reader is gone and on /dev/full;
- every script that prints (`--help`, in one child process that runs each in turn) into both;
- two real runs: finetune_optimized.py whose reader goes away after the first step (its checkpoints and
  results/<tag>.json are all written), finetune_baseline.py with stdout on /dev/full;
- a results/ file on a full disk: write_atomic names it and leaves the file that was there whole, run_main and
  the training loop end in one line.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import errno
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from playbook.runtime import output, signals
from playbook.store import files
from testkit import record, run_as_script

HERE = Path(__file__).resolve().parent.parent  # the repository root
FULL = "No space left on device"
# Every script that prints, but export.py (tests/export_test.py holds its own) and chat.py (its answers:
# tests/probe_test.py's cases, exit code 141 and 1).
SCRIPTS = ["finetune_baseline.py", "finetune_optimized.py", "finetune_trainer.py", "distill.py", "profile_baseline.py",
           "benchmark_kernels.py", "walkthrough.py", "selfcheck.py"]
TINY = ["--model", "llama-tiny", "--batch-size", "1", "--seq-len", "32", "--timing-warmup-steps", "1"]


@pytest.fixture
def fresh(monkeypatch):
    """This process's record of a lost stdout, as before any failure (put back afterwards)."""
    monkeypatch.setitem(output._LOST, "stdout", None)


def test_a_closed_pipe_is_quiet_and_a_full_disk_is_one_line(fresh, capsys):
    read, write = os.pipe()
    os.close(read)  # the reader went away
    closed = output._Guarded(os.fdopen(write, "w"), "stdout")
    for _ in range(3):
        print("x" * 70_000, file=closed, flush=True)  # more than a pipe holds
    closed.close()  # as at exit: what was buffered goes nowhere, without an error
    assert output.lost() == output.CLOSED and capsys.readouterr().err == ""
    output._LOST["stdout"] = None
    full = output._Guarded(open("/dev/full", "w"), "stdout")
    for line in ("a line", "another"):
        print(line, file=full, flush=True)
    full.close()
    said = capsys.readouterr().err
    assert output.lost() == output.FAILED and said.count("\n") == 1, said
    assert said.startswith(f"error: writing to standard output (/dev/full) failed: {FULL}; the rest of the output is "
                           "dropped; the script goes on"), said
    record("a closed pipe: silent; /dev/full: one line naming it; neither raises, at exit neither", 0, 0, True)


# One child process: each script's --help into a pipe whose reader is gone, then into /dev/full, through runpy
# as `python SCRIPT --help` runs it (its start-up, its parser), then a flush as at exit. It prints
# {script: {case: [exit code, the exception that escaped or None, stderr]}} on its real stdout.
_EVERY_SCRIPT = r"""
import json, os, runpy, sys, tempfile, traceback
from playbook.runtime import output
real = os.dup(1)
got = {}
for script in sys.argv[1:]:
    got[script] = {}
    for case in ("pipe", "/dev/full"):
        if case == "pipe":
            read, write = os.pipe(); os.close(read); os.dup2(write, 1); os.close(write)
        else:
            full = os.open("/dev/full", os.O_WRONLY); os.dup2(full, 1); os.close(full)
        err = tempfile.TemporaryFile()
        saved_err = os.dup(2); os.dup2(err.fileno(), 2)
        output._LOST["stdout"] = None
        sys.argv = [script, "--help"]
        code, escaped = None, None
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            escaped = traceback.format_exc(limit=3)
        try:
            sys.stdout.flush()  # what Python does at exit
        except BaseException:
            escaped = (escaped or "") + "at exit: " + traceback.format_exc(limit=1)
        sys.stderr.flush(); os.dup2(saved_err, 2); os.close(saved_err)
        err.seek(0)
        got[script][case] = [code, escaped, err.read().decode(errors="replace")]
os.write(real, (json.dumps(got) + "\n").encode())
"""


def test_every_script_into_a_closed_pipe_and_a_full_disk():
    out = subprocess.run([sys.executable, "-c", _EVERY_SCRIPT, *SCRIPTS], cwd=HERE, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(HERE)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    line = f"error: writing to standard output (/dev/full) failed: {FULL}; {output.GOES_ON}"
    for script in SCRIPTS:
        (code, escaped, said), (full_code, full_escaped, full_said) = got[script]["pipe"], got[script]["/dev/full"]
        # (a library's own notice while it is imported may come first: bitsandbytes' on a CPU)
        errors = [text for text in (said + full_said).splitlines() if "error" in text.lower() or "Traceback" in text]
        assert escaped is None and code in (0, None), (script, "pipe", code, escaped, said)
        assert full_escaped is None and full_code in (0, None), (script, "/dev/full", full_code, full_escaped)
        assert errors == [line], (script, said, full_said)
    record(f"--help of {len(SCRIPTS)} scripts: into a closed pipe silent, exit 0; into /dev/full one line, exit 0",
           0, 0, True)


def _cleanup(*tags):
    for tag in tags:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (files.RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)


def _reader_goes_away(argv, after: str):
    """Run `python *argv`, read its stdout until a line holds `after`, then close the pipe (as `| head` does):
    (exit code, what was read, stderr)."""
    proc = subprocess.Popen([sys.executable, *argv], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    read = ""
    for line in proc.stdout:
        read += line
        if after in line:
            break
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=300), read, err


def _into_dev_full(argv):
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, *argv], cwd=HERE, stdout=full, stderr=subprocess.PIPE, text=True,
                             timeout=300)
    return out.returncode, out.stderr


def test_a_run_goes_on_and_saves_everything_when_its_reader_goes_away_or_its_disk_is_full(tmp_path):
    """`finetune_optimized.py ... --save-every 2 | head` died at the step after the reader left (exit 1, one
    checkpoint, no results/<tag>.json); with stdout on /dev/full it was a traceback. Both runs now go on to their
    end: every checkpoint, the summary, exit code 0; the full disk is one line on stderr."""
    piped = ["finetune_optimized.py", *TINY, "--kernels", "none", "--steps", "6", "--save-every", "2", "--log-every",
             "1", "--output-dir", str(tmp_path / "out"), "--tag", "test_output_piped", "--overwrite"]
    full = ["finetune_baseline.py", *TINY, "--steps", "3", "--tag", "test_output_full", "--overwrite"]
    try:  # each is a process of its own (~7 s of imports on one core): at the same time
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_reader_goes_away, piped, "step     1/6")
            (full_code, full_said), (code, read, said) = pool.submit(_into_dev_full, full).result(), first.result()
        saved = {tag: json.loads((files.RESULTS_DIR / f"{tag}.json").read_text())
                 for tag in ("test_output_piped", "test_output_full") if (files.RESULTS_DIR / f"{tag}.json").exists()}
    finally:
        _cleanup("test_output_piped", "test_output_full")
    assert "step     2/6" not in read, read  # the reader left after step 1
    assert code == 0 and "Traceback" not in said and "error" not in said, (code, said[-2000:])
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4",
                                                                             "checkpoint-6"]
    assert len(saved.get("test_output_piped", {}).get("losses", [])) == 6, saved.keys()
    assert full_code == 0 and "Traceback" not in full_said, (full_code, full_said[-2000:])
    assert full_said.count("(/dev/full) failed: No space left on device") == 1, full_said
    assert len(saved.get("test_output_full", {}).get("losses", [])) == 3, saved.keys()
    record("reader gone after step 1: 6 steps, checkpoints 2, 4, 6 and the summary written, exit 0; stdout on "
           "/dev/full: one line, the summary written, exit 0", 0, 0, True)


def _fails_for_want_of_space(monkeypatch):
    """open() in playbook/store/files.py hands out files whose writes fail as on a full disk."""
    class Full:
        def __init__(self, path, mode="r", **kwargs):
            pass

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(files, "open", Full, raising=False)


def test_a_results_file_is_readable_as_open_makes_one(tmp_path):
    """write_atomic's file has the permissions a plain open() gives (its temporary file is the owner's only)."""
    import os

    files.write_atomic(tmp_path / "a.json", "{}")
    (tmp_path / "b.json").write_text("{}")
    assert os.stat(tmp_path / "a.json").st_mode == os.stat(tmp_path / "b.json").st_mode


def test_a_results_file_on_a_full_disk_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    path = tmp_path / "summary.json"
    path.write_text("the earlier run's\n")
    _fails_for_want_of_space(monkeypatch)
    with pytest.raises(OSError) as failed:
        files.write_atomic(path, "this run's")
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(path), failed.value
    assert path.read_text() == "the earlier run's\n" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    with pytest.raises(SystemExit) as stop:
        signals.run_main(lambda: files.write_atomic(path, "this run's"), "the files written before it are complete")
    said = capsys.readouterr().err
    assert stop.value.code == 1 and said == (f"error: {path} could not be written ({FULL}): free some space there; "
                                             "the files written before it are complete\n"), said
    record("a results file on a full disk: the one there kept whole, no temporary left, one line naming it", 0, 0,
           True)


def test_a_file_is_flushed_to_disk_and_a_failed_write_leaves_no_temporary(tmp_path, monkeypatch):
    """The one atomic writer (playbook/store/files.py): the file and then its folder flushed (fsync) before
    write_atomic returns, text and bytes alike; a write that fails part-way leaves no temporary file, the file there
    whole, and raises OSError naming the file."""
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    files.write_atomic(tmp_path / "a.json", "{}")
    files.write_atomic(tmp_path / "b.bin", b"\0\1")
    names = [Path(p).name for p in synced]
    assert len(names) == 4 and names[1] == names[3] == tmp_path.name, synced  # each file's temporary, then the folder
    assert names[0].startswith(".a.json.tmp-") and names[2].startswith(".b.bin.tmp-"), synced
    assert (tmp_path / "a.json").read_text() == "{}" and (tmp_path / "b.bin").read_bytes() == b"\0\1"

    with pytest.raises(OSError) as failed:
        with files.atomic_file(tmp_path / "a.json") as tmp:
            tmp.write_text("half")  # then the disk is full (an error that names no file, as a write's)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(tmp_path / "a.json"), failed.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin"]
    assert (tmp_path / "a.json").read_text() == "{}"
    record("the atomic writer: file and folder flushed; a failed write leaves no temporary, names the file", 0, 0,
           True)


class _FullFile:
    """A file on a full disk: every write fails (with no file name, as a write to a descriptor does)."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    flush = close = lambda self: None


@pytest.mark.parametrize("fails", ["metrics", "summary", "plot"])
def test_a_run_whose_results_cannot_be_written_says_so_in_one_line(fails, monkeypatch, capsys):
    """The training loop's results/ files on a full disk (the metrics, written each step; the summary; its loss
    curve): one line naming the file and what was kept, exit code 1, no traceback."""
    from playbook.model import registry
    from playbook.run import report, training
    from playbook.config import make_parser, parse_config

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if fails == "metrics":  # (MetricsLog's file)
        monkeypatch.setattr(report, "open", lambda path, mode: _FullFile(), raising=False)
    elif fails == "summary":  # (files.write_atomic's temporary file)
        _fails_for_want_of_space(monkeypatch)
    else:  # (matplotlib's file)
        monkeypatch.setattr(report, "plot_curve", full)
    cfg = parse_config(make_parser("test", kernels_default=registry.DEFAULT_KERNELS), "finetune_optimized",
                       [*TINY, "--kernels", "none", "--steps", "2", "--tag", "test_output_summary", "--overwrite"])
    try:
        with pytest.raises(SystemExit) as stop:
            training.train(cfg)
    finally:
        _cleanup("test_output_summary")
    said = capsys.readouterr().err.strip().splitlines()[-1]
    where = files.RESULTS_DIR / "test_output_summary"
    failed = {"metrics": f"{where}.metrics.jsonl", "summary": f"{where}.json", "plot": f"{where}.png"}[fails]
    kept = (f"{where}.json and {where}.metrics.jsonl are complete, and so are the checkpoints written under "
            "--output-dir" if fails == "plot" else "the run stopped before its summary; checkpoints already written "
            "under --output-dir are complete")
    assert stop.value.code == 1 and said == f"error: {failed} could not be written ({FULL}): free some space there; " \
                                            f"{kept}", said
    record(f"the {fails} on a full disk: one line naming {Path(failed).name} and what was kept, exit 1", 0, 0, True)


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "Output on a closed pipe and a full disk: test report"))
