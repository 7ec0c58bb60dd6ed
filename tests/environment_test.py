"""The environment variables the scripts read (playbook/runtime/environment.py): each checked as a flag is, a bad value
stopped as each script starts with one line naming it, its value and what it takes (exit code 2), and the figure
a variable supplies named as its source where it is used.

    $ pytest tests/environment_test.py
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import testkit
from playbook.model import pretrained
from playbook.plan import check, free_memory
from playbook.runtime import environment
from playbook.config import make_parser, parse_config
from playbook.model.registry import DEFAULT_KERNELS

ROOT = Path(__file__).resolve().parent.parent


def _refused(capsys, read, name: str, value: str, *says: str) -> str:
    """Call `read` with `name` set to `value`: it must end with exit code 2 and one line naming the variable and
    its value, and saying each of `says` (a reader's BadValue printed as its callers print it, through
    environment.refused; a caller's line as it printed it). Returns the line."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv(name, value)
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            try:
                read()
            except environment.BadValue as err:
                raise environment.refused(err) from None
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, (value, err)
    assert err.startswith(f"error: {name}=") and (value in err or repr(value) in err), (value, err)
    for word in says:
        assert word in err, (value, word, err)
    return err


def test_the_free_memory_stand_in_takes_a_positive_number_of_gb(monkeypatch, capsys):
    """PLAYBOOK_FREE_MEMORY_GB=abc and =80GB stopped finetune_optimized.py, finetune_baseline.py and distill.py with
    `ValueError: could not convert string to float`; =nan, =-5, =0 went on to "this machine has nan GB". Now a
    positive, finite number of GB is taken, with its unit written out or not; anything else is one line."""
    for value, gb in (("80", 80.0), ("80GB", 80.0), (" 2.5 gb ", 2.5), ("1e3", 1000.0), ("0.001", 0.001)):
        monkeypatch.setenv(environment.FREE_MEMORY_GB, value)
        assert environment.free_memory_gb() == gb, value
    for blank in ("", "  "):  # unset, as an empty shell variable leaves it: this machine's own free memory
        monkeypatch.setenv(environment.FREE_MEMORY_GB, blank)
        assert environment.free_memory_gb() is None
    monkeypatch.delenv(environment.FREE_MEMORY_GB)
    takes = "a positive number of GB"
    for value, why in (("abc", "is not a number of GB"), ("80GiB", "is not a number of GB"),
                       ("80 MB", "is not a number of GB"), ("nan", "is not a finite number"),
                       ("inf", "is not a finite number"), ("1e400", "is not a finite number"),
                       ("-5", "is not above 0"), ("0", "is not above 0"), ("-0.0", "is not above 0")):
        _refused(capsys, environment.free_memory_gb, environment.FREE_MEMORY_GB, value, why, takes)
    # where the plan reads it, a value set after the start-up is checked there too: one line, no ValueError
    cfg = parse_config(make_parser("t", kernels_default=DEFAULT_KERNELS), "finetune_optimized", [])
    _refused(capsys, lambda: check.check(cfg), environment.FREE_MEMORY_GB, "80GiB", takes)
    # free_memory itself raises it as a ValueError holding the line, printing nothing (export.py says it its way)
    monkeypatch.setenv(environment.FREE_MEMORY_GB, "abc")
    with pytest.raises(ValueError, match="^PLAYBOOK_FREE_MEMORY_GB=abc is not a number of GB: it takes"):
        free_memory.free_memory("cpu")
    assert capsys.readouterr().err == ""


def test_the_memory_plan_names_the_stand_in_as_its_source(monkeypatch, capsys):
    """The plan's lines said "this machine has 2.4 GB"; the figure came from PLAYBOOK_FREE_MEMORY_GB, and now they
    say so: the table's free line, the stop's line and the default rounding's line."""
    monkeypatch.setenv(environment.FREE_MEMORY_GB, "2.4")
    argv = ["--model", "llama-3.1-8b", "--batch-size", "1", "--seq-len", "128", "--optimizer", "adamw-triton"]
    cfg = parse_config(make_parser("t", kernels_default=DEFAULT_KERNELS), "finetune_optimized", argv)
    with pytest.raises(SystemExit):
        check.start(cfg)
    captured = capsys.readouterr()
    assert "GB  PLAYBOOK_FREE_MEMORY_GB=2.4: does not fit" in captured.out, captured.out
    assert "PLAYBOOK_FREE_MEMORY_GB=2.4 says this machine has 2.4 GB free" in captured.err, captured.err
    rounding = [line for line in captured.out.splitlines() if line.startswith("Optimizer rounding:")]
    assert rounding and "PLAYBOOK_FREE_MEMORY_GB=2.4 says this machine has 2.4 GB free" in rounding[0], rounding


def test_the_results_folder_is_a_folder(capsys, tmp_path):
    """PLAYBOOK_RESULTS_DIR naming a file is refused; a missing folder is taken (the runs make it)."""
    (tmp_path / "file").write_text("not a folder\n")
    _refused(capsys, environment.results_dir, environment.RESULTS_DIR, str(tmp_path / "file"),
             "is a file, not a folder", "it takes the folder where runs write their summaries")


def test_the_model_cache_is_a_folder_named_where_it_is_used(monkeypatch, capsys, tmp_path):
    """PLAYBOOK_MODEL_CACHE naming a file is refused (it takes a folder); a cache that cannot be written is named
    with the variable that chose it."""
    (tmp_path / "file").write_text("not a folder\n")
    for read in (environment.model_cache, pretrained.cache_root):
        _refused(capsys, read, environment.MODEL_CACHE, str(tmp_path / "file"), "is a file, not a folder",
                 "it takes the folder where converted models are kept")
    monkeypatch.setenv(environment.MODEL_CACHE, "")
    assert pretrained.cache_root().name == "models"  # empty: the default
    monkeypatch.setenv(environment.MODEL_CACHE, str(tmp_path / "cache"))
    assert pretrained.cache_root() == tmp_path / "cache"  # made where missing, when a conversion writes there
    monkeypatch.setenv(environment.MODEL_CACHE, "/proc/no-such-cache")  # a folder no one can make
    with pytest.raises(SystemExit) as stop:
        pretrained._start_partial(pretrained.cache_root() / "smollm2-135m")
    assert "(from PLAYBOOK_MODEL_CACHE=/proc/no-such-cache)" in str(stop.value.code), stop.value.code


def test_the_test_report_file_is_a_file_that_can_be_written(monkeypatch, capsys, tmp_path):
    """TESTKIT_REPORT naming a folder, a file in a missing folder, or a file that cannot be opened: one line, not
    the IsADirectoryError / FileNotFoundError / OSError of opening it."""
    (tmp_path / "file").write_text("a file, not a folder\n")
    for value, why in ((str(tmp_path), "is a folder"), (str(tmp_path / "no" / "r.txt"), "a folder that does not exist"),
                       (str(tmp_path / "file" / "r.txt"), "which is not a folder")):
        _refused(capsys, environment.report_file, environment.REPORT_FILE, value, why, "full report")
    too_long = str(tmp_path / ("x" * 300))  # a name no file system here takes
    _refused(capsys, environment.report_file, environment.REPORT_FILE, too_long, "cannot be used (File name too long)")
    monkeypatch.setattr(environment, "report_file", lambda: Path(too_long))  # past the check: opening it fails
    monkeypatch.setattr(sys, "argv", ["environment_test.py"])  # run_as_script's own command line: no options
    _refused(capsys, lambda: testkit.run_as_script(__name__, "t"), environment.REPORT_FILE, too_long,
             "cannot be written (File name too long)")


def test_cpu_demo_and_torchruns_variables_take_what_they_mean(monkeypatch, capsys):
    """CPU_DEMO=yes (or true, 2) was read as "not 1" and silently ignored; WORLD_SIZE=abc, an empty WORLD_SIZE or
    RANK=-1 stopped the scripts with a ValueError from int()."""
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(environment.CPU_DEMO, value)
        assert environment.cpu_demo() is on, value
    monkeypatch.delenv(environment.CPU_DEMO)
    for value in ("yes", "true", "2"):
        _refused(capsys, environment.cpu_demo, environment.CPU_DEMO, value, "is neither 1 nor 0", "it takes 1")
    for name, value in (("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("RANK", "-1"), ("LOCAL_RANK", "x"),
                        ("WORLD_SIZE", "\u00b9"), ("RANK", "\u00b2")):  # superscripts pass str.isdigit(), then fail int()
        _refused(capsys, environment.check, name, value, "is not a whole number", "torchrun sets it")
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    environment.check()  # torchrun's own values pass
    assert [environment.torchrun_value(n) for n in environment.TORCHRUN] == [2, 0, 1]


def test_torchruns_variables_empty_or_blank_are_the_default(monkeypatch):
    """Unset, empty or blank means the default, as the module's documentation says: an empty WORLD_SIZE and a blank
    LOCAL_RANK were refused by the start-up, and int("") then failed where the scripts read them."""
    from core.process import world

    for value in ("", "  "):
        for name in environment.TORCHRUN:
            monkeypatch.setenv(name, value)
        environment.check()
        assert [environment.torchrun_value(n) for n in environment.TORCHRUN] == [1, 0, 0], repr(value)
        assert world() == (0, 1), repr(value)
        cfg = parse_config(make_parser("t", kernels_default=DEFAULT_KERNELS), "finetune_optimized", [])
        assert cfg.run.device.index in (None, 0), repr(value)  # (parsed without an int() error: one process)
        from playbook.startup import start

        start(kernels=False)  # unset for the libraries that read them too (int("") in transformers' arguments)
        assert not [n for n in environment.TORCHRUN if n in os.environ], repr(value)


def test_a_home_folder_this_machine_does_not_know_is_one_line(capsys):
    """PLAYBOOK_RESULTS_DIR=~otheruser/runs (a user not on this machine) ended in Path.expanduser's RuntimeError."""
    for name, read in ((environment.RESULTS_DIR, environment.results_dir),
                       (environment.MODEL_CACHE, environment.model_cache),
                       (environment.REPORT_FILE, environment.report_file)):
        _refused(capsys, read, name, "~no-such-user-kp/runs", "starts with ~no-such-user-kp, a home folder this "
                 "machine does not know", "it takes")


@pytest.mark.parametrize("argv, name, value, says", [
    (["finetune_optimized.py"], "PLAYBOOK_FREE_MEMORY_GB", "abc", "is not a number of GB"),
    (["finetune_baseline.py"], "PLAYBOOK_FREE_MEMORY_GB", "nan", "is not a finite number"),
    (["distill.py"], "PLAYBOOK_FREE_MEMORY_GB", "-5", "is not above 0"),
    (["selfcheck.py", "--setup"], "CPU_DEMO", "yes", "is neither 1 nor 0"),
], ids=["finetune_optimized", "finetune_baseline", "distill", "selfcheck"])
def test_each_script_refuses_a_bad_value_as_it_starts(argv, name, value, says):
    """The start-up (playbook.startup.start) checks every variable before the script does anything: one line,
    exit code 2, no traceback (each process stops before torch is imported: well under a second)."""
    env = {k: v for k, v in os.environ.items() if k not in (environment.FREE_MEMORY_GB, environment.CPU_DEMO)}
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, env={**env, name: value}, capture_output=True, text=True,
                         timeout=120)
    err = out.stderr.strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1, (out.returncode, err)
    assert err.startswith(f"error: {name}={value} {says}: it takes"), err


def test_a_results_folder_that_cannot_be_written_says_how_to_choose_another(monkeypatch, capsys):
    """A read-only checkout was told to "choose a writable directory" without being told how: the line names
    PLAYBOOK_RESULTS_DIR, the variable that chooses it."""
    from playbook.run import resume

    monkeypatch.setattr(resume, "RESULTS_DIR", Path("/proc/playbook-no-results"))  # a folder no one can make
    cfg = parse_config(make_parser("t", kernels_default=DEFAULT_KERNELS), "finetune_optimized", [])
    with pytest.raises(SystemExit) as stop:
        resume.check_output_folders(cfg)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "the results folder /proc/playbook-no-results cannot be written" in err, err
    assert "set PLAYBOOK_RESULTS_DIR to a writable folder" in err, err
