"""The job's key (`leto_runtime.control_auth`): where the agent gets it, and the typed errors of
a control value that does not verify.

Where the key comes from (`job_key(cfg)`):
* a single-node job (max nodes 1): 32 fresh random bytes per job -- nothing to configure; a
  secret file given anyway (`--secret-file`, ...) is still checked as below (a ConfigError if it
  is missing, unreadable or unsafe: a named file is never silently ignored), then not used;
* several nodes: every agent must hold the same key, so it is derived from a secret file the
  nodes share (`rendezvous.secret_file` / `--secret-file` / LETO_SECRET_FILE, else
  DEFAULT_SECRET_FILE when it exists: a home directory on a shared file system makes it common)
  and the job's rendezvous id.  The file must be a regular file of this user, unreadable by
  group and others (mode 0600 or stricter), with 32 to 4096 bytes.  A multi-node in-place job
  without one is a `ConfigError` (exit 2, nothing started); a multi-node restart-mode job runs
  without a key (torchrun's trust: its stores are not authenticated), or with it when the file
  exists.
The agent hands the key to its workers through the environment (`contract.LETO_JOB_KEY`), never
through a store.

Calling contract: `job_key(cfg)` is called by the agent before it starts anything (its
`ConfigError` leaves nothing behind) and returns bytes or None.  `forged(...)` and
`not_granted(...)` build the `errors.ControlForged` the agent raises to stop the job.
"""
from __future__ import annotations

import json
import os
import secrets
import stat

from leto_run import errors as E
from leto_run.errors import ConfigError
from leto_runtime.control_auth import KEY_BYTES, derive_job_key

DEFAULT_SECRET_FILE = "~/.config/leto/job_secret"
MAX_SECRET_BYTES = 4096
CREATE_HINT = ("create one on a file system every node mounts: mkdir -p ~/.config/leto && "
               "(umask 077 && head -c 32 /dev/urandom > ~/.config/leto/job_secret), or give "
               "--secret-file PATH (a file with the same content on every node)")
KEY = "rendezvous.secret_file"


def job_key(cfg) -> bytes | None:
    """The key of this job (module docstring)."""
    given = cfg.rendezvous.secret_file
    path = os.path.expanduser(given or DEFAULT_SECRET_FILE)
    if cfg.launch.max_nodes <= 1:
        if given is not None:
            # A typo or a file not yet created here would fail only on the multi-node run; a
            # fresh key stays the single node's (no other agent needs to share it).
            read_secret(path, given)
        return secrets.token_bytes(KEY_BYTES)
    if given is None and not os.path.lexists(path):
        if cfg.recovery.mode != "inplace":
            return None
        raise ConfigError(KEY, "a multi-node in-place job needs a secret shared by every node "
                          "(it authenticates the recovery's control values in the job's stores)"
                          f"; none was given and {DEFAULT_SECRET_FILE} does not exist",
                          CREATE_HINT + "; or use --recovery restart")
    if cfg.recovery.mode == "inplace" and cfg.rendezvous.id in ("", "none"):
        # The key is derived from the secret and the id: runs sharing an id share a key, and a
        # value signed in one run would verify in the next.
        raise ConfigError("rendezvous.id", "a multi-node in-place job needs its own "
                          "--rdzv-id (the job's key is derived from it; with the default "
                          "'none' every run would share one key)",
                          "give every run a fresh id, e.g. --rdzv-id $SLURM_JOB_ID or "
                          "--rdzv-id $(uuidgen)")
    return derive_job_key(read_secret(path, given), cfg.rendezvous.id)


def read_secret(path: str, given: str | None = None) -> bytes:
    """The secret in `path` after the checks of the module docstring (ConfigError otherwise)."""
    shown = given or DEFAULT_SECRET_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(KEY, f"{shown!r} cannot be opened: {e.strerror or e}",
                          CREATE_HINT) from None
    try:
        st = os.fstat(fd)
        problem = secret_file_problem(st.st_mode, st.st_uid, st.st_size, os.geteuid())
        if problem:
            raise ConfigError(KEY, f"{shown!r} {problem}", _fix(problem, shown))
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if not KEY_BYTES <= len(data) <= MAX_SECRET_BYTES:     # it changed under us
        raise ConfigError(KEY, f"{shown!r} has {len(data)} bytes", CREATE_HINT)
    return data


def secret_file_problem(mode: int, uid: int, size: int, euid: int) -> str | None:
    """Why a file with these properties cannot hold the job's secret (None: it can)."""
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if uid != euid:
        return f"belongs to uid {uid}, not to this user (uid {euid})"
    if stat.S_IMODE(mode) & 0o077:
        return (f"has mode {stat.S_IMODE(mode):04o}: group or others may read or write it")
    if not KEY_BYTES <= size <= MAX_SECRET_BYTES:
        return f"has {size} bytes; a secret has {KEY_BYTES} to {MAX_SECRET_BYTES}"
    return None


def _fix(problem: str, shown: str) -> str:
    if problem.startswith("has mode"):
        return f"chmod 600 {shown}"
    return CREATE_HINT


def forged(where: str, key: str, reason: str, multi_node: bool) -> "E.ControlForged":
    """The error that stops a job whose store held a value that does not verify."""
    why = ("a process without this job's key wrote it: another user of this machine, or a "
           "host that reaches the store's port")
    if multi_node:
        why += ", or the nodes do not share the same secret file"
    return E.ControlForged(
        f"{where}: the value under {key!r} in the job's store did not verify ({reason}); "
        f"{why}. Leto did not act on it and stops the job. Fix: find who writes to the job's "
        "stores; run jobs where other users cannot reach them (a single-node job's stores "
        "listen on loopback only; keep multi-node jobs on a private network, with one secret "
        "file for all nodes)")


def forged_report(rank: int, role: str, pid: int, generation: int, detail: str | None,
                  multi_node: bool) -> "E.ControlForged":
    """The error for a trainer's `forged` datagram (detail JSON {"key", "reason"})."""
    try:
        d = json.loads(detail or "{}")
    except ValueError:
        d = {}
    d = d if isinstance(d, dict) else {}
    return forged(f"rank {rank}'s {role} (pid {pid}, generation {generation})",
                  str(d.get("key", "?")), str(d.get("reason", "no reason given")), multi_node)


def not_granted(rank: int, pid: int, role: str, generation: int) -> "E.ControlForged":
    """A process reports a promotion its agent did not grant."""
    return E.ControlForged(
        f"rank {rank}'s {role} (pid {pid}, generation {generation}) reports it was promoted, "
        "but this agent did not set its go key: a process took a role its agent did not "
        f"grant, so two trainers could write rank {rank}'s retained state; the job is stopped. "
        "Fix: find who writes to the job's stores (another user, or a Leto runtime of "
        "another version)")
