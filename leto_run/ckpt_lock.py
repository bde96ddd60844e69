"""One leto-run job per checkpoint directory: an flock on DIR/.leto-checkpoint.lock for the job's
life (two jobs rotating each other's checkpoints out would lose both).

A single-node job holds the lock exclusively.  The agents of one multi-node job share the
directory (every node must read the checkpoint a fallback loads), so there each agent holds it
shared and the file names the job (`--rdzv-endpoint` and `--rdzv-id`): an agent whose job is
another one is refused, as is any agent while a single-node job holds it.

A replacement agent of a running multi-node job finds the job's checkpoints there: they are
its own (`held_by`, which preflight asks before it refuses a directory holding checkpoints).

Calling contract: `DirLock(dir, job=None)` in the agent's start-up, before any process starts;
it raises `ConfigError` (exit 2) when the directory belongs to another job, or when the lock
path is not a regular file of ours (`check_path`, which preflight calls first).  `release` at
the end: the last holder removes the file.  No call blocks (LOCK_NB, a bounded retry while
another agent of the job converts its lock).

Other users: a shared (0777) checkpoint directory lets anyone plant the lock path.  It is
opened with O_NOFOLLOW and O_NONBLOCK (no symlink followed, no FIFO waited on), and used only
when it is a regular file we own with one link: we never truncate or unlink anything else.
"""
from __future__ import annotations

import errno
import fcntl
import os
import time

from leto_run.errors import ConfigError
from leto_runtime.wire import file_trust

LOCK_NAME = ".leto-checkpoint.lock"
CONVERT_WAIT_S = 2.0          # another agent of the job turns its exclusive lock into a shared one
# No symlink followed (ELOOP), no FIFO or device waited on, not inherited by workers.
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _problem(st: os.stat_result) -> str | None:
    """Why a lock file with stat `st` is not ours to use (None: it is)."""
    return file_trust.problem(st, "file", one_link=True)


def _refuse_path(path: str, why: str) -> ConfigError:
    return ConfigError("checkpoint.dir", f"the lock file {path!r} {why}",
                       "remove it if no leto-run job of yours uses it, or give this job "
                       "another --checkpoint-dir (one only you can write)")


def check_path(directory: str) -> None:
    """Raise `ConfigError` if `directory`'s lock path exists and is not a lock file we may use
    (the same rules as `DirLock`); creates and changes nothing."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    why = _problem(st)
    if why is None:
        try:                          # permissions: a mode we cannot open is refused now
            os.close(os.open(path, _OPEN))
        except OSError as e:
            why = f"cannot be opened ({e.strerror or e})"
    if why is not None:
        raise _refuse_path(path, why)


def job_name(cfg) -> str | None:
    """What names a multi-node job on the lock file; None for a single-node job."""
    rz = cfg.rendezvous
    return f"{rz.endpoint or rz.master_addr}/{rz.id}" if cfg.launch.max_nodes > 1 else None


def held_by(directory: str, job: str) -> bool:
    """Does a live agent of multi-node job `job` hold `directory`'s lock now?"""
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if _problem(os.fstat(fd)) is not None:
            return False              # not a lock file of ours: no agent of this job holds it
        if os.pread(fd, 512, 0).decode(errors="replace").strip() != f"job {job}":
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True               # held: by the job the file names
        return False                  # a stale file: nobody holds it
    finally:
        os.close(fd)


class DirLock:
    def __init__(self, directory: str, job: str | None = None):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.job, self.path = directory, job, os.path.join(directory, LOCK_NAME)
        self.fd = self._open()
        try:
            if job is None:
                self._exclusive()
            else:
                self._shared(job)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise

    def _open(self) -> int:
        """The lock file, created 0600 if absent; refused unless a regular file of ours."""
        try:
            fd = os.open(self.path, _OPEN | os.O_CREAT, 0o600)
        except OSError as e:
            why = ("is a symbolic link (possibly planted by another user)"
                   if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror or e})")
            raise _refuse_path(self.path, why) from None
        why = _problem(os.fstat(fd))
        if why is not None:
            os.close(fd)
            raise _refuse_path(self.path, why)
        return fd

    def _holder(self) -> str:
        return os.pread(self.fd, 512, 0).decode(errors="replace").strip() or "?"

    def _refuse(self, holder: str) -> ConfigError:
        return ConfigError("checkpoint.dir", f"{self.directory!r} is in use by another leto-run "
                           f"job ({holder}, per {LOCK_NAME})", "give each job its own "
                           "--checkpoint-dir (the nodes of one job share theirs)")

    def _write(self, text: str) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)

    def _exclusive(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise self._refuse(f"pid {self._holder()}") from None
        self._write(f"pid {os.getpid()}")

    def _shared(self, job: str) -> None:
        mine = f"job {job}"
        end = time.monotonic() + CONVERT_WAIT_S
        while True:
            try:                      # the first agent of the job: it names the job
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._write(mine)
                fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                try:                  # a later agent of the job: the file names it already
                    fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:       # held exclusively: a single-node job, or a conversion
                    if time.monotonic() < end:
                        time.sleep(0.05)
                        continue
                    raise self._refuse(self._holder()) from None
            holder = self._holder()
            if holder != mine:
                raise self._refuse(holder)
            return

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            # Only the last holder gets it exclusively: it removes the file.
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if self._still_ours():
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1

    def _still_ours(self) -> bool:
        """Is the path still our file?  In a shared directory another user may have replaced
        it meanwhile; theirs is not ours to remove."""
        mine, now = os.fstat(self.fd), os.lstat(self.path)
        return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)
