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
import os
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
