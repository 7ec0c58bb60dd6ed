"""Files on disk: the results folder, and files written whole or not at all.

    >>> from playbook.store.files import RESULTS_DIR, atomic_file, result_path, write_atomic
    >>> write_atomic(result_path("my-run"), json.dumps(summary))      # text or bytes
    >>> with atomic_file(RESULTS_DIR / "table.csv") as tmp:           # a writer that streams into a file by name
    ...     with open(tmp, "w", newline="") as f:
    ...         csv.writer(f).writerows(rows)

Every file this project writes goes through atomic_file: a temporary file in the target's folder (the
host, the process and a random part in its name, hidden), made with the permissions a plain open()
gives; once written it is flushed to disk (fsync), renamed over the target in one os.replace, and the
folder is flushed so that the rename is on disk too. A reader never sees half a file, and a file already
at the target stays whole when the write fails. A failed write removes the temporary file and raises
OSError naming the target (the file its user knows), not the temporary one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import socket
from pathlib import Path
from typing import Iterator

from playbook.runtime import environment

# Where the scripts write results/<tag>.json, its metrics, plots and traces: the repository's results/ folder, or
# the folder PLAYBOOK_RESULTS_DIR names (the test suite's own temporary folder: tests write nothing into the tree).
RESULTS_DIR = environment.results_dir() or Path(__file__).resolve().parents[2] / "results"


def result_path(tag: str, suffix: str = ".json", overwrite: bool = False, folder: Path = RESULTS_DIR) -> Path:
    """results/<tag><suffix>, or, when that exists and overwrite is False, the first free <tag>-N<suffix>."""
    path = folder / f"{tag}{suffix}"
    n = 2
    while path.exists() and not overwrite:
        path = folder / f"{tag}-{n}{suffix}"
        n += 1
    return path


# ------------------------------------------------------------------------------------------------
# Flushing to disk
# ------------------------------------------------------------------------------------------------
def fsync_file(path: Path) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    """Flush a folder's entries to disk (a file renamed into it, a file removed)."""
    fsync_file(path)  # (a folder opens read-only as a file does)


def fsync_tree(root: Path) -> None:
    """Flush every file under root, then every folder (so their entries are on disk too)."""
    for folder, _, names in os.walk(root):
        for name in names:
            fsync_file(Path(folder, name))
        fsync_directory(Path(folder))


# ------------------------------------------------------------------------------------------------
# Files written whole or not at all
# ------------------------------------------------------------------------------------------------
def temporary_beside(path: Path) -> Path:
    """A hidden file name beside `path` for this process alone: the host, the process and a random part in it, so
    that two writers of one file (two processes, two hosts on a shared disk) never write, rename or remove each
    other's, and a leftover of a process that died can be told by its name."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_file(path) -> Iterator[Path]:
    """Yield the path of a new, empty temporary file beside `path`, for the caller to write (by name: open(),
    savefig(), a writer that opens the file itself). On leaving the block without an exception the file is
    flushed to disk and renamed to `path`, and the folder flushed; on an exception the temporary file is removed
    and `path` left as it was. An OSError that names no file, or the temporary one, is raised naming `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    try:
        # created as open() creates a file: mode 0o666 less the umask (tempfile.mkstemp's is the owner's only)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno is not None and err.filename in (None, str(tmp)):  # (a write into
            # a descriptor names no file)
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def write_atomic(path, data: str | bytes) -> None:
    """Write text (UTF-8) or bytes to `path` through atomic_file: whole, on disk, or not at all."""
    with atomic_file(path) as tmp:
        if isinstance(data, (bytes, bytearray, memoryview)):
            with open(tmp, "wb") as f:
                f.write(data)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(data)


# ------------------------------------------------------------------------------------------------
# Why a write failed, in the user's words
# ------------------------------------------------------------------------------------------------
# A write that stopped short, as the writers that do not pass the system's error on report it: torch's serializer
# ("[enforce fail at inline_container.cc:672] . unexpected pos 1234 vs 1200", "PytorchStreamWriter failed writing
# file data/0: file write failed") and numpy's tofile ("32768 requested and 31552 written", the GGUF writer's).
# The system refused the rest of the data, which on a local disk is a full disk or a used-up quota.
_SHORT_WRITE = re.compile(r"inline_container\.cc|file write failed|unexpected pos \d+ vs \d+|"
                          r"\d+ requested and \d+ written")


def is_full_disk(err: BaseException) -> bool:
    """Whether `err` (or the error it was raised from) is a write refused for want of space: ENOSPC, EDQUOT, or a
    writer's report of a write that stopped short (_SHORT_WRITE)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if _SHORT_WRITE.search(str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


def write_failure(err: BaseException) -> str:
    """The reason a write failed, for the one line that reports it: a full disk named as one, whatever the writer
    that met it said (a short write keeps the writer's words in brackets); anything else as its first line."""
    said = (err.strerror if isinstance(err, OSError) and err.strerror else str(err)).strip()
    said = said.splitlines()[0][:200] if said else type(err).__name__
    if not is_full_disk(err):
        return said
    if isinstance(err, OSError) and err.errno == errno.EDQUOT:
        return "the disk quota is used up"
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return "the disk is full"
    return f"the disk is full (the write stopped short: {said})"
