"""The loss bulletin: one counter in a small shared file that a state manager increments
whenever it registers a page loss, so a live trainer learns of a loss without asking.

Role: the trainer's step-boundary guard (`leto_runtime.rmu.guard`) reads the counter -- an
8-byte load from a read-only mapping, no round trip -- and asks the state manager for its
`pending_losses` (and then localizes and repairs) only when the counter moved.  The file lives
next to the state manager's socket in the job's private 0700 run directory
(`<socket>.losses`), so it outlives a state manager restart and only this user can open it.

Calling contract: the state manager registers the loss first (flags, then the destruction),
then calls `bump()`; a reader that sees the new value finds the loss registered.  `open(path)`
returns None where there is no bulletin (a pool started without one): the caller then asks at
every boundary.
"""
from __future__ import annotations

import mmap
import os

SIZE = 4096


def path_for(socket_path: str) -> str:
    return socket_path + ".losses"


def _allocated(fd: int) -> bool:
    """Every block of the file's SIZE bytes is on disk: a mapping of it never faults one in
    (a page first touched on a full tmpfs would SIGBUS the process touching it)."""
    st = os.fstat(fd)
    return st.st_size >= SIZE and st.st_blocks * 512 >= SIZE


class Writer:
    """The state manager's side: creates the file (0600) or reopens it after a restart.
    Raises OSError when the file cannot be created or its blocks allocated (a full disk):
    no file is left for a reader to map then."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, SIZE)   # blocks now, so no later store can SIGBUS
            except OSError:
                os.unlink(path)                   # (a reader would map the holes)
                raise
            self._mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path

    def value(self) -> int:
        return int.from_bytes(self._mm[0:8], "little")

    def bump(self) -> int:
        v = self.value() + 1
        self._mm[0:8] = v.to_bytes(8, "little")      # one aligned 8-byte store
        return v

    def close(self) -> None:
        self._mm.close()


class Reader:
    def __init__(self, mm: mmap.mmap):
        self._mm = mm

    def value(self) -> int:
        return int.from_bytes(self._mm[0:8], "little")

    def close(self) -> None:
        self._mm.close()


def open(path: str) -> Reader | None:      # noqa: A001 (module-level constructor)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not _allocated(fd):      # (a writer that could not allocate it is going away)
            return None
        return Reader(mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ))
    finally:
        os.close(fd)
