"""Who may write the kernel cache: the checks that keep another user's files out of the code
Leto builds and loads (docs/TRUST.md, "Other users").

Role: a kernel is code that runs as us, so every directory from / down to a slot must be a real
directory owned by us or root and not writable by others (sticky /tmp allowed above a slot, a
group only if it is our user-private one or root's): `_trust_dir`, `_private_dirs`.  A file
of the cache is used only if it is a regular file of ours that others cannot write
(`_file_problem`); what we write is created new (O_EXCL, no link followed) and renamed into place
(`_write_file`).  Violations raise `UnsafeCache`, which names the path and the fix.  A library
is loaded only whole: the size and sha256 its manifest recorded at the build (`library_record`,
`intact`; a manifest of an earlier Leto: the ELF file's own extents), else it is rebuilt.

Calling contract: pure checks over paths and stat results; used by `kernel_cache`.
"""
from __future__ import annotations

import functools
import hashlib
import os
import stat
from pathlib import Path

from leto_runtime.wire import file_trust


class UnsafeCache(RuntimeError):
    """A path of the kernel cache another user could write (or a symlink, or not ours): Leto
    neither builds nor loads kernels there.  `path`, `why` and `fix` name it."""

    def __init__(self, path, why: str, fix: str = ""):
        self.path, self.why = str(path), why
        self.fix = fix or ("remove it, or set LETO_EXT_DIR to a directory only you can write "
                           "(e.g. ~/.cache/leto/kernels)")
        super().__init__(f"the kernel cache path {self.path} {why}: Leto neither builds nor "
                         f"loads kernels there (another user could make them run code as you); "
                         f"{self.fix}")


_OPEN_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC   # no symlink followed, no FIFO waited on
DIR_MODE, FILE_MODE = 0o755, 0o644                        # what we create (less the umask)


@functools.lru_cache(maxsize=None)
def _private_group(gid: int) -> bool:
    """Is `gid` our user-private group (named as we are, no other member), or root's (its
    members are root's peers; containers run arbitrary uids with gid 0)?  A umask of 002 makes
    directories group-writable; with such a group that is only us."""
    import grp
    import pwd
    if gid == 0:
        return True
    try:
        me, g = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(gid)
    except KeyError:
        return False
    return g.gr_name == me and set(g.gr_mem) <= {me}


def _others_may_write(st: os.stat_result) -> str | None:
    if st.st_mode & stat.S_IWOTH:
        return f"is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid):
        return f"is writable by group {st.st_gid} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _owner_problem(st: os.stat_result) -> str | None:
    if st.st_uid not in (os.geteuid(), 0):
        return f"belongs to another user (uid {st.st_uid})"
    return None


def _trust_dir(path: Path, sticky_ok: bool = True) -> None:
    """Raise UnsafeCache unless `path` (lstat) is a directory only we (or root) can change;
    `sticky_ok`: others may add entries (/tmp), not rename or remove ours -- enough above a
    slot, whose own owner is checked, not for a slot itself (its files are found by name)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafeCache(path, f"cannot be examined ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCache(path, "is a symbolic link (possibly planted by another user)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCache(path, "is not a directory")
    why = _owner_problem(st)
    if why is None and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        why = _others_may_write(st)
        if why is not None and st.st_uid == os.geteuid():
            raise UnsafeCache(path, why, f"chmod go-w {path} and remove the kernel builds "
                              "below it (another user could have written there), or set "
                              "LETO_EXT_DIR to a directory only you can write")
    if why is not None:
        raise UnsafeCache(path, why)


def _file_problem(st: os.stat_result) -> str | None:
    """Why a cache file with stat `st` must not be used (None: it may)."""
    return file_trust.problem(st, "file", owners=(os.geteuid(), 0)) or _others_may_write(st)


def _private_dirs(path: Path) -> Path:
    """Create what is missing of `path` (0755 less the umask) and check every directory from /
    down to it (`_trust_dir`): lstat each, so a symlink planted since `root()` resolved the
    path is refused, not followed.  Returns `path`."""
    cur = Path(path.anchor)
    for part in path.parts[1:]:
        _trust_dir(cur)               # before creating anything inside it
        cur = cur / part
        try:
            os.mkdir(cur, DIR_MODE)
        except FileExistsError:
            pass
        except OSError:
            if not os.path.lexists(cur):
                raise
    _trust_dir(cur, sticky_ok=False)
    return path


def _write_file(path: Path, data: bytes) -> None:
    """`data` into `path` through a new temporary file of ours (0644), then renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)       # a leftover of a dead process of ours (the dir is ours)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FILE, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _no_others_write(path: Path) -> None:
    """Drop group/other write bits of a file we just built (a umask of 002 or 0 sets them)."""
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o022:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)


def library_record(lib: Path) -> tuple[int, str]:
    """(size, sha256) of a library just built: what its manifest records for `intact`."""
    with open(lib, "rb") as f:
        return os.fstat(f.fileno()).st_size, _sha256(f)


def _sha256(f) -> str:
    h = hashlib.sha256()                  # (hashlib.file_digest is Python 3.11+; we take 3.10)
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def intact(lib: Path, st: os.stat_result, man: dict) -> bool:
    """Is the library the one the manifest recorded (size and sha256)?  A library truncated or
    changed since its build (a full or failing disk, a half-finished copy) would be mapped
    anyway and kill its loader with SIGBUS, in every trainer and shadow alike: it is rebuilt
    instead.  Hashed once per process and file version."""
    try:
        with open(lib, "rb") as f:
            st = os.fstat(f.fileno())            # the file hashed is the file remembered
            key = (str(lib), st.st_ino, st.st_size, st.st_mtime_ns)
            if key in _verified:
                return True
            if "sha256" not in man:              # a manifest of an earlier Leto: the file's
                return _elf_whole(f, st.st_size)     # own extents, no rebuild under a job
            if st.st_size != man.get("size") or _sha256(f) != man["sha256"]:
                return False
    except OSError:
        return False
    _verified.add(key)
    return True


def _elf_whole(f, size: int) -> bool:
    """Does the ELF64 file `f` (of `size` bytes) hold every segment and its section table?"""
    h = f.read(64)
    if len(h) < 64 or h[:5] != b"\x7fELF\x02":
        return False
    phoff, shoff = int.from_bytes(h[0x20:0x28], "little"), int.from_bytes(h[0x28:0x30], "little")
    phent, phnum = int.from_bytes(h[0x36:0x38], "little"), int.from_bytes(h[0x38:0x3A], "little")
    shent, shnum = int.from_bytes(h[0x3A:0x3C], "little"), int.from_bytes(h[0x3C:0x3E], "little")
    if phoff + phent * phnum > size or shoff + shent * shnum > size:
        return False
    f.seek(phoff)
    for _ in range(phnum):
        ph = f.read(phent)
        if int.from_bytes(ph[0x08:0x10], "little") + int.from_bytes(ph[0x20:0x28], "little") > size:
            return False
    return True


_verified: set = set()
