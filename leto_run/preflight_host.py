"""Preflight checks of this host's limits and caches (`leto_run.preflight` calls them).

Each one refuses, before anything starts, a setting that would otherwise fail later with a
traceback or cost a recovery: a $TMPDIR too long for the run directory's AF_UNIX sockets, an
RLIMIT_NOFILE below what the launcher itself opens, a kernel cache root that cannot be created
or written.

Contract: functions of the config, the resolved workers per node and the environment; each
returns None or raises `ConfigError` (exit 2).  They create nothing that outlives them.
"""
from __future__ import annotations

import glob
import os
import resource
import tempfile

from leto_run.config import JobConfig
from leto_run.errors import ConfigError
from leto_run.state_manager.keeper import keeper_socket_path, sm_socket_path
from leto_runtime.wire import settings as S

# sun_path holds 108 bytes with the terminating NUL (unix(7)).
MAX_SOCKET_PATH = 107
# The agent's run directory: tempfile.mkdtemp(prefix="leto-") (leto_run.agent), whose random
# part has 8 characters, and the heartbeat socket in it.
RUN_DIR_NAME = "leto-" + "X" * 8
HEARTBEAT_SOCKET = "hb.sock"
# The agent's own fds (guardian, store, selector, event log, fork-server link, imports) and
# those per worker (pipes, pidfd, log files); in place, per slot (an active, a shadow and a
# state manager, and the slot's fd keeper): measured with `ulimit -n` and /proc/PID/fd on a
# CPU host (restart: 56 fds with 4 workers; in place: 54 with 1, 94 with 4), rounded up.
AGENT_BASE_FDS = 48
AGENT_FDS_PER_WORKER = 8
INPLACE_BASE_FDS = 64
INPLACE_FDS_PER_SLOT = 16


def socket_paths(run_dir: str, cfg: JobConfig, nproc: int) -> list[str]:
    """Every path the job binds an AF_UNIX socket at: the heartbeat server's and, in place,
    each slot's state manager and fd keeper.  (The fork server's link is a socketpair.)"""
    paths = [os.path.join(run_dir, HEARTBEAT_SOCKET)]
    if cfg.recovery.mode == "inplace":
        for slot in range(nproc):
            paths += [sm_socket_path(run_dir, slot), keeper_socket_path(run_dir, slot)]
    return paths


def check_socket_paths(tmp: str, cfg: JobConfig, nproc: int) -> None:
    longest = max(socket_paths(os.path.join(tmp, RUN_DIR_NAME), cfg, nproc),
                  key=lambda p: len(os.fsencode(p)))
    size = len(os.fsencode(longest))
    if size > MAX_SOCKET_PATH:
        room = MAX_SOCKET_PATH - (size - len(os.fsencode(tmp)))
        raise ConfigError("TMPDIR", f"{tmp!r} ({len(os.fsencode(tmp))} bytes) is too long: the "
                          f"run directory's sockets would be {size} bytes (e.g. {longest!r}), "
                          f"above the AF_UNIX limit of {MAX_SOCKET_PATH} bytes",
                          f"set TMPDIR to a shorter directory (at most {room} bytes), e.g. /tmp",
                          "environment")


def fd_need(cfg: JobConfig, nproc: int) -> tuple[int, int]:
    """(fds the agent needs at its soft limit, at its hard limit): what the launcher itself
    opens, a lower bound.  In place, the agent's fd keepers raise its soft limit to the hard
    one (`protocol.raise_nofile_limit`) as the slots start.  Not counted: the pages a
    trainer retains (unknown before it runs; a state manager needs `pool.FD_RESERVE` plus a
    fd per page, and refuses an allocation beyond the hard limit with a typed `FdLimit`
    naming the fix), since a plain torchrun script retains none."""
    agent = AGENT_BASE_FDS + AGENT_FDS_PER_WORKER * nproc
    if cfg.recovery.mode != "inplace":
        return agent, agent
    return agent, INPLACE_BASE_FDS + INPLACE_FDS_PER_SLOT * nproc


