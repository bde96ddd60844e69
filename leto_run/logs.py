"""torchrun's log layout and the pump that moves worker output to files and the console.

Layout (same as torchrun's DefaultLogsSpecs)::

    <log_dir>/<run_id>_<random>/attempt_<k>/<local_rank>/stdout.log   (if redirected or teed)
                                                        /stderr.log   (if redirected or teed)
                                                        /error.json   (written by @record)

`-r/--redirects` sends a stream to its file only, `-t/--tee` to the file and the console
(0 none, 1 stdout, 2 stderr, 3 both; or per local rank ``0:1,1:2``).  Console lines are
prefixed with rank, slot role and generation; `--local-ranks-filter` limits the console only.

Contract: one `OutputPump` thread per agent reads every worker pipe through one selector, so
a worker that floods its output never delays failure detection in the agent's main loop.

Log files never decide a job's fate.  The layout's root is created at start (a failure there is
a `ConfigError`; `leto_run.preflight` checks the path before anything starts).  After that, a
directory that cannot be created (the root removed, replaced by a file, the disk full) or a log
file that cannot be opened or written (ENOSPC, EIO) costs only that file: one warning on the
console, a counter (`LogLayout.failures`, `OutputPump.file_errors`), and the stream goes on to
the console -- also a redirected one, unless `--local-ranks-filter` hides its rank.
"""
from __future__ import annotations

import errno
import os
import selectors
import shutil
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

from torch.distributed.elastic.multiprocessing.api import Std

from leto_run.errors import ConfigError
from leto_run.events import console_warning


def _std_for(spec: str, local_rank: int) -> Std:
    parsed = Std.from_str(spec)
    if isinstance(parsed, dict):
        return parsed.get(local_rank, Std.NONE)
    return parsed


def _has(std: Std, stream: str) -> bool:
    want = Std.OUT if stream == "stdout" else Std.ERR
    return std == Std.ALL or std == want


@dataclass(frozen=True)
class StreamPlan:
    """Where one stream of one worker goes."""

    to_file: str | None
    to_console: bool
    console_fallback: bool = True     # to the console if the file fails (not: a filtered rank)


class LogLayout:
    """Directories and file names of one job's logs (created lazily, per attempt)."""

    def __init__(self, log_dir: str | None, run_id: str, redirects: str, tee: str,
                 local_ranks_filter: tuple[int, ...],
                 warn: Callable[[str], None] = console_warning):
        try:
            base = log_dir or tempfile.mkdtemp(prefix="torchelastic_")
            os.makedirs(base, exist_ok=True)
            self.root = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
        except OSError as e:
            raise ConfigError("logs.log_dir", f"cannot create the log directory under "
                              f"{log_dir or tempfile.gettempdir()!r}: {e.strerror or e}",
                              "give --log-dir a directory you can write") from None
        self.redirects, self.tee = redirects, tee
        self.filter = set(local_ranks_filter)
        self.warn = warn
        self.failures = 0              # directories that could not be created, after the root

    def rank_dir(self, attempt: int, local_rank: int) -> str | None:
        """The rank's log directory, created on first use; None when it cannot be (warned
        once per job, counted): its logs go to the console."""
        d = os.path.join(self.root, f"attempt_{attempt}", str(local_rank))
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            self.failures += 1
            if self.failures == 1:
                self.warn(f"cannot create log directory {d} ({e.strerror or e}); logs of ranks "
                          "whose directory cannot be created go to the console only (error "
                          "files are not written); the job goes on")
            return None
        return d

    def error_file(self, attempt: int, local_rank: int, generation: int = 0) -> str:
        """torchrun's error.json; trainers of in-place generation G > 0 (shadows) get
        error_gG.json in the same directory, so a waiting shadow never shares its active's."""
        name = "error.json" if generation == 0 else f"error_g{generation}.json"
        d = self.rank_dir(attempt, local_rank)
        path = os.path.join(self.root, f"attempt_{attempt}", str(local_rank), name)
        # A stale error file from an earlier process in the same attempt dir would be read as
        # this process's root cause.
        if d is not None and os.path.lexists(path):
            try:
                os.unlink(path)
            except OSError as e:
                self.warn(f"cannot remove the stale error file {path} ({e.strerror or e}); "
                          "the root-cause summary may show an earlier failure")
        return path

    def plan(self, attempt: int, local_rank: int, stream: str) -> StreamPlan:
        red = _has(_std_for(self.redirects, local_rank), stream)
        tee = _has(_std_for(self.tee, local_rank), stream)
        shown = not self.filter or local_rank in self.filter
        d = self.rank_dir(attempt, local_rank) if red or tee else None
        if d is None:       # no file wanted, or its directory failed: the console only
            return StreamPlan(None, shown)
        return StreamPlan(os.path.join(d, f"{stream}.log"), (not red) and shown, shown)


@dataclass
class _Stream:
    """One worker pipe being pumped, and where its bytes go."""

    fd: int
    file: object | None                 # raw (unbuffered) binary file, or None
    path: str | None
    out: object | None                  # sys.stdout / sys.stderr, or None
    fallback: object | None             # where output goes if the file fails
    prefix: bytes                       # console lines: the role the process has now
    file_prefix: bytes                  # file lines (prefix_file): the role it was started in
    prefix_file: bool
    partial: bytes = b""                # console: the unfinished last line
    fpartial: bytes = b""               # prefixed file: the unfinished last line


