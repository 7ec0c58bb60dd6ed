"""Ctrl-C and SIGTERM in the scripts: one line and a shell's exit code, never a traceback.

While a script starts (`exit_on_ctrl_c_while_starting`, set by `playbook.startup.start`), Ctrl-C ends the
process at once with one line and exit code 130 (SIGTERM: 143); `run_main` then runs the script's main()
with Ctrl-C as one line and exit code 130, SIGTERM (a scheduler's pre-emption) as one line and exit code
143; the training loop defers a SIGTERM to the end of its step (`defer_sigterm`). Inside one long call that
Python cannot interrupt (a step of minutes), a thread acts on the signal within seconds (the comment above
GRACE_S). Nothing here runs at import: a handler is set only when one of these functions is called.
"""

import os
import signal
import socket
import sys
import threading


# Ctrl-C while a script starts. Importing torch, transformers and the kernels takes seconds, and a
# KeyboardInterrupt raised there surfaces wherever the import happens to be: as a traceback, or
# wrapped by Python in another error (an exception raised in a class's __set_name__ becomes a
# RuntimeError). Until the script's own handling takes over (`started()`), Ctrl-C prints one line
# and ends the process at once with exit code 130: nothing has been run or written yet.


def exit_on_ctrl_c_while_starting(what: str = "nothing was run") -> None:
    """From here until `started()`, Ctrl-C is one line ("interrupted (Ctrl-C) while starting: <what>")
    and exit code 130; SIGTERM the same, "terminated (SIGTERM) ...", exit code 143. A signal that the
    process inherited as ignored, or a handler of the caller's own, is left as it is."""
    handler = _exit_at_once(what)
    for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(signum) is not default:
            continue
        try:
            signal.signal(signum, handler)
        except ValueError:  # not the main thread: signal handlers can only be set there
            pass


def _exit_at_once(what: str):
    """The handler while a process starts or imports: one line, then the process ends at once (no
    exception to travel through an import in progress)."""
    def handler(signum, _frame):
        ctrl_c = signum == signal.SIGINT
        sys.stderr.write(f"\n{'interrupted (Ctrl-C)' if ctrl_c else 'terminated (SIGTERM)'} while starting: {what}\n")
        sys.stderr.flush()
        os._exit(130 if ctrl_c else 143)  # no exception to travel through the import in progress

    handler.while_starting = True  # what `started()` looks for
    return handler


class exit_on_ctrl_c_while_importing:
    """`with exit_on_ctrl_c_while_importing(what): import torch`, in a script that is already running
    (`run_main`): during the import, Ctrl-C and SIGTERM end the process at once, with the line of
    `exit_on_ctrl_c_while_starting`. A KeyboardInterrupt raised inside an import can be caught by the
    library being imported: torch's import sometimes swallows it and completes, and the script then goes
    on as if no key had been pressed. Afterwards the handlers are the ones before (`started()`'s)."""

    def __init__(self, what: str = "nothing was run"):
        self.what, self.before = what, {}

    def __enter__(self):
        handler = _exit_at_once(self.what)
        for signum in (signal.SIGINT, signal.SIGTERM):
            current = signal.getsignal(signum)
            if current in (signal.SIG_IGN, None):  # ignored (inherited), or set outside Python: left as it is
                continue
            try:
                signal.signal(signum, handler)
                self.before[signum] = current
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for signum, handler in self.before.items():
            signal.signal(signum, handler)
        self.before = {}
        return False


# Ctrl-C once the script runs. Python raises KeyboardInterrupt wherever the main thread is, and some
# code on the way up turns it into another error: CPython's parser, which Triton's JIT and its CPU
# interpreter call, reports an interrupt inside it as "SystemError: AST constructor recursion depth
# mismatch". So the handler also remembers the key press, and a script that sees an error after it
# (`interrupted()`) reports the Ctrl-C, not the error.
_CTRL_C = {"pressed": False, "signal": "SIGINT"}


def _on_ctrl_c(signum=None, frame=None):
    _CTRL_C["pressed"] = True
    _raise_where_it_counts(signum, frame)


