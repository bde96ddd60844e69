"""Is a path entry ours to use?  One answer for every file Leto opens by a name others can reach.

Role: the checkpoint lock (`leto_run.ckpt_lock`), the checkpoint directory's entries
(`ckpt_files.foreign`), the kernel cache's files and build lock (`cache_trust`, `kernel_cache`)
all refuse what another user could have planted: a symbolic link (we would follow it into their
file), a FIFO or device (an open would hang or reach something else), an entry of another owner,
a file with a second hard link (its other name may be someone else's).  A pure function of an
`lstat`/`fstat` result, returning the reason, so that each caller words its own fix.

Calling contract:
    why = problem(os.lstat(p), kind="file", owners=(os.geteuid(),), one_link=True)
    # None: ours to use; else "is a symbolic link (...)", "is not a regular file", ...
"""
from __future__ import annotations

import os
import stat


def problem(st: os.stat_result, kind: str = "file", owners: tuple[int, ...] | None = None,
            one_link: bool = False) -> str | None:
    """Why the entry with stat `st` is not one we may use (None: it is).  `kind`: "file"
    (regular) or "dir"; `owners`: the uids that may own it (default: ours alone);
    `one_link`: refuse a file with more than one hard link."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (possibly planted by another user)"
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in (owners if owners is not None else (os.geteuid(),)):
        return f"belongs to another user (uid {st.st_uid})"
    if one_link and st.st_nlink != 1:
        return f"has {st.st_nlink} hard links (possibly to another file)"
    return None
