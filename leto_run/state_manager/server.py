"""The state manager's Unix socket: authentication, request dispatch, replies with fds.

Role: the front door of one rank slot's pool.  One listening socket in the job's private run
directory (0700), the socket itself 0600; one thread per connection (at most `max_conns`);
operations run one at a time under the pool lock (they are short; replies with fd trains are
sent under the lock too, so no fd is closed by a concurrent `release` while it is being sent).

Who may connect (checked with SO_PEERCRED on every connection): our uid, and a pid that is
either our parent (the agent, or the test that started us) or listed in the keeper's allow file
within `allow_wait` seconds after connecting (the agent learns a trainer's pid only after
spawning it).  Everyone else gets one `not_authorized` reply and is disconnected.

Hostile input never stops the server: framing errors (`protocol.ProtocolError`) get an error
reply, and the connection is closed only when the stream position is lost (oversized,
truncated, fd-count mismatches); bad arguments get typed errors; an unexpected exception in a
handler becomes an `internal` error reply and a log line.

Requests (`protocol.OPS`), each a JSON header ``{"op": ..., "id": n, ...}``:
  hello                                  -> server info (version, device, geometry)
  allocate name nbytes [kind protected tier dtype shape exist_ok]
                                         -> {"created", "state"} + the state's fds
  attach name [nbytes]                   -> {"state"} + fds  (the stable name finds the memory;
                                            the state carries "uid" and "version": see refresh)
  list                                   -> {"states", "version"}
  refresh states [max_pages]             -> {"states": {name: {status, pages, marks}}, "names",
                                            "version"} + one fd per changed page that has memory
            states = [{"name", "uid", "version"}]: mappings made earlier (a shadow pre-attached
            while it waited); the reply lists only what changed since (Pool.changes)
  localize [device_failures {name: [i]}] -> {"marks", timings}
  remap [names mapped]                   -> {"replaced": [...], "current": {name: version}}
                                            + one fresh fd per entry (mapped: as in refresh)
  clear_marks name                       -> {"cleared"}
  release name                           -> {"pages"}
  inject tier [count first part group state] -> {"pages", "emulation"}
  status                                 -> pool statistics
"""
from __future__ import annotations

import math
import os
import selectors
import socket
import threading
import time
import traceback
from typing import Callable

from leto_run.state_manager.keeper import read_allow_file
from leto_run.state_manager.metadata import DTYPES
from leto_runtime.rmp import protocol as P

