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
"""
from __future__ import annotations

import os
import selectors
import shutil
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.api import Std


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


class LogLayout:
    """Directories and file names of one job's logs (created lazily, per attempt)."""

    def __init__(self, log_dir: str | None, run_id: str, redirects: str, tee: str,
                 local_ranks_filter: tuple[int, ...]):
        base = log_dir or tempfile.mkdtemp(prefix="torchelastic_")
        os.makedirs(base, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
        self.redirects, self.tee = redirects, tee
        self.filter = set(local_ranks_filter)

    def rank_dir(self, attempt: int, local_rank: int) -> str:
        d = os.path.join(self.root, f"attempt_{attempt}", str(local_rank))
        os.makedirs(d, exist_ok=True)
        return d

    def error_file(self, attempt: int, local_rank: int, generation: int = 0) -> str:
        """torchrun's error.json; trainers of in-place generation G > 0 (shadows) get
        error_gG.json in the same directory, so a waiting shadow never shares its active's."""
        name = "error.json" if generation == 0 else f"error_g{generation}.json"
        path = os.path.join(self.rank_dir(attempt, local_rank), name)
        # A stale error file from an earlier process in the same attempt dir would be read as
        # this process's root cause.
        if os.path.exists(path):
            os.unlink(path)
        return path

    def plan(self, attempt: int, local_rank: int, stream: str) -> StreamPlan:
        red = _has(_std_for(self.redirects, local_rank), stream)
        tee = _has(_std_for(self.tee, local_rank), stream)
        to_file = (os.path.join(self.rank_dir(attempt, local_rank), f"{stream}.log")
                   if red or tee else None)
        console = (not red) and (not self.filter or local_rank in self.filter)
        return StreamPlan(to_file, console)


class OutputPump:
    """Reads worker pipes; writes raw bytes to log files and prefixed lines to the console."""

    def __init__(self, console_lock: threading.Lock):
        self._sel = selectors.DefaultSelector()
        self._lock = console_lock
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[tuple] = []
        self._pending_lock = threading.Lock()
        self._open: set[int] = set()
        self._idle = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="leto-output-pump", daemon=True)
        self._thread.start()

    def add(self, pipe_fd: int, plan: StreamPlan, prefix: str, stream: str,
            prefix_file: bool = False) -> None:
        """Take ownership of `pipe_fd` (the read end of a worker's stdout or stderr).
        `prefix_file`: prefix the file's lines too (a shadow sharing its rank's log file)."""
        os.set_blocking(pipe_fd, False)
        f = open(plan.to_file, "ab", buffering=0) if plan.to_file else None
        out = (sys.stdout if stream == "stdout" else sys.stderr) if plan.to_console else None
        with self._pending_lock:
            self._pending.append((pipe_fd, f, out, prefix.encode(), prefix_file))
        with self._idle:
            self._open.add(pipe_fd)
        os.write(self._wake_w, b"x")

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
        partial: dict[int, bytes] = {}
        fpartial: dict[int, bytes] = {}      # prefixed files: the unfinished last line
        while not self._stop:
            for key, _ in self._sel.select():
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    with self._pending_lock:
                        for fd, f, out, prefix, pf in self._pending:
                            self._sel.register(fd, selectors.EVENT_READ, (f, out, prefix, pf))
                        self._pending.clear()
                    continue
                fd = key.fd
                f, out, prefix, pf = key.data
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    if f and pf:
                        *flines, frest = (fpartial.pop(fd, b"") + chunk).split(b"\n")
                        if frest:
                            fpartial[fd] = frest
                        if flines:
                            f.write(b"".join(prefix + ln + b"\n" for ln in flines))
                    elif f:
                        f.write(chunk)
                    if out:
                        data = partial.pop(fd, b"") + chunk
                        *lines, rest = data.split(b"\n")
                        if rest:
                            partial[fd] = rest
                        self._emit(out, prefix, lines)
                    continue
                # EOF: the process (and any grandchild holding the pipe) is gone.
                if out and fd in partial:
                    self._emit(out, prefix, [partial.pop(fd)])
                if f and fd in fpartial:
                    f.write(prefix + fpartial.pop(fd) + b"\n")
                self._sel.unregister(fd)
                os.close(fd)
                if f:
                    f.close()
                with self._idle:
                    self._open.discard(fd)
                    self._idle.notify_all()

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
