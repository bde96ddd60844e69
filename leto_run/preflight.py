"""Checks of the machine around a valid config, made before anything of the job starts.

A `JobConfig` is valid on its own (`leto_run.config`); whether its paths and programs work here
depends on this machine, so it is checked here, by `leto_run.cli` right before the agent: the
log directory can be created (or is a directory we can write), the event log can be written,
a temporary directory exists for the run directory and is short enough for its AF_UNIX
sockets, the checkpoint directory can be written, holds no earlier run's checkpoints and no
lock file that is not ours (`ckpt_lock.check_path`), the worker's program can be executed,
the script it is to run exists (not a module: a torchrun worker would fail to open it on
every restart; a directory or zip needs a __main__), `--nproc-per-node auto|cpu|gpu` resolves
and the checks that need the count pass for it, RLIMIT_NOFILE is high enough, the kernel
cache can be written (`leto_run.preflight_host`), and the tuning knobs in the environment are
in their domains (`leto_runtime.wire.settings`).  Each problem is a `ConfigError` (exit 2)
naming the path or option and the fix, raised before the guardian, the state managers or any
worker exist.

Contract: `preflight(cfg, env)` returns None or raises `ConfigError`.  It creates nothing that
outlives it: writability is probed by creating and removing a temporary directory in the
nearest existing ancestor (a permission check would say yes to root on a read-only bind mount,
or no to a directory an ACL opens).  `env` is the environment the workers will get (PATH,
PYTHON_EXEC).
"""
from __future__ import annotations

import os
import pkgutil
import shutil
import tempfile
from typing import Mapping

from leto_run import ckpt_lock, job_secret
from leto_run import preflight_host as H
from leto_run.ckpt_lock import job_name
from leto_run.config import JobConfig, check_local_ranks
from leto_run.errors import ConfigError
from leto_run.worker_cmd import resolve_nproc, worker_argv
from leto_runtime.wire import ckpt_files
from leto_runtime.wire import settings as S


def _nearest_existing(path: str) -> str:
    d = path
    while not os.path.lexists(d):
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return d


def _probe(key: str, given: str, d: str, source: str) -> None:
    """Create and remove a directory in `d`: can this process create entries there?"""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".leto-probe-", dir=d))
    except OSError as e:
        where = "" if os.path.abspath(given) == d else f": its existing ancestor {d!r}"
        raise ConfigError(key, f"{given!r}{where} is not writable ({e.strerror or e})",
                          "choose a directory you can write, or fix its permissions / free "
                          "the file system", source) from None


def _check_dir(key: str, given: str, source: str, flag: str, path: str | None = None) -> None:
    """Directory `path` (default: `given`, the user's value) is one we can write, or one we
    can create (mkdir -p)."""
    path = os.path.abspath(given if path is None else path)
    if os.path.lexists(path) and not os.path.exists(path):
        raise ConfigError(key, f"{path!r} is a dangling symbolic link",
                          f"point {flag} elsewhere, or remove the link", source)
    top = _nearest_existing(path)
    if not os.path.isdir(top):
        what = ("exists and is not a directory" if top == os.path.abspath(given)
                else f"cannot be created: {top!r} is a file, not a directory")
        raise ConfigError(key, f"{given!r} {what}",
                          f"point {flag} at a path under a directory, or move {top!r}", source)
    _probe(key, given, top, source)


def _check_events(given: str, source: str) -> None:
    path = os.path.abspath(given)
    if os.path.isdir(path):
        raise ConfigError("logs.events", f"{given!r} is a directory",
                          f"give a file path, e.g. {os.path.join(given, 'events.jsonl')}", source)
    if os.path.lexists(path) and not os.path.exists(path):
        raise ConfigError("logs.events", f"{given!r} is a dangling symbolic link",
                          "give a file path, or remove the link", source)
    if not os.path.exists(path):
        _check_dir("logs.events", given, source, "--events", os.path.dirname(path))
        return
    try:     # opens as the event log will (append), without changing a byte; never blocks
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError as e:
        raise ConfigError("logs.events", f"{given!r} cannot be written: {e.strerror or e}",
                          "give a file you can write, e.g. under --log-dir", source) from None


def _check_checkpoint_dir(given: str, source: str | None, job: str | None) -> None:
    """Writable (or creatable), not on a full file system, and holding no checkpoint of an
    earlier run (rotation would remove it): those of the multi-node job `job`, whose other
    agents hold the directory now, are this (replacement) agent's own."""
    _check_dir("checkpoint.dir", given, source, "--checkpoint-dir")
    ckpt_lock.check_path(os.path.abspath(given))      # a planted or foreign lock file
    top = _nearest_existing(os.path.abspath(given))
    st = os.statvfs(top)
    if st.f_bavail * st.f_frsize == 0:
        raise ConfigError("checkpoint.dir", f"{given!r} is on a full file system (0 bytes "
                          "available)", "free space there, or point --checkpoint-dir at "
                          "another file system", source)
    old = ckpt_files.scan(os.path.abspath(given))
    if old and not (job is not None and ckpt_lock.held_by(os.path.abspath(given), job)):
        raise ConfigError("checkpoint.dir", f"{given!r} holds checkpoints of an earlier run "
                          f"({', '.join(os.path.basename(f.path) for f in old[-3:])}), which "
                          "this job would rotate out", "give a new directory (resume that run "
                          "with the script's own dcp.load + job.load_state_dict), or remove "
                          "them", source)


