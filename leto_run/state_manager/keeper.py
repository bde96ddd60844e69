"""The fd keeper: a CUDA-free copy of every fd a state manager exports, kept by the agent.

Why (docs/MEMORY.md, "Pages as fds"): importers of CUDA memory cannot re-export it, so if the state
manager dies, nobody could hand its GPU memory to a restarted one -- unless someone without CUDA
holds duplicates of the exported fds.  The keeper is that someone: it lives in the agent (one per
rank slot), costs no GPU memory, and gives a restarted state manager every fd and the newest
metadata snapshot.  It also owns the list of trainer pids the state manager may serve.

Agent side -- `FdKeeper(run_dir, slot)`:
    keeper = FdKeeper(run_dir, slot)                 # binds its socket, starts its thread
    proc = procs.spawn(keeper.state_manager_argv(device="cuda:0"), env)
    keeper.wait_ready(timeout=30)                    # the state manager serves its socket now
    env[contract.LETO_SM_SOCKET] = keeper.sm_socket  # for the trainers
    trainer = procs.spawn(...); keeper.allow_pid(trainer.pid)
    ... on the state manager's pidfd firing: spawn the same argv again (it restores itself)
    ... on a trainer's exit: keeper.revoke_pid(pid);  at job end: keeper.close()
A trainer's connection is accepted if its pid is allowed within `allow_wait` seconds (default
2 s) of connecting: the agent learns a trainer's pid only after spawning it, and the trainer may
connect first.  The agent's own pid (the state manager's parent) is always allowed.

State-manager side -- `KeeperLink(path)`: `hello()` (restore), `commit(put, drop, snapshot)`,
`ready()`.  Messages use `leto_runtime.wire.protocol` framing:
    hello            -> {"snapshot": {...} | null, "ids": [page ids]} + one fd per id (fd train)
    put {"ids"} + fds-> {"held": n}            (a later fd for the same id replaces the old one)
    commit {"snapshot", "drop": [ids]}  -> {"held": n, "capacity": m}
    ready            -> {}                     (wait_ready() returns)

Calling contract: `FdKeeper` methods are thread-safe; its thread uses one selector, and every
receive and send has a deadline.  Only a process whose parent is this process and whose uid is
ours may connect, one at a time.  Fds are received with MSG_CMSG_CLOEXEC, so they never leak
into the trainers the agent spawns.
"""
from __future__ import annotations

import errno
import json
import os
import resource
import selectors
import sys
import threading
import time
import weakref
import zlib
from typing import Callable

from leto_run.state_manager.metadata import Geometry
from leto_runtime.wire import protocol as P

KEEPER_TIMEOUT = 30.0
_FD_RESERVE = 128
# Every keeper of this process (the agent: one per rank slot) draws on the one RLIMIT_NOFILE,
# so a keeper's capacity is what the limit leaves after all of them.
_KEEPERS: "weakref.WeakSet[FdKeeper]" = weakref.WeakSet()


def fds_held_by_keepers() -> int:
    return sum(len(k._fds) for k in list(_KEEPERS))


def sm_socket_path(run_dir: str, slot: int) -> str:
    return os.path.join(run_dir, f"sm{slot}.sock")


def keeper_socket_path(run_dir: str, slot: int) -> str:
    return os.path.join(run_dir, f"sm{slot}.keeper.sock")


def allow_file_path(run_dir: str, slot: int) -> str:
    return os.path.join(run_dir, f"sm{slot}.allow")


# The allow file has one fixed size, its blocks allocated when the keeper starts and rewritten
# in place from then on: a full disk later (a shared $TMPDIR filling up) cannot fail an
# allow or a revoke mid-run.  4 KiB holds ~400 pids; a slot allows a handful at once.
ALLOW_SIZE = 4096


class AllowFileError(OSError):
    """The allow file could not be created or rewritten (errno kept from the cause)."""


def allow_record(pids: list[int]) -> bytes:
    """The allow file's bytes for `pids` (its fixed size, checksummed)."""
    body = json.dumps(pids, separators=(",", ":"))
    # the checksum lets a reader tell a whole record from one it read mid-rewrite
    rec = json.dumps({"v": 2, "pids": pids, "crc": zlib.crc32(body.encode())},
                     separators=(",", ":")).encode()
    if len(rec) + 1 > ALLOW_SIZE:
        raise AllowFileError(errno.ENOSPC, f"{len(pids)} allowed pids do not fit the "
                             f"{ALLOW_SIZE}-byte allow file: revoke exited trainers' pids")
    return rec + b" " * (ALLOW_SIZE - len(rec) - 1) + b"\n"


