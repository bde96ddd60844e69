"""JSONL event log: one line per thing that happened, the data later benchmarks and recovery
reports read.

Every record carries ``mono`` (CLOCK_MONOTONIC seconds, comparable across processes of one
machine), ``wall`` (Unix time), ``event``, ``generation``, and where it applies ``rank``,
``local_rank`` and ``role``.  Event names: ``job_start``, ``rendezvous``, ``spawn``, ``exit``,
``exit_started`` (an abrupt death, seen as its exit began: `leto_run.exit_notice`),
``exit_fence`` (GPU machines: a trainer's exit fence, or its drain words -- verdict drained --, said whether its device work stopped),
``device_strays`` (GPU machines: orphans holding a dead trainer's device files, killed and
waited for before the promotion),
``failure_detected``, ``hang_detected``, ``stack_dump``, ``exit_lingering`` (a rank that ended its
loop and is slow to exit: `Supervisor.check_lingering`), ``inject``, ``stop``, ``restart``,
``signal``, ``job_end``; in-place recovery (`leto_run.inplace`): ``inplace``, ``shadow_ready``,
``hof``, ``demote``, ``promote``, ``promoted``, ``phase``, ``inplace_done``, ``shadow_exit``,
``shadow_respawn``, ``inplace_fallback``; the preinitialization controller
(`leto_run.inplace_levels`): ``preinit``, ``reclaim``, ``preinit_observed``; and ``event_log_degraded`` (below).

Contract: only the agent's main thread writes; each line goes to the file in one `write`, so a
crashed agent leaves a readable log up to its last event.  `records` keeps every event in
memory (the recovery report is computed from it), the oldest dropped past MAX_RECORDS
(`records_dropped` counts them).

The event log never decides a job's fate: when the file cannot be opened or a write fails
(ENOSPC, EIO), the file is closed; a torn last line of its own is cut off again while it is
still the file's tail (bytes other processes appended to a shared file are never touched), so
the file stays a clean prefix of the job's events; one warning goes to the console, an
``event_log_degraded`` record (kept in memory only) says where the file stopped, and
`unwritten` counts the events the file misses.
"""
from __future__ import annotations

import errno
import json
import os
import time
from typing import Any, Callable

MAX_RECORDS = 100_000


def console_warning(msg: str) -> None:
    """Default warning sink of the event log and the log files: one line on stderr, through
    the one console writer (a closed console never raises: `leto_run.console`)."""
    from leto_run.console import CONSOLE
    CONSOLE.write(f"[leto-run] warning: {msg}\n")


class EventLog:
    def __init__(self, path: str | None, node: str,
                 warn: Callable[[str], None] = console_warning):
        self.path = path
        self.node = node
        self.records: list[dict[str, Any]] = []   # kept in memory for the end-of-run summary
        self.records_dropped = 0
        self.written = 0
        self.unwritten = 0
        self.write_error: str | None = None
        self._warn = warn
        self._fd = -1
        if path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                                   0o644)
            except OSError as e:
                self._degrade(e, "open")

    def emit(self, event: str, generation: int, *, rank: int | None = None,
             local_rank: int | None = None, role: str | None = None,
             mono: float | None = None, **fields: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "event": event,
            "mono": time.monotonic() if mono is None else mono,
            "wall": time.time(),
            "node": self.node,
            "generation": generation,
        }
        if rank is not None:
            rec["rank"] = rank
        if local_rank is not None:
            rec["local_rank"] = local_rank
        if role is not None:
            rec["role"] = role
        rec.update(fields)
        self._keep(rec)
        if self._fd >= 0:
            self._write((json.dumps(rec, default=str) + "\n").encode())
        elif self.path:
            self.unwritten += 1
        return rec

    def _keep(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        if len(self.records) > MAX_RECORDS:
            cut = MAX_RECORDS // 10          # in bulk: trimming stays cheap per event
            del self.records[:cut]
            self.records_dropped += cut

    def _write(self, line: bytes) -> None:
        """One O_APPEND write per line: another process appending to the same file (a shared
        --events path) never lands inside it.  Only after a short write (the disk filled
        mid-line) is the rest written separately, which names the cause (ENOSPC, EFBIG); if
        that fails, this line's own bytes are cut -- only while they are still the file's
        contiguous tail: bytes others wrote are never touched."""
        view, start, end, err = memoryview(line), None, None, None
        while view:
            try:
                n = os.write(self._fd, view)
            except OSError as e:
                err = e
                break
            if not n:
                err = OSError(errno.EIO, "the file took no bytes")
                break
            view = view[n:]
            if not view and start is None:
                break                      # the usual case: the whole line in one write
            pos = self._pos()              # after an O_APPEND write: its end
            if pos is None or (start is not None and pos - n != end):
                start = -1                 # unknown, or others' bytes between ours: never cut
            elif start is None:
                start = pos - n
            end = pos
        if err is None:
            self.written += 1
            return
        self._stop_writing(err, self._cut_own(start, end))

    def _pos(self) -> int | None:
        try:
            return os.lseek(self._fd, 0, os.SEEK_CUR)
        except OSError:                    # a pipe or a terminal: no position to cut back to
            return None

    def _cut_own(self, start: int | None, end: int | None) -> str:
        """Cut this line's torn bytes [start, end) if they are the file's tail; else why not."""
        if start is None:
            return ""                      # nothing of this line reached the file
        try:
            if start >= 0 and os.fstat(self._fd).st_size == end:
                os.ftruncate(self._fd, start)
                return ""
        except OSError:
            return "; its torn last line could not be cut"
        return "; its torn last line is mixed with other writers' bytes and was left alone"

    def _stop_writing(self, e: OSError, torn: str) -> None:
        os.close(self._fd)
        self._fd = -1
        self.unwritten += 1
        self._degrade(e, "write", torn)

    def _degrade(self, e: OSError, what: str, torn: str = "") -> None:
        self.write_error = f"{what}: {e.strerror or e}{torn}"
        self._warn(f"cannot {what} the event log {self.path} ({e.strerror or e}); it holds the "
                   f"first {self.written} events{torn}, later ones are kept in memory only (the "
                   "recovery report still prints); the job goes on")
        self._keep({"event": "event_log_degraded", "mono": time.monotonic(), "wall": time.time(),
                    "node": self.node, "generation": self.records[-1]["generation"]
                    if self.records else 0, "path": self.path, "error": self.write_error,
                    "written": self.written})

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_events(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
