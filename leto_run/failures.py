"""Failures as data: what failed, where, how, and the boxed root-cause summary.

Worker tracebacks cross the process boundary as torchelastic error files (``@record`` writes
``TORCHELASTIC_ERROR_FILE``); we read them with torch's own `ProcessFailure` so the format stays
torch's.  The root cause is the *first failure the agent observed* (pidfd readiness order, or
the hang deadline), not the lowest rank: with gloo, the survivors of a dead peer fail ~10 ms
later with "Connection closed by peer", and naming them would send the user the wrong way.

`error_identity` is what the failure classification (`leto_run.decisions`) compares to tell a
failure that repeats from a new one: the exception type and the innermost frame of the
traceback, not its message.  An error file that cannot be parsed (cut short by a kill, or not
torch's format) is reported as such, never raised into the agent.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import socket
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from leto_runtime.wire.contract import SCRIPT_ERROR_KEY


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
    error: str | None = None   # `error_identity` of the error file; None: no usable error file
    step: int | None = None    # the last step the trainer reported in its generation
    hang: bool = False         # killed by the agent's hang verdict
    script_error: bool = False  # the error file marks a leto_runtime.errors.ScriptError


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def error_identity(message) -> str | None:
    """`ExcType at file:line in func` (innermost frame) of an error file's message (torch's
    ``{"message": "T: text", "extraInfo": {"py_callstack": ...}}``, or a plain string: its
    first line); None when there is nothing to identify."""
    if isinstance(message, dict):
        head = str(message.get("message") or "")
        stack = str((message.get("extraInfo") or {}).get("py_callstack") or "")
        frames = _FRAME.findall(stack)
        etype = head.split(":", 1)[0].strip() if head else ""
        if not etype and stack.strip():
            etype = stack.strip().splitlines()[-1].split(":", 1)[0].strip()
        if frames:
            path, line, func = frames[-1]
            return f"{etype or 'exception'} at {path}:{line} in {func}"
        return head.splitlines()[0][:200] if head.strip() else None
    text = str(message or "").strip()
    return text.splitlines()[0][:200] if text else None


def _read_error_file(local_rank: int, pid: int, exitcode: int,
                     error_file: str) -> tuple[object, str | None, bool]:
    """(message for the summary, error identity, marked a script error) through torch's own
    reader, after checking that it can read the file (torch logs a traceback and re-raises
    otherwise)."""
    try:
        if os.path.isfile(error_file):
            with open(error_file, encoding="utf-8") as fp:
                data = json.load(fp)
            if not isinstance(data, dict) or "message" not in data:
                raise ValueError("no 'message' in it")
        pf = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode,
                            error_file=error_file)
    except Exception as e:                        # cut short by a kill, or not torch's format
        return (f"error file {error_file} is unreadable ({type(e).__name__}: {e})", None, False)
    msg = pf.message
    ident = error_identity(msg) if os.path.isfile(error_file) else None
    script = False
    if isinstance(msg, dict):                     # {"message": ..., "extraInfo": {"py_callstack"}}
        extra = msg.get("extraInfo", {}) or {}
        script = extra.get(SCRIPT_ERROR_KEY) is True
        msg = extra.get("py_callstack") or msg.get("message") or str(msg)
    return msg, ident, script


def failure_from_exit(*, rank: int, local_rank: int, role: str, generation: int, attempt: int,
                      pid: int, exitcode: int, how: str, error_file: str, wall: float,
                      mono: float, host: str | None = None, note: str | None = None,
                      step: int | None = None, hang: bool = False) -> FailureRecord:
    """`host` defaults to the FQDN; callers on the hot path pass a cached one (a resolver
    lookup can take milliseconds, paid before the surviving ranks are told to stop)."""
    msg, ident, script = _read_error_file(local_rank, pid, exitcode, error_file)
    if note:
        msg = f"{note}\n{msg}" if msg else note
    return FailureRecord(rank=rank, local_rank=local_rank, role=role, generation=generation,
                         attempt=attempt, host=host or socket.getfqdn(), pid=pid, exitcode=exitcode,
                         how=how, error_file=error_file, message=str(msg), wall=wall, mono=mono,
                         error=ident, step=step, hang=hang, script_error=script)


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
