"""Errors of the script, and how a trainer's uncaught exception reaches the agent.

Role: a `ScriptError` says "this script cannot run this way under Leto" (a tensor kept across
`opt.step()` in lent memory, a gradient replaced by zero_grad(), a DDP setting that breaks
exactness, an optimizer RMU cannot run, ...).  It fails the same way in every process that runs
the script, so recovering it in place only walks the failure forward one step per generation:
the agent never treats it as a HOF (leto_run.decisions.classify_failure, rule 1b) and stops,
or restarts under --max-restarts, with the message.

`install(path)` (from `leto_runtime.init()`, before the demotion hook, with the context's
TORCHELASTIC_ERROR_FILE) chains a `sys.excepthook` that writes that torchelastic error file (the
format of torch's `@record`) for any uncaught exception -- so the agent compares failures by exception
type and frame even when the script has no `@record` -- and marks a `ScriptError` in it
(`extraInfo[contract.SCRIPT_ERROR_KEY]`), as it does the memory pool's `FdLimit` of the node's hard
descriptor limit (`recurs`: every generation would meet it again).  A file `@record` already wrote is rewritten with the
same content and the mark.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

from leto_runtime.wire import contract as C


class ScriptError(Exception):
    """Base of the runtime's errors that name a problem of the script (not a HOF)."""


class PortingError(ScriptError, ValueError, RuntimeError):
    """The script uses something in-place recovery cannot run exactly (docs/PORTING.md);
    the message names it and the fix.  A ValueError and a RuntimeError, as these were."""


_prev = None
_installed = False
_path: str | None = None


def recurs(value: BaseException) -> bool:
    """Would every generation on this node meet `value` again?  A `ScriptError`, and the
    memory pool's `FdLimit` of the hard limit itself (the job's retained pages need more
    descriptors than the node's hard RLIMIT_NOFILE lets the agent or a state manager keep:
    its message names the fix; a promoted or restarted trainer asks for the same pages under
    the same limit) -- not one of fds held for a while by replies in flight ("try again").
    Never raises: it runs in the excepthook."""
    if isinstance(value, ScriptError):
        return True
    try:
        from leto_runtime.wire.protocol import BEYOND_HARD_LIMIT, FdLimit
        return isinstance(value, FdLimit) and value.details.get(BEYOND_HARD_LIMIT) is True
    except Exception:                   # noqa: BLE001 -- the error file must still be written
        return False


def error_record(tp, value, tb) -> dict:
    """torch's error-file content for an exception, with the script-error mark."""
    extra = {"py_callstack": "".join(traceback.format_exception(tp, value, tb)),
             "timestamp": str(int(time.time()))}
    if recurs(value):
        extra[C.SCRIPT_ERROR_KEY] = True
    return {"message": {"message": f"{tp.__name__}: {value}", "extraInfo": extra}}


def _hook(tp, value, tb) -> None:
    path = _path
    if path and not issubclass(tp, (KeyboardInterrupt, SystemExit)):
        try:
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(error_record(tp, value, tb), f)
            os.replace(tmp, path)
        except OSError as e:               # a full disk must not hide the traceback below
            print(f"[leto] could not write the error file {path}: {e}", file=sys.stderr)
    (_prev or sys.__excepthook__)(tp, value, tb)


def install(path: str | None) -> None:
    """Write uncaught exceptions to `path` (None: nowhere) from now on.  The hook is chained
    once per process: a demoted process runs init() again, as another generation with its own
    error file, under the demotion hook that chains to this one."""
    global _prev, _installed, _path
    _path = path
    if not _installed:
        _installed = True
        _prev = sys.excepthook
        sys.excepthook = _hook
