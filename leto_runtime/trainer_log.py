"""The trainer's own log lines: stderr, each prefixed with the rank, role and generation.

Calling contract: `log(msg)` anywhere in a trainer.  Once `leto_runtime.init()` made the job the
role is the job's current one (a shadow becomes active at promotion), before that the
environment's.
"""
from __future__ import annotations

import sys

from leto_runtime import runtime
from leto_runtime.context import Context


def log(msg: str) -> None:
    job = runtime.current().job
    ctx = job.ctx if job else Context.from_env()
    role = job.role if job else ctx.role
    sys.stderr.write(f"[leto_runtime rank={ctx.rank} role={role} gen={ctx.generation}] {msg}\n")
    sys.stderr.flush()