def check_fd_limit(cfg: JobConfig, nproc: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    at_soft, at_hard = fd_need(cfg, nproc)
    for need, have, which, flag in ((at_hard, hard, "hard", "-Hn"), (at_soft, soft, "soft", "-Sn")):
        if have != resource.RLIM_INFINITY and have < need:
            what = f"{nproc} worker(s) per node, --recovery {cfg.recovery.mode}"
            raise ConfigError("RLIMIT_NOFILE", f"the {which} limit on open files is {have}; "
                              f"this job ({what}) needs at least {need}",
                              f"raise it before starting leto-run (`ulimit {flag} {need}` or "
                              f"more; the hard limit as root, `docker run --ulimit nofile=N:N`,"
                              f" systemd LimitNOFILE=N or /etc/security/limits.conf)",
                              "environment")


def kernel_root(s: S.Settings) -> tuple[str, str, str]:
    """(variable, its value, directory) of the kernel cache root: `kernel_cache.root()`'s
    rule, read from the workers' settings `s` rather than this process's."""
    if s.ext_dir:
        return "LETO_EXT_DIR", s.ext_dir, os.path.expanduser(s.ext_dir)
    if s.torch_extensions_dir:
        return ("TORCH_EXTENSIONS_DIR", s.torch_extensions_dir,
                os.path.join(os.path.expanduser(s.torch_extensions_dir), "leto"))
    if s.xdg_cache_home:
        return ("XDG_CACHE_HOME", s.xdg_cache_home,
                os.path.join(s.xdg_cache_home, "leto", "kernels"))
    return "HOME", "~", os.path.expanduser("~/.cache/leto/kernels")


def _prebuilt(root: str) -> bool:
    """A read-only cache of complete builds is a supported setup: a complete slot is loaded
    without writing (kernel_cache.obtain).  Which slots this job needs is known only after
    torch is imported, so any complete slot counts."""
    return bool(glob.glob(os.path.join(glob.escape(root), "*", "leto-kernel.json")))


def _untrusted(root: str):
    """The UnsafeCache the runtime would raise for the existing part of `root`'s path (every
    directory from / down: leto_runtime/wire/cache_trust.py), or None."""
    from pathlib import Path

    from leto_runtime.wire.cache_trust import UnsafeCache, _trust_dir
    path = Path(os.path.realpath(root))
    cur = Path(path.anchor)
    for part in ("", *path.parts[1:]):
        cur = cur / part if part else cur
        if not os.path.isdir(cur):     # missing, or a file: _writable_problem's to report
            return None
        try:
            _trust_dir(cur)
        except UnsafeCache as e:
            return e
    return None


def _writable_problem(root: str) -> str | None:
    """Why kernels cannot be built under `root` (None: they can)."""
    top = root
    while not os.path.lexists(top) and os.path.dirname(top) != top:
        top = os.path.dirname(top)
    if not os.path.isdir(top):
        return f"{top!r} is not a directory" if top != root else "it is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".leto-probe-", dir=top))
    except OSError as e:
        return f"{top!r} is not writable ({e.strerror or e})"
    st = os.statvfs(top)
    if st.f_bavail * st.f_frsize == 0:
        return f"{top!r} is on a full file system"
    return None


def check_kernel_cache(cfg: JobConfig, s: S.Settings) -> None:
    """In place, a trainer using Leto's runtime builds or loads Leto's kernels there
    (leto_runtime.kernels); a plain torchrun script never does.  So an explicit LETO_EXT_DIR
    (Leto's own variable) is always checked, TORCH_EXTENSIONS_DIR and XDG_CACHE_HOME in place
    only, and the ~/.cache default never (service accounts' HOME=/nonexistent would refuse
    plain scripts; the runtime names the path if it is needed there)."""
    var, value, root = kernel_root(s)
    if var == "HOME" or (cfg.recovery.mode != "inplace" and var != "LETO_EXT_DIR"):
        return
    untrusted = _untrusted(root)
    if untrusted is not None:         # the runtime would refuse it (UnsafeCache): say so now
        raise ConfigError(var, f"the kernel cache {root!r} (from {var}={value!r}): "
                          f"{untrusted.path} {untrusted.why}", untrusted.fix, "environment")
    why = _writable_problem(os.path.abspath(root))
    if why is None or _prebuilt(root):
        return
    other = "" if var == "LETO_EXT_DIR" else f" (it takes precedence over {var}); or fix {var}"
    raise ConfigError(var, f"the kernel cache {root!r} (from {var}={value!r}) cannot hold "
                      f"Leto's kernels: {why}", "point LETO_EXT_DIR at a directory you can "
                      "write, or at one holding kernels built by `leto-run --build-kernels`"
                      + other, "environment")
