"""The trainer process's one runtime object.

Role: what exists once per trainer process lives here, in one object, instead of in module
globals of the modules that use it: the datagram channel to the agent (`beats.Channel`), the
process's `Job` (`leto_runtime.init()`), and the in-process demotion state (`demotion`).  The
modules that own those objects import this one; it imports none of them, so their imports stay
acyclic (demotion releases the job through `release_job()`, not by importing `job`).

Calling contract:
    rt = current()              # the process's Runtime (created at import)
    rt.channel                  # beats.Channel | None (beats.channel() creates it)
    rt.job                      # the Job of leto_runtime.init(), or None
    rt.demotion                 # demotion's state (demotion creates it)
    figures, old = rt.release_job()     # drop the job (an in-process demotion); `old` is still
                                        # due its release_group()
`forget_job()` is for tests that build several jobs in one process.
"""
from __future__ import annotations

from typing import Any


class Runtime:
    """See the module docstring.  Fields are owned by the modules named there."""

    def __init__(self) -> None:
        self.channel: Any = None          # leto_runtime.beats.Channel
        self.job: Any = None              # leto_runtime.job.Job
        self.demotion: Any = None         # leto_runtime.demotion.State

    def release_job(self) -> tuple[dict, Any]:
        """Drop the process's job (an in-process demotion; the next `init()` makes a new one).
        Returns its release figures and the old job, whose `release_group()` is still due."""
        j, self.job = self.job, None
        return ({} if j is None else j.release()), j

    def forget_job(self) -> None:
        self.job = None


_RUNTIME = Runtime()


def current() -> Runtime:
    return _RUNTIME