def _check_program(cfg: JobConfig, env: Mapping[str, str]) -> None:
    exe = worker_argv(cfg, env)[0]
    key, source = ("launch.training_script", "TRAINING_SCRIPT") if cfg.launch.no_python \
        and not cfg.launch.run_path else ("PYTHON_EXEC", "PYTHON_EXEC")
    if os.sep in exe:
        ok = os.path.isfile(exe) and os.access(exe, os.X_OK)
    else:
        ok = shutil.which(exe, path=env.get("PATH", os.defpath)) is not None
    if not ok:
        raise ConfigError(key, f"{exe!r} is not an executable program" +
                          ("" if os.sep in exe else " on PATH"),
                          "give the path of an executable (with --no-python the script is run "
                          "directly: chmod +x it), or unset PYTHON_EXEC", source)


def _check_script(cfg: JobConfig, source: str | None) -> None:
    """A script the workers' interpreter is to run (not a module, not --no-python) must be
    there: every worker would fail to open it, and every restart again."""
    la = cfg.launch
    if la.module or la.no_python:
        return
    if not os.path.exists(la.training_script):
        raise ConfigError("launch.training_script", f"{la.training_script!r} does not exist "
                          f"(relative paths are from {os.getcwd()!r}, the workers' directory)",
                          "give the script's path, or -m for a module",
                          source or "TRAINING_SCRIPT")
    if _lacks_main(la.training_script):
        raise ConfigError("launch.training_script", f"{la.training_script!r} is a directory or "
                          "zip file without a __main__ module: Python cannot run it",
                          "give the script's path (a .py file), add a __main__.py, or use -m "
                          "for a package", source or "TRAINING_SCRIPT")


def _lacks_main(path: str) -> bool:
    """Python runs a directory or zip file given as the script (as torchrun passes it) by its
    __main__ module, found as runpy finds it: through the path's importer.  A plain file has
    no importer (None) and runs as itself."""
    importer = pkgutil.get_importer(os.path.abspath(path))
    if importer is None:
        return os.path.isdir(path)
    try:
        return importer.find_spec("__main__") is None
    except (ImportError, OSError):
        return True


def preflight(cfg: JobConfig, env: Mapping[str, str], sources: Mapping[str, str] | None = None
              ) -> None:
    """Raise `ConfigError` for the first thing that cannot work on this machine (module doc).
    `sources`: where each key's value came from (`--log-dir`, `job.yaml:7`), for messages."""
    sources = sources or {}
    lg = cfg.logs
    if lg.log_dir is not None:
        _check_dir("logs.log_dir", lg.log_dir, sources.get("logs.log_dir"), "--log-dir")
    if lg.events is not None:
        _check_events(lg.events, sources.get("logs.events"))
    try:
        tmp = tempfile.gettempdir()    # the run directory (and the default log dir) go here
    except FileNotFoundError as e:
        raise ConfigError("TMPDIR", f"no usable temporary directory ({e})",
                          "set TMPDIR to a directory you can write", "environment") from None
    _probe("TMPDIR", tmp, os.path.abspath(tmp), "environment")
    nproc = _check_nproc(cfg, sources)
    H.check_fd_limit(cfg, nproc)
    H.check_socket_paths(tmp, cfg, nproc)
    if cfg.checkpoint.dir is not None:
        _check_checkpoint_dir(cfg.checkpoint.dir, sources.get("checkpoint.dir"), job_name(cfg))
    job_secret.job_key(cfg)            # a named secret file that cannot be read, or none where
    _check_program(cfg, env)           # one is needed: refused before anything starts
    _check_script(cfg, sources.get("launch.training_script"))
    H.check_kernel_cache(cfg, _check_knobs(env))


def _check_nproc(cfg: JobConfig, sources: Mapping[str, str]) -> int:
    """Resolve --nproc-per-node; when it was auto|cpu|gpu, run the checks that need the count
    now that it is known.  On one node every check (`JobConfig.with_nproc`: local ranks and
    injections' ranks); on several only the local ranks, since other nodes may resolve to
    other counts (torchrun's world is the sum), so the world size is not known here."""
    nproc = resolve_nproc(cfg.launch.nproc_per_node)
    if cfg.launch.nproc_int is not None:
        return nproc
    try:
        if cfg.launch.max_nodes == 1:
            cfg.with_nproc(nproc)
        else:
            check_local_ranks(cfg.logs, nproc)
    except ConfigError as e:
        raise ConfigError(e.key, f"{e.problem} (--nproc-per-node {cfg.launch.nproc_per_node} "
                          f"resolved to {nproc} here)", e.fix,
                          e.source or sources.get(e.key)) from None
    return nproc


def _check_knobs(env: Mapping[str, str]) -> S.Settings:
    """The tuning knobs the trainers and state managers will read (`leto_runtime.wire.settings`)."""
    try:
        return S.Settings.from_env(env)
    except S.SettingsError as e:
        raise ConfigError(e.var, e.problem, e.fix, "environment") from None