def _write_all(f, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = f.write(view)
        if not n:     # a blocking file that takes nothing: never retried forever
            raise OSError(errno.EIO, "the file took no bytes")
        view = view[n:]


class OutputPump:
    """Reads worker pipes; writes raw bytes to log files and prefixed lines to the console.

    A log file that cannot be opened or written is dropped for its stream (the console takes
    over, see the module doc): the first such error is a warning, every one is counted in
    `file_errors`."""

    def __init__(self, console_lock: threading.Lock,
                 warn: Callable[[str], None] = console_warning):
        self._sel = selectors.DefaultSelector()
        self._lock = console_lock
        self._warn = warn
        self.file_errors = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[_Stream] = []
        self._pending_lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}      # open pipes, for relabel (under _pending_lock)
        self._open: set[int] = set()
        self._idle = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="leto-output-pump", daemon=True)
        self._thread.start()

    def add(self, pipe_fd: int, plan: StreamPlan, prefix: str, stream: str,
            prefix_file: bool = False) -> int:
        """Take ownership of `pipe_fd` (the read end of a worker's stdout or stderr) and return
        it, the handle `relabel` takes.  `prefix_file`: prefix the file's lines too (a shadow
        sharing its rank's log file)."""
        os.set_blocking(pipe_fd, False)
        console = sys.stdout if stream == "stdout" else sys.stderr
        st = _Stream(pipe_fd, None, plan.to_file, console if plan.to_console else None,
                     console if plan.console_fallback else None, prefix.encode(),
                     prefix.encode(), prefix_file)
        if plan.to_file:
            try:
                st.file = open(plan.to_file, "ab", buffering=0)
            except OSError as e:
                self._file_failed(st, e, "open")
        with self._pending_lock:
            self._pending.append(st)
            self._streams[pipe_fd] = st
        with self._idle:
            self._open.add(pipe_fd)
        os.write(self._wake_w, b"x")
        return pipe_fd

    def relabel(self, pipe_fd: int, prefix: str) -> None:
        """Console lines read from now on carry `prefix` (a process changed its role); the log
        file keeps the label the process started with, which tells the processes sharing it
        apart.  A pipe that already reached EOF is left alone."""
        with self._pending_lock:
            st = self._streams.get(pipe_fd)
            if st is not None:
                st.prefix = prefix.encode()      # one reference swap: the pump reads it whole

    def wait_drained(self, timeout: float, fds: set[int] | None = None) -> bool:
        """Block until the given pipes (default: all added so far) reached EOF, i.e. every
        writer is gone and its last line has been written out."""
        with self._idle:
            return self._idle.wait_for(
                lambda: not (self._open if fds is None else self._open & fds), timeout=timeout)

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select():
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    with self._pending_lock:
                        for st in self._pending:
                            self._sel.register(st.fd, selectors.EVENT_READ, st)
                        self._pending.clear()
                    continue
                st = key.data
                try:
                    chunk = os.read(st.fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self._on_data(st, chunk)
                else:   # EOF: the process (and any grandchild holding the pipe) is gone.
                    self._on_eof(st)

    def _on_data(self, st: _Stream, chunk: bytes) -> None:
        # The console label is the one in force when the chunk was read, taken before the file
        # sees the chunk: a relabel that follows anything the file shows applies to later reads.
        prefix = st.prefix
        if st.file and st.prefix_file:
            *flines, st.fpartial = (st.fpartial + chunk).split(b"\n")
            if flines:
                self._to_file(st, b"".join(st.file_prefix + ln + b"\n" for ln in flines))
        elif st.file:
            self._to_file(st, chunk)
        if st.out:
            *lines, st.partial = (st.partial + chunk).split(b"\n")
            self._emit(st.out, prefix, lines)

    def _on_eof(self, st: _Stream) -> None:
        if st.out and st.partial:
            self._emit(st.out, st.prefix, [st.partial])
        if st.file and st.fpartial:
            self._to_file(st, st.file_prefix + st.fpartial + b"\n")
        self._sel.unregister(st.fd)
        with self._pending_lock:
            self._streams.pop(st.fd, None)
        os.close(st.fd)
        if st.file:
            st.file.close()
        with self._idle:
            self._open.discard(st.fd)
            self._idle.notify_all()

    def _to_file(self, st: _Stream, data: bytes) -> None:
        try:
            _write_all(st.file, data)
        except OSError as e:
            try:
                st.file.close()
            except OSError:
                pass
            st.file = None
            self._file_failed(st, e, "write")

    def _file_failed(self, st: _Stream, e: OSError, what: str) -> None:
        """Drop the stream's file; the console takes over.  What the file missed of the
        current line is lost with it, the console has it."""
        self.file_errors += 1
        if st.out is None:
            st.out = st.fallback
        if self.file_errors == 1:
            self._warn(f"cannot {what} log file {st.path} ({e.strerror or e}); its output goes "
                       "to the console only from now on (later log-file errors are counted, "
                       "not shown); the job goes on")

    def _emit(self, out, prefix: bytes, lines: list[bytes]) -> None:
        if not lines:
            return
        blob = b"".join(prefix + line + b"\n" for line in lines)
        with self._lock:
            try:
                out.buffer.write(blob)
                out.buffer.flush()
            except (ValueError, OSError):
                pass


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def new_run_id() -> str:
    return str(uuid.uuid4())