def _in_finalizer(frame) -> bool:
    """Whether `frame` runs inside an object's finalizer (`__del__`), called by the garbage collector."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _raise_where_it_counts(signum, frame) -> None:
    """Raise KeyboardInterrupt in the main thread. A signal can arrive while the garbage collector runs a
    finalizer (`__del__`), where Python prints an exception and drops it, and the run would go on: there
    the signal is delivered again a moment later (_thread.interrupt_main), outside the finalizer."""
    if signum is not None and _in_finalizer(frame):
        import _thread
        import threading

        threading.Timer(0.05, _thread.interrupt_main, args=(signum,)).start()
        return
    raise KeyboardInterrupt


# SIGTERM is how a scheduler (Slurm, Kubernetes, a cloud's spot instance) stops a job, with SIGKILL after
# a grace period. It is handled as Ctrl-C is (a KeyboardInterrupt, remembered for `interrupted()`), with
# exit code 143 (128 + SIGTERM) and its own word; except while `defer_sigterm(True)` holds, when it is only
# noted (`sigterm_pending()`): the training loop finishes the step in progress, saves a checkpoint there,
# and stops, so that the pre-empted job resumes. A second SIGTERM does not wait.
_SIGTERM = {"defer": False, "pending": False}


def _on_sigterm(signum=None, frame=None):
    if _SIGTERM["defer"] and not _SIGTERM["pending"]:
        _SIGTERM["pending"] = True
        return
    _CTRL_C["pressed"], _CTRL_C["signal"] = True, "SIGTERM"
    _raise_where_it_counts(signum, frame)


# A signal while the main thread is inside one long call. Python runs a signal's handler in the main thread
# between two bytecodes, so inside one long call into a C library (a matrix product of minutes on a CPU, an
# attention over millions of tokens) the handler waits for the call to return: Ctrl-C did nothing for that
# long. Python's own C-level handler also writes the signal's number to a "wakeup" descriptor at once
# (signal.set_wakeup_fd); `started()` gives it one, and a thread reads it (`_watch`):
# - Ctrl-C, or a SIGTERM that is not deferred: when the main thread has not acted on it within GRACE_S, the
#   thread prints the line the main thread would have ("interrupted (Ctrl-C): <kept>") and ends the process
#   at once (exit code 130 or 143). Checkpoints and results/ files are written under a temporary name and
#   renamed, so what was saved stays whole.
# - a SIGTERM the training loop defers: when the loop has not stopped within ANNOUNCE_S, one line says what
#   it waits for and how long that should take (`defer_sigterm`'s `waiting_for`), and that a second SIGTERM
#   or Ctrl-C stops at once: the second is then the case above.
GRACE_S = 2.0  # the main thread acts on a signal within microseconds between bytecodes
ANNOUNCE_S = 2.0  # a step that ends sooner stops the run with its own line, and no other
_WATCH = {"thread": None, "kept": "files already written are complete", "terms": 0, "waiting_for": None}


def _ours(signum) -> bool:
    """Whether the handler of `signum` is this module's (`started()`'s), not one of a caller or of an import."""
    return signal.getsignal(signum) in (_on_ctrl_c, _on_sigterm)


def _watch(sock) -> None:
    """The thread that reads the wakeup descriptor (the comment above)."""
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum not in (signal.SIGINT, signal.SIGTERM) or not _ours(signum):
                continue
            if signum == signal.SIGTERM and _SIGTERM["defer"]:
                _WATCH["terms"] += 1
                if _WATCH["terms"] == 1:
                    _later(ANNOUNCE_S, _announce)
                    continue
            _later(GRACE_S, _stop_at_once, signum)


def _later(seconds: float, call, *args) -> None:
    """call(*args) in `seconds`, on a thread that does not hold the process open once the main thread ends."""
    timer = threading.Timer(seconds, call, args=args)
    timer.daemon = True
    timer.start()


def _announce() -> None:
    """A deferred SIGTERM that the loop has not acted on yet: say what it waits for."""
    if not _SIGTERM["defer"] or _CTRL_C["pressed"]:  # the run stopped already, or is stopping
        return
    what = None
    if _WATCH["waiting_for"] is not None:
        try:
            what = _WATCH["waiting_for"]()
        except Exception:  # noqa: BLE001  (a description that fails must not end the watch)
            what = None
    _say(f"\nSIGTERM: {what or 'the run stops once the step in progress ends'}; a second SIGTERM or Ctrl-C stops "
         "at once")


def _stop_at_once(signum) -> None:
    """Ctrl-C or SIGTERM that the main thread has not acted on within GRACE_S: the line, and the end."""
    if _CTRL_C["pressed"] or not _ours(signum):  # the main thread has acted on it (or handles it its own way)
        return
    ctrl_c = signum == signal.SIGINT
    _say(f"\n{'interrupted (Ctrl-C)' if ctrl_c else 'terminated (SIGTERM)'}: {_WATCH['kept']}")
    os._exit(130 if ctrl_c else 143)


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _start_watch() -> None:
    """The wakeup descriptor and the thread that reads it (once a process, from the main thread)."""
    if _WATCH["thread"] is not None or threading.current_thread() is not threading.main_thread():
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # (set_wakeup_fd's requirement: the C handler never blocks)
    try:
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        reader.close()
        writer.close()
        return
    _WATCH["sockets"] = (reader, writer)  # kept open for the life of the process
    _WATCH["thread"] = threading.Thread(target=_watch, args=(reader,), name="playbook signal watch", daemon=True)
    _WATCH["thread"].start()


def started(kept: str | None = None) -> None:
    """From here on Ctrl-C and SIGTERM raise KeyboardInterrupt (after `exit_on_ctrl_c_while_starting`,
    instead of ending the process) and are remembered for `interrupted()`; when the main thread is inside a
    long call and cannot act on them within GRACE_S, the process ends with the line "interrupted (Ctrl-C):
    <kept>" (the comment above `GRACE_S`). A signal ignored, or a handler of the caller's own, is left as it
    is."""
    if kept is not None:
        _WATCH["kept"] = kept
    for signum, default, handler in ((signal.SIGINT, signal.default_int_handler, _on_ctrl_c),
                                     (signal.SIGTERM, signal.SIG_DFL, _on_sigterm)):
        current = signal.getsignal(signum)
        if current is default or getattr(current, "while_starting", False):
            try:
                signal.signal(signum, handler)
            except ValueError:  # not the main thread
                pass
    if _ours(signal.SIGINT) or _ours(signal.SIGTERM):
        _start_watch()


def defer_sigterm(on: bool, waiting_for=None) -> None:
    """While on, a first SIGTERM is noted, not raised: the code asks `sigterm_pending()` where it can
    stop cleanly (the training loop: after each step). Turning it on clears an earlier note. waiting_for():
    what the run waits for and how long that should take, said when the stop takes longer than ANNOUNCE_S
    ("the run stops once step 3 of 10 ends (...)")."""
    _SIGTERM["defer"] = bool(on)
    if on:
        _SIGTERM["pending"] = False
        _WATCH["terms"], _WATCH["waiting_for"] = 0, waiting_for


def sigterm_pending() -> bool:
    """Whether a SIGTERM came while deferred (`defer_sigterm`) and waits to be acted on."""
    return _SIGTERM["pending"]


def interrupted() -> bool:
    """Whether Ctrl-C (or SIGTERM) came since `started()` (whatever error it turned into on its way up)."""
    return _CTRL_C["pressed"]


def interrupted_exit(kept: str, signal_name: str | None = None) -> SystemExit:
    """Print the one line of an interrupted run, "interrupted (Ctrl-C): <kept>" or "terminated (SIGTERM):
    <kept>", and return the SystemExit to raise: exit code 130 or 143, as a shell reports either."""
    name = signal_name or _CTRL_C["signal"]
    line = "terminated (SIGTERM)" if name == "SIGTERM" else "interrupted (Ctrl-C)"
    print(f"\n{line}: {kept}", file=sys.stderr, flush=True)
    return SystemExit(143 if name == "SIGTERM" else 130)


def is_ctrl_c(err: BaseException) -> bool:
    """Whether `err`, caught by a script's outermost handler, is a Ctrl-C (or a SIGTERM): a
    KeyboardInterrupt, or any error raised after the key press (`interrupted()`)."""
    return isinstance(err, KeyboardInterrupt) or interrupted()


def run_main(main, kept: str):
    """Run a script's `main()` and return what it returns; Ctrl-C from here on ends it with one line,
    "interrupted (Ctrl-C): <kept>" (say what was kept), and exit code 130; SIGTERM with "terminated
    (SIGTERM): <kept>" and exit code 143. A file that cannot be written for want of space (a full disk, a
    quota) ends it with one line naming the file, then <kept>, and exit code 1 (playbook.runtime.output)."""
    from playbook.runtime import output

    started(kept)
    try:
        return main()
    except (KeyboardInterrupt, Exception) as err:
        if not is_ctrl_c(err):
            if output.is_disk_full(err):
                raise output.disk_full_exit(err, kept) from None
            raise  # an error of its own, not a Ctrl-C turned into one on its way up
    raise interrupted_exit(kept) from None
