"""The agent's console: every line the agent itself writes to stderr goes through `CONSOLE`.

Why one writer: a console that goes away (`leto-run ... 2>&1 | head -1`, a closed ssh session)
turns every write into EPIPE/EIO; torchrun logs through `logging`, which swallows it and goes
on.  A job must not end because nobody reads its console.  On the first failed write the
console is *lost* for the rest of the run: /dev/null is dup2'ed over the broken descriptor
(and over stdout where it is the same pipe), so no later write -- ours, the output pump's,
rich's, a library's, the interpreter's final flush -- can raise either; the reason is kept
for one `console_lost` event, which the agent's main thread records (`report`: the event log
has one writer).  What the console would have shown is in the event log and the log files.

Contract: `write` never raises; it returns False once the console is lost.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any


class Console:
    def __init__(self) -> None:
        # Shared with the output pump and the status view: console lines never interleave.
        self.lock = threading.Lock()
        self.lost: str | None = None        # why the console was lost, None while it works
        self._reported = False

    def write(self, text: str) -> bool:
        with self.lock:
            if self.lost is not None:
                return False
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
                return True
            except (OSError, ValueError) as e:
                self._lose(e, "stderr")
                return False

    def _lose(self, e: Exception, what: str) -> None:
        """Called with the lock held; logs nothing (the console is what failed)."""
        self.lost = f"{what}: {type(e).__name__}: {getattr(e, 'strerror', None) or e}"
        fd = _fileno(sys.stderr)
        if isinstance(e, OSError) and fd is not None:   # a closed stream object: no fd to fix
            silence_fd(fd, also_same_as=1)
        try:
            sys.stderr.flush()            # what the stream still buffers goes to /dev/null now
        except (OSError, ValueError):
            pass

    def settle_stdout(self) -> None:
        """At the end: stdout (the workers' lines) may be a closed pipe too; the interpreter's
        last flush would then fail and end the process with 120.  Silence it the same way."""
        with self.lock:
            try:
                sys.stdout.flush()
            except (OSError, ValueError) as e:
                fd = _fileno(sys.stdout)
                if isinstance(e, OSError) and fd is not None:
                    silence_fd(fd, also_same_as=2)
                if self.lost is None:
                    self.lost = f"stdout: {type(e).__name__}: {getattr(e, 'strerror', None) or e}"
                try:
                    sys.stdout.flush()
                except (OSError, ValueError):
                    pass

    def report(self, emit: Any, generation: int) -> None:
        """Main thread only: one `console_lost` event once the console is lost."""
        if self.lost is not None and not self._reported:
            self._reported = True
            emit("console_lost", generation, reason=self.lost,
                 note="later console output is discarded; see the event log and log files")


def _fileno(stream: Any) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):      # a StringIO, a closed stream
        return None


def silence_fd(fd: int, also_same_as: int | None = None) -> None:
    """dup2 /dev/null over `fd` (and over `also_same_as` when it is the same open file)."""
    fds = [fd]
    try:
        st = os.fstat(fd)
        if also_same_as is not None:
            other = os.fstat(also_same_as)
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                fds.append(also_same_as)
    except OSError:
        pass
    try:
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for f in fds:
            try:
                os.dup2(null, f, inheritable=True)
            except OSError:
                pass
    finally:
        os.close(null)


CONSOLE = Console()          # one per process: the agent, its pump, status and warnings