REPLY_TIMEOUT = 30.0
MAX_REFRESH_STATES = 4096      # states named in one refresh request
MAX_REFRESH_PAGES = 65536      # changed pages listed in one refresh reply (~1.5 MB of JSON)
_ITEMSIZE = {"uint8": 1, "int8": 1, "bool": 1, "int16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "float32": 4, "int64": 8, "float64": 8}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Server:
    def __init__(self, pool, path: str, *, allow_file: str | None, parent_pid: int,
                 allow_wait: float = 2.0, max_conns: int = 32,
                 log: Callable[[str], None] = print):
        self.pool, self.path, self.allow_file = pool, path, allow_file
        self.parent_pid, self.allow_wait, self.max_conns = parent_pid, allow_wait, max_conns
        self.log = log
        self.stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._nconn = 0
        self._count_lock = threading.Lock()
        self.listener = P.bind_private(path)

    # ---- accept loop -----------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop serving (safe from a signal handler: an Event and a pipe write)."""
        self.stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def serve(self) -> None:
        """Accept until `request_stop()` (the selector also wakes every 0.5 s)."""
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self.stop.is_set():
                ready = sel.select(timeout=0.5)
                if not ready or any(k.fileobj == self._wake_r for k, _ in ready):
                    continue
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    continue
                with self._count_lock:
                    full = self._nconn >= self.max_conns
                    if not full:
                        self._nconn += 1
                if full:
                    self._refuse(conn, P.Busy(f"{self.max_conns} connections already open"))
                    continue
                threading.Thread(target=self._connection, args=(conn,), daemon=True,
                                 name="leto-sm-conn").start()
        finally:
            sel.close()
            self.listener.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _refuse(self, conn: socket.socket, err: P.RmpError) -> None:
        try:
            P.send_message(conn, P.error_reply(err), deadline=time.monotonic() + 1.0)
        except P.RmpError:
            pass
        conn.close()

    def _authorized(self, cred: P.PeerCred) -> str | None:
        """None if the peer may talk to us, else the reason it may not."""
        if cred.uid != os.geteuid():
            return f"uid {cred.uid} is not the job's uid {os.geteuid()}"
        if cred.pid == self.parent_pid:
            return None
        deadline = time.monotonic() + self.allow_wait
        while True:
            if self.allow_file and cred.pid in read_allow_file(self.allow_file):
                return None
            if time.monotonic() >= deadline or self.stop.is_set():
                return (f"pid {cred.pid} is not registered for this rank slot "
                        f"(waited {self.allow_wait:g} s)")
            time.sleep(0.01)

    def _connection(self, conn: socket.socket) -> None:
        try:
            cred = P.peer_cred(conn)
            why = self._authorized(cred)
            if why:
                self.log(f"refused connection from pid {cred.pid} uid {cred.uid}: {why}")
                self._refuse(conn, P.NotAuthorized(why))
                return
            while not self.stop.is_set():
                try:
                    msg = P.recv_message(conn, deadline=None, idle_check=self.stop.is_set)
                except P.ProtocolError as e:
                    self._send(conn, P.error_reply(e), [])
                    if e.desync:
                        return
                    continue
                except P.RmpError:            # peer closed, or stopped while idle
                    return
                self._request(conn, msg.header, cred)
        except Exception as e:                # last resort: this connection only
            self.log(f"connection handler failed: {type(e).__name__}: {e}")
        finally:
            conn.close()
            with self._count_lock:
                self._nconn -= 1

    def _send(self, conn, reply: dict, fds: list[int]) -> None:
        deadline = time.monotonic() + REPLY_TIMEOUT
        try:
            if fds:
                P.send_fd_train(conn, reply, fds, deadline=deadline)
            else:
                P.send_message(conn, reply, deadline=deadline)
        except P.RmpError as e:
            self.log(f"reply not delivered: {e}")

    def _request(self, conn, h: dict, cred: P.PeerCred) -> None:
        op = h.get("op")
        rid = h.get("id") if _int(h.get("id")) else None
        with self.pool.lock:
            try:
                handler = getattr(self, f"op_{op}", None) if op in P.OPS else None
                if handler is None:
                    raise P.UnknownOp(f"unknown op {str(op)[:40]!r}; known: {', '.join(P.OPS)}")
                reply, fds = handler(h)
                reply = {"ok": True, **reply}
            except P.RmpError as e:
                reply, fds = P.error_reply(e), []
            except Exception as e:
                self.log(f"op {op!r} from pid {cred.pid} failed: {type(e).__name__}: {e}\n"
                         + traceback.format_exc())
                reply, fds = P.error_reply(P.InternalError(f"{type(e).__name__}: {e}")), []
            if rid is not None:
                reply["id"] = rid
            self._send(conn, reply, fds)

    # ---- operations (arguments validated here; the pool trusts them) -----------------------
    def op_hello(self, h):
        pool = self.pool
        return {"server": "leto-state-manager", "pid": os.getpid(), "protocol": P.VERSION,
                "device": pool.device.info(), "geometry": pool.meta.geometry.to_json(),
                "device_page_bytes": pool.meta.device_page_bytes}, []

    def op_allocate(self, h):
        name = P.arg(h, "name", str)
        nbytes = P.arg(h, "nbytes", int, check=lambda v: v > 0, what="an integer > 0")
        kind = P.arg(h, "kind", str, default="model", check=lambda v: v in P.KINDS,
                     what=f"one of {P.KINDS}")
        protected = P.arg(h, "protected", bool, default=(kind == "model"))
        tier = P.arg(h, "tier", str, default="device", check=lambda v: v in P.TIERS,
                     what=f"one of {P.TIERS}")
        dtype = P.arg(h, "dtype", str, default=None, check=lambda v: v in DTYPES,
                      what=f"one of {DTYPES}")
        shape = P.arg(h, "shape", list, default=None, check=lambda v: len(v) <= 16 and all(
            _int(x) and x >= 0 for x in v), what="a list of at most 16 integers >= 0")
        if shape is not None:
            if dtype is None:
                raise P.BadArgument("shape needs a dtype")
            if math.prod(shape) * _ITEMSIZE[dtype] > nbytes:
                raise P.SizeMismatch(f"shape {shape} of {dtype} needs "
                                     f"{math.prod(shape) * _ITEMSIZE[dtype]} bytes > nbytes={nbytes}")
        exist_ok = P.arg(h, "exist_ok", bool, default=False)
        st, created = self.pool.allocate(name, nbytes, kind, protected, tier, dtype, shape,
                                         exist_ok)
        d, fds = self.pool.describe(st)
        return {"created": created, "state": d}, fds

    def op_attach(self, h):
        st = self.pool.state(P.arg(h, "name", str))
        nbytes = P.arg(h, "nbytes", int, default=None)
        if nbytes is not None and nbytes != st.nbytes:
            raise P.SizeMismatch(f"state {st.name!r} holds {st.nbytes} bytes, not {nbytes}",
                                 {"nbytes": st.nbytes})
        d, fds = self.pool.describe(st)
        return {"state": d}, fds

    def op_list(self, h):
        meta = self.pool.meta
        return {"states": [{"name": s.name, "nbytes": s.nbytes, "kind": s.kind,
                            "protected": s.protected, "tier": s.tier, "pages": len(s.data),
                            "groups": [g.id for g in s.groups], "dtype": s.dtype,
                            "shape": s.shape, "marks": meta.marks(s), "uid": s.uid}
                           for s in meta.states.values()], "version": meta.version}, []

    def op_refresh(self, h):
        states = self._mapped_arg(h, "states")
        max_pages = P.arg(h, "max_pages", int, default=MAX_REFRESH_PAGES,
                          check=lambda v: 0 <= v <= MAX_REFRESH_PAGES,
                          what=f"an integer 0..{MAX_REFRESH_PAGES}")
        return self.pool.changes(states, max_pages)

    def op_localize(self, h):
        df = P.arg(h, "device_failures", dict, default={}, check=lambda d: all(
            isinstance(v, list) and all(_int(i) for i in v) for v in d.values()),
            what="an object {name: [page indices]}")
        return self.pool.localize(df), []

    def op_remap(self, h):
        names = P.arg(h, "names", list, default=None,
                      check=lambda v: all(isinstance(x, str) for x in v), what="a list of names")
        mapped = self._mapped_arg(h, "mapped", default=[])
        entries, fds, current = self.pool.remap(names, mapped)
        return {"replaced": entries, "marks": self.pool.all_marks(), "current": current}, fds

    @staticmethod
    def _mapped_arg(h, key, **kw) -> list[tuple[str, int, int]]:
        def ok_entry(e) -> bool:
            return (isinstance(e, dict) and isinstance(e.get("name"), str)
                    and _int(e.get("uid")) and _int(e.get("version")) and e["version"] >= 0)

        v = P.arg(h, key, list, check=lambda v: len(v) <= MAX_REFRESH_STATES and all(
            ok_entry(e) for e in v), what=f"a list of at most {MAX_REFRESH_STATES} "
                                          '{"name", "uid", "version"} objects', **kw)
        return [(e["name"], e["uid"], e["version"]) for e in v]

    def op_clear_marks(self, h):
        return {"cleared": self.pool.clear_marks(P.arg(h, "name", str))}, []

    def op_release(self, h):
        return {"pages": self.pool.release(P.arg(h, "name", str))}, []

    def op_inject(self, h):
        nonneg = dict(check=lambda v: v >= 0, what="an integer >= 0")
        rep = self.pool.inject(
            tier=P.arg(h, "tier", str, check=lambda v: v in P.TIERS, what=f"one of {P.TIERS}"),
            count=P.arg(h, "count", int, default=1, check=lambda v: v >= 1, what="an integer >= 1"),
            first=P.arg(h, "first", int, default=0, **nonneg),
            part=P.arg(h, "part", str, default=None, check=lambda v: v in ("data", "p1", "p2"),
                       what="data, p1 or p2"),
            group=P.arg(h, "group", int, default=None, **nonneg),
            state=P.arg(h, "state", str, default=None))
        return rep, []

    def op_status(self, h):
        return self.pool.status(), []
