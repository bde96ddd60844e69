"""Which uncaught errors the runtime marks in the error file as recurring (never a HOF:
leto_run.decisions.classify_failure): a ScriptError, and a memory-pool FdLimit of the node's hard
descriptor limit -- not one of descriptors held for a while by replies in flight, which the
state manager says to try again.  The marks come from the pool's own raising code paths."""
from __future__ import annotations

import resource
import subprocess
import sys

from leto_runtime import errors
from leto_runtime.wire import contract as C
from leto_runtime.wire import protocol as P


def _marked(exc: BaseException) -> bool:
    rec = errors.error_record(type(exc), exc, None)
    return rec["message"]["extraInfo"].get(C.SCRIPT_ERROR_KEY) is True


def test_a_script_error_and_the_hard_limit_are_marked_a_transient_fd_shortage_is_not():
    assert _marked(errors.PortingError("a gradient replaced by zero_grad()"))
    assert not _marked(RuntimeError("CUDA error: an illegal memory access"))
    # what the state manager answers while replies to other clients hold its descriptors
    assert not _marked(P.FdLimit("the state manager cannot open 9 more fds now: try again",
                                 {"need": 9}))
    # over the wire, as a trainer's client raises it
    wire = P.error_reply(P.FdLimit("over the hard limit", {"need": 9, P.BEYOND_HARD_LIMIT: True}))
    try:
        P.raise_for_reply(wire)
    except P.FdLimit as e:
        assert _marked(e)


def test_check_nofile_over_the_hard_limit_is_marked():
    """`check_nofile` (the pool's and the keeper's check) in a process of its own, whose hard
    limit is lowered below the need."""
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
            "from leto_runtime.wire import protocol as P\n"
            "from leto_runtime import errors\n"
            "try:\n"
            "    P.check_nofile(1000)\n"
            "except P.FdLimit as e:\n"
            "    print(errors.recurs(e), 'ulimit -Hn 1000' in e.message)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[1] > 256     # ours untouched