def _parse_allow(raw: bytes) -> set[int] | None:
    """The pids of a whole record; None for a record read mid-rewrite (torn)."""
    try:
        d = json.loads(raw)
        pids = [int(p) for p in d["pids"]]
        if zlib.crc32(json.dumps(pids, separators=(",", ":")).encode()) != d["crc"]:
            return None
        return set(pids)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def read_allow_file(path: str, tries: int = 20) -> set[int]:
    """The pids the agent allowed (missing or unreadable file: none).  The keeper rewrites the
    file in place, so a read that meets a rewrite is retried."""
    for _ in range(tries):
        try:
            with open(path, "rb") as f:
                got = _parse_allow(f.read(ALLOW_SIZE))
        except OSError:
            return set()
        if got is not None:
            return got
        time.sleep(0.001)
    return set()


def state_manager_argv(run_dir: str, slot: int, *, device: str = "auto",
                       geometry: Geometry | None = None, keeper: bool = True,
                       allow_wait: float = 2.0, python: str | None = None) -> list[str]:
    """The command line that starts slot `slot`'s state manager (also to restart it)."""
    g = geometry or Geometry()
    argv = [python or sys.executable, "-m", "leto_run.state_manager", "--run-dir", run_dir,
            "--slot", str(slot), "--device", device, "--data-pages", str(g.data_pages),
            "--tier1", str(g.tier1), "--tier2", str(g.tier2), "--page-bytes", str(g.page_bytes),
            "--allow-wait", repr(float(allow_wait))]
    if keeper:
        argv += ["--keeper", keeper_socket_path(run_dir, slot)]
    return argv


