"""Standard output and standard error in the scripts: a reader that went away, a full disk.

A script's standard output is its log (and chat.py's answers). What happens when it cannot be written:

- A reader that went away (`finetune_optimized.py ... | head`: the pipe is closed). The output stops
  there, quietly, as Unix tools do, and the script goes on to its end: a training run keeps training,
  writes its checkpoints and results/<tag>.json, and exits with its own exit code. Its output from then
  on goes to /dev/null (`silence`), so nothing printed later, and no flush at exit, fails again.
- Any other failed write (stdout on a full disk, `> /dev/full`): one line on stderr naming where stdout
  went and the error, then the same as a closed pipe: the script goes on, writes its files as usual
  and exits with its own exit code. Only the log is lost, and the line says so.
- Standard error that cannot be written (`2>&1 | head`, `2> /dev/full`): silenced the same way; there
  is nowhere to say so.

`guard()` installs this for the process (playbook.startup.start does, for every script); `lost()` says
whether stdout was lost and how, for a script whose output is its product (chat.py ends with exit code 141
when its answers could not be delivered, 1 when they could not be written). A file the script itself writes
(results/, a checkpoint) on a full disk is the script's to report: `disk_full_exit` gives its one line, which
names the file and what was kept.

This module imports no torch.
"""

from __future__ import annotations

import errno
import os
import sys

CLOSED = "closed"  # stdout's reader went away (EPIPE)
FAILED = "failed"  # another error: a full disk, an I/O error
_LOST = {"stdout": None}  # None, CLOSED or FAILED
GOES_ON = ("the rest of the output is dropped; the script goes on, and the files it writes (results/, checkpoints) "
           "are written as usual")
_SAY = {"subject": None, "after": GOES_ON}  # the words of the one line (`guard`)
# The errors of a disk that holds no more: no space, a user's quota, a file larger than `ulimit -f` allows.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def where(fd: int) -> str:
    """What file descriptor `fd` writes to, for a message: a path (/dev/full, a log file), else a pipe."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # not Linux, or the descriptor is gone
        return "a pipe or a file"
    return target if target.startswith("/") else "a pipe"


def silence(fd: int) -> None:
    """Point file descriptor `fd` at /dev/null: what is written to it from here on is dropped, without error."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except OSError:
        pass


class _Guarded:
    """A text stream whose failed writes are answered as the module docstring says, once, instead of raised."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name

    def _failed(self, err: OSError) -> None:
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError, AttributeError):
            fd = 1 if self._name == "stdout" else 2
        if self._name == "stdout" and _LOST["stdout"] is None:
            closed = isinstance(err, BrokenPipeError) or err.errno in (errno.EPIPE, errno.ECONNRESET)
            _LOST["stdout"] = CLOSED if closed else FAILED
            if not closed:
                said = err.strerror or str(err)
                after = f"; {_SAY['after']}" if _SAY["after"] else ""
                try:
                    subject = f"{_SAY['subject']} " if _SAY["subject"] else ""
                    sys.stderr.write(f"error: writing {subject}to standard output ({where(fd)}) failed: "
                                     f"{said}{after}\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
        silence(fd)

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as err:
            self._failed(err)
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as err:
            self._failed(err)
            try:
                self._stream.flush()  # what was buffered goes to /dev/null now
            except OSError:
                pass

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self._stream, name)


def guard(subject: str | None = None, after: str | None = GOES_ON) -> None:
    """From here on, sys.stdout and sys.stderr answer a failed write as the module docstring says. The line of a
    failed write says "error: writing [<subject> ]to standard output (<where>) failed: <error>; <after>".
    Calling it again changes only those words (chat.py: "the answers", nothing after)."""
    _SAY.update(subject=subject, after=after)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Guarded):
            setattr(sys, name, _Guarded(stream, name))


def lost() -> str | None:
    """How standard output was lost: CLOSED (its reader went away), FAILED (a write failed: a full disk), or
    None (it was not)."""
    return _LOST["stdout"]


# What a library says of such a write when it raises its own error (torch.save's RuntimeError, safetensors').
DISK_FULL_WORDS = tuple(os.strerror(e) for e in DISK_FULL)


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` is a write that failed for want of space: a full disk, a quota, `ulimit -f`."""
    if isinstance(err, OSError):
        return err.errno in DISK_FULL
    return isinstance(err, Exception) and any(words in str(err) for words in DISK_FULL_WORDS)


def disk_full_exit(err: Exception, kept: str) -> SystemExit:
    """The one line of a file that could not be written for want of space on stderr, "error: <path> could not
    be written (<why>): free some space there; <kept>", and the SystemExit (exit code 1) to raise. kept: what
    the run kept (its checkpoints, its results)."""
    path = getattr(err, "filename", None)
    why = getattr(err, "strerror", None) or next((w for w in DISK_FULL_WORDS if w in str(err)), str(err))
    what = f"{path} could not be written" if path else "a file could not be written"
    print(f"error: {what} ({why}): free some space there; {kept}", file=sys.stderr, flush=True)
    return SystemExit(1)
