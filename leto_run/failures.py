"""Failures as data: what failed, where, how, and the boxed root-cause summary.

Worker tracebacks cross the process boundary as torchelastic error files (``@record`` writes
``TORCHELASTIC_ERROR_FILE``); we read them with torch's own `ProcessFailure` so the format stays
torch's.  The root cause is the *first failure the agent observed* (pidfd readiness order, or
the hang deadline), not the lowest rank: with gloo, the survivors of a dead peer fail ~10 ms
later with "Connection closed by peer", and naming them would send the user the wrong way.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


@dataclass(frozen=True)
class FailureRecord:
    rank: int
    local_rank: int
    role: str
    generation: int
    attempt: int
    host: str
    pid: int
    exitcode: int              # negative: killed by signal -exitcode
    how: str                   # "exit code 1" / "Signal 9 (SIGKILL)" / "hang (no heartbeat for 5.0 s)"
    error_file: str
    message: str               # traceback from the error file, or a generated explanation
    wall: float
    mono: float


def failure_from_exit(*, rank: int, local_rank: int, role: str, generation: int, attempt: int,
                      pid: int, exitcode: int, how: str, error_file: str, wall: float,
                      mono: float, host: str | None = None,
                      note: str | None = None) -> FailureRecord:
    """`host` defaults to the FQDN; callers on the hot path pass a cached one (a resolver
    lookup can take milliseconds, paid before the surviving ranks are told to stop)."""
    pf = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file=error_file)
    msg = pf.message
    if isinstance(msg, dict):                     # {"message": ..., "extraInfo": {"py_callstack"}}
        extra = msg.get("extraInfo", {}) or {}
        msg = extra.get("py_callstack") or msg.get("message") or str(msg)
    if note:
        msg = f"{note}\n{msg}" if msg else note
    return FailureRecord(rank=rank, local_rank=local_rank, role=role, generation=generation,
                         attempt=attempt, host=host or socket.getfqdn(), pid=pid, exitcode=exitcode,
                         how=how, error_file=error_file, message=str(msg), wall=wall, mono=mono)


def _fmt_one(idx: int, f: FailureRecord) -> str:
    when = datetime.datetime.fromtimestamp(f.wall).isoformat(timespec="milliseconds")
    tb = f.message.rstrip().replace("\n", "\n              ")
    return (f"[{idx}]:\n"
            f"  time      : {when}\n"
            f"  host      : {f.host}\n"
            f"  rank      : {f.rank} (local_rank: {f.local_rank}, role: {f.role}, "
            f"generation: {f.generation}, attempt: {f.attempt})\n"
            f"  exitcode  : {f.exitcode} (pid: {f.pid}) {f.how}\n"
            f"  error_file: {f.error_file if os.path.isfile(f.error_file) else '<N/A>'}\n"
            f"  traceback : {tb}")


def format_root_cause(title: str, failures: list[FailureRecord]) -> str:
    """torchrun's boxed summary; `failures` in observation order, the first is the root cause."""
    if not failures:
        return ""
    root, others = failures[0], failures[1:]
    body_root = _fmt_one(0, root)
    body_others = "\n".join(_fmt_one(i + 1, f) for i, f in enumerate(others)) or "  <NO_OTHER_FAILURES>"
    width = min(120, max(60, max(len(line) for line in
                                 (title + "\n" + body_root + "\n" + body_others).splitlines())))
    return "\n".join([
        "", "=" * width, title, "-" * width, "Failures:", body_others, "-" * width,
        "Root Cause (first observed failure):", body_root, "=" * width,
    ])