def _create_allow_file(path: str) -> int:
    """The allow file, its ALLOW_SIZE bytes written and allocated now (an empty list), open for
    in-place rewrites.  A disk already full here fails the keeper's start, typed."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
    except OSError as e:
        raise AllowFileError(e.errno, f"cannot create the allow file {path}: {e.strerror}; "
                             "free space in the run directory's file system ($TMPDIR)") from e
    try:
        os.posix_fallocate(fd, 0, ALLOW_SIZE)
        if os.pwrite(fd, allow_record([]), 0) != ALLOW_SIZE:
            raise OSError(errno.EIO, "short write")
    except OSError as e:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise AllowFileError(e.errno, f"cannot allocate the allow file {path}: {e.strerror}; "
                             "free space in the run directory's file system ($TMPDIR)") from e
    return fd


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class FdKeeper:
    """Keeps duplicates of one state manager's fds and its metadata; see the module docstring."""

    def __init__(self, run_dir: str, slot: int, *, log: Callable[[str], None] | None = None):
        self.run_dir, self.slot = run_dir, slot
        self.path = keeper_socket_path(run_dir, slot)
        self.sm_socket = sm_socket_path(run_dir, slot)
        self.allow_path = allow_file_path(run_dir, slot)
        self._log = log or (lambda m: print(f"[leto fd-keeper slot={slot}] {m}", file=sys.stderr))
        self.nofile = P.raise_nofile_limit()
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._snapshot: dict | None = None
        self._allowed: set[int] = set()
        self._ready = threading.Event()
        self._stop = False
        self._conn = None
        self._conn_pid: int | None = None
        self.restores = 0                    # how many state managers got memory back from us
        self.allow_error: str | None = None  # the last failed rewrite of the allow file
        self._allow_fd = _create_allow_file(self.allow_path)   # raises AllowFileError
        try:
            self._listen = P.bind_private(self.path, backlog=4)
        except BaseException:                # a keeper that never started leaves no file
            os.close(self._allow_fd)
            os.unlink(self.allow_path)
            raise
        _KEEPERS.add(self)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._loop, name=f"leto-fd-keeper-{slot}",
                                        daemon=True)
        self._thread.start()

    # ---- agent API -------------------------------------------------------------------------
    def state_manager_argv(self, **kw) -> list[str]:
        return state_manager_argv(self.run_dir, self.slot, keeper=True, **kw)

    def allow_pid(self, pid: int) -> bool:
        """Allow `pid`; False (logged, never raised) when the allow file could not be
        rewritten: that trainer's connection is then refused, with a typed error, not the agent."""
        with self._lock:
            self._allowed.add(int(pid))
            return self._write_allow(f"allow pid {pid}")

    def revoke_pid(self, pid: int) -> bool:
        """Revoke `pid`; False (logged) when the file could not be rewritten.  Revoking
        follows the trainer's exit, so a failure here never fails the job."""
        with self._lock:
            self._allowed.discard(int(pid))
            return self._write_allow(f"revoke pid {pid}")

    def wait_ready(self, timeout: float) -> bool:
        """True once a state manager connected, restored and serves its socket."""
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def stats(self) -> dict:
        with self._lock:
            snap = self._snapshot or {}
            return {"fds": len(self._fds), "connected_pid": self._conn_pid,
                    "metadata_version": (snap.get("meta") or {}).get("version"),
                    "restores": self.restores, "allowed": sorted(self._allowed)}

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close every kept fd (the memory goes with the last holder)."""
        if self._stop:
            return
        self._stop = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        with self._lock:
            P.close_fds(list(self._fds.values()))
            self._fds.clear()
        _KEEPERS.discard(self)
        os.close(self._allow_fd)
        for p in (self.path, self.allow_path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # ---- internals -------------------------------------------------------------------------
    def _write_allow(self, what: str) -> bool:
        """Rewrite the allow file in place (blocks allocated at start: no new ones needed)."""
        try:
            data = allow_record(sorted(self._allowed))
            try:
                n = os.pwrite(self._allow_fd, data, 0)
            except OSError as e:
                raise AllowFileError(e.errno, e.strerror) from e
            if n != len(data):
                raise AllowFileError(errno.EIO, f"short write ({n} of {len(data)} bytes)")
        except AllowFileError as e:
            self.allow_error = (f"cannot {what}: rewriting {self.allow_path} failed "
                                f"({e.strerror}); the state manager keeps the previous list")
            self._log(f"{self.allow_error} (check the disk of the run directory)")
            return False
        return True

    def _capacity(self) -> int:
        """fds this keeper may still take: the process's soft limit minus what every keeper
        here holds, minus a reserve per keeper (sockets, logs, the agent's own files)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return max(0, soft - fds_held_by_keepers() - _FD_RESERVE * max(1, len(_KEEPERS)))

    def _limits(self) -> dict:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return {"capacity": self._capacity(), "held_total": fds_held_by_keepers(),
                "keepers": len(_KEEPERS), "nofile": [soft, hard]}

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listen, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop:
                for key, _ in sel.select(timeout=1.0):
                    if key.data == "listen":
                        self._accept(sel)
                    elif key.data == "conn":
                        self._serve_one(sel)
        except Exception as e:  # never let the agent's keeper die silently
            self._log(f"keeper thread failed: {type(e).__name__}: {e}")
        finally:
            self._drop_conn(sel)
            sel.close()
            self._listen.close()

    def _accept(self, sel) -> None:
        try:
            conn, _ = self._listen.accept()
        except OSError:
            return
        cred = P.peer_cred(conn)
        why = None
        if cred.uid != os.geteuid():
            why = f"uid {cred.uid} is not ours"
        elif _parent_of(cred.pid) != os.getpid():
            why = f"pid {cred.pid} is not a child of this agent"
        elif self._conn is not None:
            if _parent_of(self._conn_pid) is not None:
                why = f"state manager pid {self._conn_pid} is still connected"
            else:
                self._drop_conn(sel)          # the old one is dead; its EOF is still queued
        if why:
            self._log(f"refused a connection: {why}")
            try:
                P.send_message(conn, P.error_reply(P.NotAuthorized(why)),
                               deadline=time.monotonic() + 1.0)
            except P.RmpError:
                pass
            conn.close()
            return
        self._conn, self._conn_pid = conn, cred.pid
        sel.register(conn, selectors.EVENT_READ, "conn")

    def _drop_conn(self, sel) -> None:
        if self._conn is not None:
            try:
                sel.unregister(self._conn)
            except (KeyError, ValueError):
                pass
            self._conn.close()
            self._conn, self._conn_pid = None, None
            self._ready.clear()

    def _serve_one(self, sel) -> None:
        conn = self._conn
        deadline = time.monotonic() + KEEPER_TIMEOUT
        try:
            with self._lock:
                cap = self._capacity()
            msg = P.recv_fd_train(conn, deadline=deadline, max_fds=cap)
        except P.ProtocolError as e:
            self._reply(conn, P.error_reply(e))
            if e.desync:
                self._drop_conn(sel)
            return
        except P.RmpError:                    # EOF (the state manager died) or a stall
            self._drop_conn(sel)
            return
        try:
            reply, fds = self._handle(msg)
        except P.RmpError as e:
            msg.close_fds()
            reply, fds = P.error_reply(e), []
        if fds:
            try:
                P.send_fd_train(conn, reply, fds, deadline=time.monotonic() + KEEPER_TIMEOUT)
            except P.RmpError:
                self._drop_conn(sel)
        else:
            self._reply(conn, reply)

    def _reply(self, conn, reply: dict) -> None:
        try:
            P.send_message(conn, reply, deadline=time.monotonic() + KEEPER_TIMEOUT)
        except P.RmpError:
            pass

    def _handle(self, msg: P.Message) -> tuple[dict, list[int]]:
        h, op = msg.header, msg.header.get("op")
        with self._lock:
            if op == "hello":
                if msg.fds:
                    raise P.BadFds("hello carries no fds")
                ids = sorted(self._fds)
                if self._snapshot is not None:
                    self.restores += 1
                return ({"ok": True, "snapshot": self._snapshot, "ids": ids,
                         **self._limits()}, [self._fds[i] for i in ids])
            if op == "put":
                ids = P.arg(h, "ids", list, check=lambda v: all(
                    isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v))
                if len(ids) != len(msg.fds) or len(set(ids)) != len(ids):
                    raise P.BadFds(f"put: {len(ids)} ids for {len(msg.fds)} fds")
                for pid, fd in zip(ids, msg.fds):
                    old = self._fds.pop(pid, None)
                    if old is not None:
                        os.close(old)
                    self._fds[pid] = fd
                return {"ok": True, "held": len(self._fds), **self._limits()}, []
            if msg.fds:
                raise P.BadFds(f"{op} carries no fds")
            if op == "commit":
                snap = P.arg(h, "snapshot", dict)
                drop = P.arg(h, "drop", list, default=[])
                for pid in drop:
                    fd = self._fds.pop(pid, None) if isinstance(pid, int) else None
                    if fd is not None:
                        os.close(fd)
                self._snapshot = snap
                return {"ok": True, "held": len(self._fds), **self._limits()}, []
            if op == "ready":
                self._ready.set()
                return {"ok": True}, []
        raise P.UnknownOp(f"keeper: unknown op {str(op)[:40]!r}")


class KeeperLink:
    """The state manager's connection to its keeper (one request at a time, under the pool lock)."""

    def __init__(self, path: str, timeout: float = KEEPER_TIMEOUT):
        self.path, self.timeout = path, timeout
        self.sock = P.connect(path, deadline=time.monotonic() + timeout)
        self.capacity = 0
        self.limits: dict = {}

    def _call(self, header: dict, fds: list[int] | None = None, max_fds: int = 0) -> P.Message:
        deadline = time.monotonic() + self.timeout
        if fds:
            P.send_fd_train(self.sock, header, fds, deadline=deadline)
        else:
            P.send_message(self.sock, header, deadline=deadline)
        msg = P.recv_fd_train(self.sock, deadline=deadline, max_fds=max_fds)
        try:
            P.raise_for_reply(msg.header)
        except P.RmpError:
            msg.close_fds()
            raise
        if "capacity" in msg.header:
            self.capacity = int(msg.header["capacity"])
            self.limits = {k: msg.header[k] for k in ("held_total", "keepers", "nofile")
                           if k in msg.header}
        return msg

    def hello(self, max_fds: int) -> tuple[dict | None, dict[int, int]]:
        """The kept snapshot (None on a first start) and {page id: fd}."""
        msg = self._call({"op": "hello", "pid": os.getpid()}, max_fds=max_fds)
        ids = msg.header.get("ids", [])
        if len(ids) != len(msg.fds):
            msg.close_fds()
            raise P.BadFds(f"keeper sent {len(msg.fds)} fds for {len(ids)} ids")
        return msg.header.get("snapshot"), dict(zip((int(i) for i in ids), msg.fds))

    def commit(self, put: dict[int, int], drop: list[int], snapshot: dict) -> None:
        if put and len(put) > self.capacity:
            held = int(self.limits.get("held_total", 0))
            hard = (self.limits.get("nofile") or [0, 0])[1]
            n = int(self.limits.get("keepers", 1))
            need = held + len(put) + _FD_RESERVE * max(1, n)
            raise P.FdLimit(f"the agent's fd keeper can take {self.capacity} more fds, "
                            f"{len(put)} needed ({held} held by the {n} keeper(s) of this "
                            f"node): " + P.nofile_fix(need, hard, "the agent (fd keepers of "
                                                      "every rank slot of this node)"),
                            {"capacity": self.capacity, "need": need, "hard": hard,
                             P.BEYOND_HARD_LIMIT: True})
        if put:
            ids = list(put)
            self._call({"op": "put", "ids": ids}, [put[i] for i in ids])
        self._call({"op": "commit", "snapshot": snapshot, "drop": list(drop)})

    def ready(self) -> None:
        self._call({"op": "ready"})

    def close(self) -> None:
        self.sock.close()
