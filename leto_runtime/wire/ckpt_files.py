"""The on-disk layout of Leto's checkpoints, and what makes one complete (no torch here: the
agent reads it too).

`--checkpoint-dir DIR` holds one directory per checkpoint, `DIR/step_000000120` (the step the
job resumes at), each a `torch.distributed.checkpoint` directory (`.metadata` and the
`__N_M.distcp` files) that stock `dcp.load` reads, plus Leto's manifest `leto_checkpoint.json`:
the step, the world size, and the size of every file of the checkpoint.  A checkpoint is written
into a hidden sibling (`.partial-step_000000120-PID-TOKEN`), every file fsynced, the manifest written
and fsynced last, and the directory renamed into place (then the parent fsynced): a kill or a
full disk at any moment leaves either a hidden partial directory or a complete checkpoint.

*Complete* (`check`) means: the directory has a valid manifest whose step matches its name, and
every file the manifest names exists with its recorded size.  Anything else is *torn* and never
loaded (`newest`), whatever wrote it.

Calling contract: pure functions over paths; `newest(dir)` and `rotate(dir, keep)` never raise
for a missing directory or a foreign entry (they skip it); `rotate` removes only Leto's own
entries (`step_*` with a manifest, or `.partial-step_*`), never other files of the directory.

Other users: a shared checkpoint directory lets anyone plant a `step_*` of their own (a
directory, or a symlink to one), which would be loaded as our newest checkpoint.  Only plain
directories owned by our uid are checkpoints (`foreign`): `scan` skips the others with one
warning naming them, `check` calls them torn, and `rotate` never removes them.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass

from leto_runtime.wire import file_trust

MANIFEST = "leto_checkpoint.json"
FORMAT = 1
_NAME = re.compile(r"^step_(\d{9})$")
_PARTIAL = re.compile(r"^\.partial-step_(\d{9})-(\d+)(?:-([0-9a-f]+))?$")
log = logging.getLogger("leto.checkpoint")
_warned: set[str] = set()       # foreign entries already named (scans repeat, e.g. polling)


def name(step: int) -> str:
    return f"step_{step:09d}"


def partial_name(step: int, pid: int, token: str = "") -> str:
    """The hidden directory one write fills; `token` (hex) tells apart two writes of one
    process (a promoted shadow's write in flight and its own write of the redone step)."""
    return f".partial-{name(step)}-{pid}" + (f"-{token}" if token else "")


def pid_space() -> str:
    """8 hex digits naming this process's pid namespace on this host: a partial directory's
    token starts with them, so a rotation knows whether the writer's pid can be checked here."""
    import hashlib
    import socket
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return hashlib.sha1(f"{socket.gethostname()}/{ns}".encode()).hexdigest()[:8]


def partial_pid(path: str) -> int | None:
    """The writer's pid in a partial directory's name (None: not a partial)."""
    m = _PARTIAL.match(os.path.basename(path))
    return int(m.group(2)) if m else None


@dataclass(frozen=True)
class Settings:
    """The trainers' checkpoint settings (LETO_CHECKPOINT_*, `leto_runtime.context`)."""
    directory: str
    every_steps: int = 0          # 0: not by steps
    every_s: float = 0.0          # 0: not by time
    ff_mtbf: float = 0.0          # > 0: Young's interval from the measured cost
    keep: int = 2
    writer: str = "auto"          # auto: the shadow snapshots (`ckpt_snapshot`) | shadow | trainer
    snapshot_wait_s: float = 20.0  # the active's bound on waiting for the shadow's copy


@dataclass(frozen=True)
class Found:
    path: str
    step: int
    complete: bool
    reason: str            # why it is torn ("" when complete)


def manifest(step: int, world_size: int, directory: str) -> dict:
    """The manifest of the checkpoint files in `directory` (written there last)."""
    files = {}
    for entry in sorted(os.listdir(directory)):
        p = os.path.join(directory, entry)
        if entry != MANIFEST and os.path.isfile(p):
            files[entry] = os.path.getsize(p)
    return {"format": FORMAT, "step": step, "world_size": world_size, "files": files}


def foreign(path: str) -> str | None:
    """Why the entry `path` is not a checkpoint directory of ours (None: it is one).  lstat:
    a symlink is never followed, whoever it points at."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be examined ({e.strerror or e})"
    return file_trust.problem(st, "dir")


def _warn_foreign(skipped: list[tuple[str, str]]) -> None:
    new = [(p, why) for p, why in skipped if p not in _warned]
    if not new:
        return
    _warned.update(p for p, _ in new)
    log.warning("leto: ignoring %d entr%s of the checkpoint directory that Leto did not write "
                "(never loaded, never removed): %s; remove them, or give the job a "
                "--checkpoint-dir only you can write", len(new), "y" if len(new) == 1 else "ies",
                "; ".join(f"{p} {why}" for p, why in new))


def check(path: str) -> Found:
    """Is the checkpoint directory `path` complete? (see the module doc)"""
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    step = int(m.group(1)) if m else -1
    why = foreign(os.path.normpath(path))     # (a trailing / would make lstat follow a link)
    if why is not None:        # never load what another user put there
        return Found(path, step, False, why)
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            man = json.load(f)
    except FileNotFoundError:
        return Found(path, step, False, f"no {MANIFEST} (the write did not finish)")
    except (OSError, ValueError) as e:
        return Found(path, step, False, f"unreadable {MANIFEST} ({e})")
    if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("step") != step:
        return Found(path, step, False, f"{MANIFEST} does not describe {name(step)}")
    files = man.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return Found(path, step, False, f"{MANIFEST} lists no .metadata")
    for fname, size in files.items():
        p = os.path.join(path, fname)
        try:
            got = os.path.getsize(p)
        except OSError:
            return Found(path, step, False, f"{fname} is missing")
        if got != size:
            return Found(path, step, False, f"{fname} has {got} bytes, the manifest says {size}")
    return Found(path, step, True, "")


def scan(directory: str) -> list[Found]:
    """Every Leto checkpoint under `directory` (complete or torn, partials included), by step."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    out, skipped = [], []
    for entry in entries:
        named, partial = _NAME.match(entry), _PARTIAL.match(entry)
        if not (named or partial):
            continue
        p = os.path.join(directory, entry)
        why = foreign(p)
        if why is not None:
            if os.path.lexists(p):            # (gone since the listing: a partial renamed)
                skipped.append((p, why))
        elif named:
            out.append(check(p))
        else:
            out.append(Found(p, int(partial.group(1)), False,
                             "a partial write (its writer was stopped or failed)"))
    _warn_foreign(skipped)
    return sorted(out, key=lambda f: (f.step, f.path))


def newest(directory: str) -> Found | None:
    """The newest complete checkpoint, or None."""
    done = [f for f in scan(directory) if f.complete]
    return done[-1] if done else None


def rotate(directory: str, keep: int, busy: str | None = None) -> list[Found]:
    """Remove all but the newest `keep` complete checkpoints, and every torn one older than the
    newest complete one -- but never a partial that may still be written (`busy`, one of a
    live writer, one touched recently).  Returns what it removed."""
    found = scan(directory)
    done = [f for f in found if f.complete]
    keep_paths = {f.path for f in done[-keep:]} if keep > 0 else set()
    top = done[-1].step if done else None
    removed = []
    for f in found:
        if f.path in keep_paths or f.path == busy or _maybe_being_written(f.path):
            continue
        if f.complete or (top is not None and f.step <= top):
            if foreign(f.path) is not None:    # replaced since the scan: not ours to remove
                continue
            shutil.rmtree(f.path, ignore_errors=True)
            removed.append(f)
    return removed


PARTIAL_IDLE_S = 300.0      # a partial untouched this long has no writer (any host)


def _maybe_being_written(path: str) -> bool:
    """A partial directory whose writer may still fill and rename it: removing it then could
    tear the checkpoint it becomes.  Its writer's pid is alive here; or it was not written in
    this pid namespace (`pid_space`: another node of a shared directory) and something in it
    changed within `PARTIAL_IDLE_S`."""
    m = _PARTIAL.match(os.path.basename(path))
    if m is None:
        return False
    try:
        os.kill(int(m.group(2)), 0)
        return True
    except ProcessLookupError:
        if (m.group(3) or "").startswith(pid_space()):
            return False            # written here, by a process that is gone
    except OSError:
        return True                 # alive, another user's
    try:
        with os.scandir(path) as it:
            newest_m = max([os.stat(path).st_mtime] + [e.stat().st_mtime for e in it])
    except OSError:
        return False                # gone already
    return time.time() - newest_m < PARTIAL_IDLE_S


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename `src` to `dst` unless `dst` exists (FileExistsError): a rename(2) would replace an
    empty directory there, another user's included.  renameat2(RENAME_NOREPLACE) where libc
    and the file system have it, else a check just before the rename (a narrow window)."""
    import ctypes
    import errno
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        fn = None
    if fn is not None:
        at_cwd, noreplace = -100, 1
        if fn(at_cwd, os.fsencode(src), at_cwd, os.fsencode(dst), noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):     # EINVAL: the file system lacks the flag
            raise OSError(err, os.strerror(err), dst)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)
