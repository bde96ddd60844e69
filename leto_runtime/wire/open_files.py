"""Which of a process's open files lie under a path prefix (a GPU's device files, /dev/nvidia*).

Role: the one reading of /proc/PID/fd shared by both sides of the exit fence -- the trainer
checks that no device file sits below its fence (`leto_runtime.exit_notice.check_fence`), the
agent finds orphans still holding a dead trainer's device files (`leto_run.procs.device_strays`).

Calling contract: `fds_under(prefix, pid)` returns the fd numbers, ascending; [] for a process
that is gone, a zombie (its files are released), or one whose fds this user cannot read.
"""
from __future__ import annotations

import os


def fds_under(prefix: str, pid: int | str = "self") -> list[int]:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(prefix):
                out.append(int(name))
        except (OSError, ValueError):
            continue                    # closed meanwhile
    return sorted(out)
