"""The state manager's Unix socket: authentication, request dispatch, replies with fds.

Role: the front door of one rank slot's pool.  One listening socket in the job's private run
directory (0700), the socket itself 0600; one thread per connection.  Operations run one at a
time under the pool lock (they are short: sizes are checked before the work, `budget.py`);
replies are sent without it (`replies.py`), so a client that stops reading stalls only itself
and is dropped after `Limits.send_stall` seconds.

Who may connect (SO_PEERCRED on every connection): our uid, and a pid that is either our parent
(the agent, or the test that started us) or listed in the keeper's allow file, at once or
within `allow_wait` seconds after connecting (the agent learns a trainer's pid only after
spawning it).  Everyone else gets one `not_authorized` reply and is disconnected.  How many
connections each may hold, and for how long an idle one stays open: `conns.py`.

Hostile input never stops the server: framing errors (`protocol.ProtocolError`, including
over-deep JSON and out-of-range numbers) get an error reply, and the connection is closed only
when the stream position is lost (oversized, truncated, fd-count mismatches); bad arguments
get typed errors, before any work that grows with them; an unexpected exception in a handler
becomes an `internal` error reply and a log line.

Requests (`protocol.OPS`), each a JSON header ``{"op": ..., "id": n, ...}``:
  hello                                  -> server info (version, device, geometry, limits)
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
  status                                 -> pool statistics, connections, fds in flight
"""
from __future__ import annotations

import math
import os
import resource
import selectors
import socket
import threading
import time
import traceback
from typing import Callable

from leto_run.state_manager.budget import FdBudget, check_allocation
from leto_run.state_manager.conns import ConnTable, Limits, RateLimitedLog, limits_from_env
from leto_run.state_manager.keeper import read_allow_file
from leto_run.state_manager.metadata import DTYPES, NAME_RE
from leto_run.state_manager.replies import Part, Replies, WaitFds, plain
from leto_runtime.wire import settings
from leto_runtime.wire import protocol as P

MAX_REFRESH_STATES = 4096      # states named in one refresh / remap request
MAX_REFRESH_PAGES = 65536      # changed pages listed in one refresh reply (~1.5 MB of JSON)
MAX_INJECT_PAGES = 1024        # pages one inject destroys (or a whole group)
REGISTER_POLL = 0.02           # how often a pending connection re-reads the allow file
LINGER, MAX_LINGER = 1.0, 64   # a refused connection stays open for the peer's request
N = P.MAX_FDS_PER_MESSAGE
_MUTATING = frozenset({"allocate", "remap"})      # ops with fds in the reply that change the pool
_ITEMSIZE = {"uint8": 1, "int8": 1, "bool": 1, "int16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "float32": 4, "int64": 8, "float64": 8}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Server:
    def __init__(self, pool, path: str, *, allow_file: str | None, parent_pid: int,
                 allow_wait: float = 2.0, max_conns: int | None = None,
                 limits: Limits | None = None, log: Callable[[str], None] = print):
        self.pool, self.path, self.allow_file = pool, path, allow_file
        self.parent_pid, self.allow_wait = parent_pid, allow_wait
        self.log = log
        if limits is None:
            limits, why = limits_from_env(settings.raw())
            if why:
                log(f"WARNING: {why}")
        if max_conns is not None:
            limits = Limits(max_conns, limits.max_per_pid, limits.max_pending,
                            limits.idle_timeout, limits.send_stall)
        self.limits = limits
        self.conns = ConnTable(limits)
        self.refusals = RateLimitedLog(log)
        # sockets of every slot, the listener, the wake pipe, the keeper link, logs
        self.budget = FdBudget(pool, 64 + limits.max_conns + limits.max_pending)
        self.replies = Replies(pool, self.budget, limits.send_stall, log, self.refusals)
        self.stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._linger: dict[socket.socket, float] = {}     # refused, open until this time
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
        sel = self._sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self.stop.is_set():
                for key, _ in sel.select(timeout=0.1 if self._linger else 0.5):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        self._end_linger(key.fileobj)
                now = time.monotonic()
                for conn in [c for c, t in self._linger.items() if t <= now]:
                    self._end_linger(conn)
        finally:
            for conn in list(self._linger):
                self._end_linger(conn)
            sel.close()
            self.listener.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            self._admit(conn)
        except Exception as e:        # this connection only
            self.log(f"admitting a connection failed: {type(e).__name__}: {e}")
            conn.close()

    def _refuse_now(self, conn: socket.socket, err: P.RmpError) -> None:
        """Refuse from the accept loop: the reply, then the socket stays open until the peer's
        first request arrives (or LINGER s), so its send does not fail before it reads why."""
        try:
            P.send_message(conn, P.error_reply(err), deadline=time.monotonic() + 1.0)
        except P.RmpError:
            return conn.close()
        if len(self._linger) >= MAX_LINGER:
            return conn.close()
        self._linger[conn] = time.monotonic() + LINGER
        self._sel.register(conn, selectors.EVENT_READ)

    def _end_linger(self, conn) -> None:
        self._linger.pop(conn, None)
        self._sel.unregister(conn)
        conn.close()

    def _registered(self, pid: int) -> bool:
        return pid == self.parent_pid or bool(
            self.allow_file and pid in read_allow_file(self.allow_file))

    def _admit(self, conn: socket.socket) -> None:
        """A slot (authenticated if the peer is registered now, else pending) or a refusal."""
        cred = P.peer_cred(conn)
        if cred.uid != os.geteuid():
            why = f"uid {cred.uid} is not the job's uid {os.geteuid()}"
            self.refusals(f"refused connection from pid {cred.pid} uid {cred.uid}: {why}")
            return self._refuse_now(conn, P.NotAuthorized(why))
        authenticated = self._registered(cred.pid)
        why = self.conns.take_auth(cred.pid) if authenticated else self.conns.take_pending()
        if why:
            self.refusals(f"refused connection from pid {cred.pid}: {why}")
            return self._refuse_now(conn, P.Busy(why))
        threading.Thread(target=self._connection, args=(conn, cred, authenticated),
                         daemon=True, name="leto-sm-conn").start()

    def _refuse(self, conn: socket.socket, err: P.RmpError) -> None:
        try:
            P.send_message(conn, P.error_reply(err), deadline=time.monotonic() + 1.0)
        except P.RmpError:
            pass
        conn.close()

    def _wait_registered(self, cred: P.PeerCred) -> str | None:
        """None once the pid is registered (within allow_wait), else the reason it is not."""
        deadline = time.monotonic() + self.allow_wait
        while not self._registered(cred.pid):
            if time.monotonic() >= deadline or self.stop.is_set():
                return (f"pid {cred.pid} is not registered for this rank slot "
                        f"(waited {self.allow_wait:g} s)")
            time.sleep(REGISTER_POLL)
        return None

    # ---- one connection ----------------------------------------------------------------------
    def _connection(self, conn: socket.socket, cred: P.PeerCred, authenticated: bool) -> None:
        slot = "auth" if authenticated else "pending"     # the slot this thread must give back
        farewell: P.RmpError | None = None                # what the peer is told as we close
        try:
            if slot == "pending":
                why = self._wait_registered(cred)
                farewell = P.NotAuthorized(why) if why else None
                if why is None:
                    why = self.conns.take_auth(cred.pid, from_pending=True)
                    slot = None if why else "auth"       # the pending slot is left either way
                    farewell = P.Busy(why) if why else None
                if farewell is not None:
                    self.refusals(f"refused connection from pid {cred.pid}: {why}")
            if farewell is None:
                farewell = self._serve_connection(conn, cred)
        except Exception as e:                # last resort: this connection only
            self.log(f"connection handler failed: {type(e).__name__}: {e}")
        finally:
            # The slot is given back before the peer can see the close: a client that
            # reconnects at once must not find its old connection still counted.
            if slot is not None:
                self.conns.leave(cred.pid, slot == "auth")
            if farewell is not None:
                self._refuse(conn, farewell)
            conn.close()

    def _serve_connection(self, conn: socket.socket, cred: P.PeerCred) -> P.RmpError | None:
        """Serve requests until the peer closes (None) or the connection must end; returns
        what the peer is to be told then (idle, stopping)."""
        idle = {"since": time.monotonic(), "why": ""}

        def idle_over() -> bool:
            if self.stop.is_set():
                idle["why"] = "the state manager is stopping"
            elif time.monotonic() - idle["since"] > self.limits.idle_timeout:
                idle["why"] = f"idle for more than {self.limits.idle_timeout:g} s"
            return bool(idle["why"])

        while True:
            try:
                msg = P.recv_message(conn, deadline=None, idle_check=idle_over)
            except P.ProtocolError as e:
                if not self.replies.deliver(conn, plain(P.error_reply(e), None), [], 0) \
                        or e.desync:
                    return None
                continue
            except P.RmpError:            # peer closed, or idle / stopping
                if idle["why"]:
                    return P.Closing(
                        f"connection closed between requests ({idle['why']}); no request "
                        "was lost: reconnect", {"reason": idle["why"]})
                return None
            if not self._request(conn, msg.header, cred):
                return None
            idle["since"] = time.monotonic()

    # ---- requests ----------------------------------------------------------------------------
    def _request(self, conn, h: dict, cred: P.PeerCred) -> bool:
        """Run one request and send its reply; False when the connection must be closed."""
        op = h.get("op")
        rid = h.get("id") if _int(h.get("id")) else None
        deadline = time.monotonic() + self.limits.send_stall + 2.0   # any reply out by then
        while True:
            with self.pool.lock:
                try:
                    part, rest, version = self._run(conn, op, h, rid, cred)
                    break
                except WaitFds as w:
                    need = w.n
            if not self.budget.wait(need, deadline):
                err = P.FdLimit(f"the state manager cannot open {need} more fds now: "
                                f"{len(self.pool.fds)} held by pages, {self.budget.inflight} "
                                "by replies to other clients; try again, or raise "
                                "RLIMIT_NOFILE", {"need": need})
                part, rest, version = plain(P.error_reply(err), rid), [], 0
                break
        return self.replies.deliver(conn, part, rest, version)

    def _run(self, conn, op, h: dict, rid, cred: P.PeerCred) -> tuple[Part, list[int], int]:
        """Pool lock held: run the op and offer its reply (`Replies.offer`); returns the first
        message, the page ids of the later messages' fds, and the pool version it describes."""
        try:
            handler = getattr(self, f"op_{op}", None) if op in P.OPS else None
            if handler is None:
                raise P.UnknownOp(f"unknown op {str(op)[:40]!r}; known: {', '.join(P.OPS)}")
            reply, fds = handler(h)
            reply = {"ok": True, **reply, **({} if rid is None else {"id": rid})}
            rest: list[int] = []
            if len(fds) > N:                 # later messages look their fds up again
                by_fd = {fd: pid for pid, fd in self.pool.fds.items()}
                rest = [by_fd[fd] for fd in fds[N:]]
            try:
                data = P.encode({**reply, "nfds_total": len(fds)} if fds else reply,
                                min(len(fds), N))
            except P.MessageTooLarge as e:
                raise P.MessageTooLarge(f"the reply is too large ({e.message}); ask for less "
                                        "(e.g. refresh max_pages)") from None
            part = self.replies.offer(conn, data, fds[:N])
            if part is None:
                if op in _MUTATING:           # `_room` reserved it: only a lowered rlimit
                    raise P.FdLimit(f"no fds free to send the reply of {op} (it was done): "
                                    "attach or refresh to see the result")
                raise WaitFds(min(len(fds), N))      # nothing changed: run it again
            return part, rest, self.pool.meta.version
        except WaitFds:
            raise
        except P.RmpError as e:
            return plain(P.error_reply(e), rid), [], 0
        except Exception as e:
            self.log(f"op {op!r} from pid {cred.pid} failed: {type(e).__name__}: {e}\n"
                     + traceback.format_exc())
            return plain(P.error_reply(P.InternalError(f"{type(e).__name__}: {e}")), rid), [], 0

    def _room(self, new: int, reply: int) -> None:
        """Before a mutation: `new` page fds and the reply's first message must fit now
        (`WaitFds` if replies in flight hold the room, `FdLimit` if it never will)."""
        n = new + min(reply, N)
        if self.budget.free() >= n:
            return
        if self.budget.could_fit(n):
            raise WaitFds(n)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise P.FdLimit(f"{new} more pages and their reply would exceed RLIMIT_NOFILE "
                        f"({len(self.pool.fds)} page fds held): "
                        + P.nofile_fix(len(self.pool.fds) + n + self.budget.reserve,
                                       resource.getrlimit(resource.RLIMIT_NOFILE)[1],
                                       "the state manager"),
                        {"need": n, "soft": soft, "held": len(self.pool.fds),
                         P.BEYOND_HARD_LIMIT: True})

    # ---- operations (arguments validated here; the pool trusts them) -----------------------
    def op_hello(self, h):
        pool = self.pool
        return {"server": "leto-state-manager", "pid": os.getpid(), "protocol": P.VERSION,
                "device": pool.device.info(), "geometry": pool.meta.geometry.to_json(),
                "device_page_bytes": pool.meta.device_page_bytes,
                "limits": self.limits.to_json()}, []

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
        if name not in self.pool.meta.states:     # else nothing is created (exist_ok: attach)
            need = check_allocation(self.pool, nbytes, tier, protected)     # O(1), typed
            self._room(need.fds, need.fds)
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
        names = P.arg(h, "names", list, default=None, check=lambda v: len(v) <= MAX_REFRESH_STATES
                      and all(isinstance(x, str) and NAME_RE.fullmatch(x) for x in v),
                      what=f"a list of at most {MAX_REFRESH_STATES} state names")
        mapped = self._mapped_arg(h, "mapped", default=[])
        chosen = None if names is None else set(names)    # a set: the pool tests every page
        meta = self.pool.meta
        todo = sum(1 for pid, f in meta.flags.items() if f.needs_remap and pid in meta.where
                   and (chosen is None or meta.where[pid].state in chosen))
        self._room(todo, todo)
        entries, fds, current = self.pool.remap(chosen, mapped)
        return {"replaced": entries, "marks": self.pool.all_marks(), "current": current}, fds

    @staticmethod
    def _mapped_arg(h, key, **kw) -> list[tuple[str, int, int]]:
        def ok_entry(e) -> bool:
            return (isinstance(e, dict) and isinstance(e.get("name"), str)
                    and NAME_RE.fullmatch(e["name"]) is not None
                    and _int(e.get("uid")) and _int(e.get("version")) and e["version"] >= 0)

        v = P.arg(h, key, list, check=lambda v: len(v) <= MAX_REFRESH_STATES and all(
            ok_entry(e) for e in v), what=f"a list of at most {MAX_REFRESH_STATES} "
                                          '{"name", "uid", "version"} objects', **kw)
        names = [e["name"] for e in v]
        if len(set(names)) != len(names):
            dup = next(n for i, n in enumerate(names) if n in names[:i])
            raise P.BadArgument(f"{key}: state {dup!r} is named more than once")
        return [(e["name"], e["uid"], e["version"]) for e in v]

    def op_clear_marks(self, h):
        return {"cleared": self.pool.clear_marks(P.arg(h, "name", str))}, []

    def op_release(self, h):
        return {"pages": self.pool.release(P.arg(h, "name", str))}, []

    def op_inject(self, h):
        nonneg = dict(check=lambda v: v >= 0, what="an integer >= 0")
        most = max(MAX_INJECT_PAGES, self.pool.meta.geometry.data_pages)    # a whole group
        rep = self.pool.inject(
            tier=P.arg(h, "tier", str, check=lambda v: v in P.TIERS, what=f"one of {P.TIERS}"),
            count=P.arg(h, "count", int, default=1, check=lambda v: 1 <= v <= most,
                        what=f"an integer 1..{most}"),
            first=P.arg(h, "first", int, default=0, **nonneg),
            part=P.arg(h, "part", str, default=None, check=lambda v: v in ("data", "p1", "p2"),
                       what="data, p1 or p2"),
            group=P.arg(h, "group", int, default=None, **nonneg),
            state=P.arg(h, "state", str, default=None))
        return rep, []

    def op_status(self, h):
        return {**self.pool.status(), "connections": self.conns.stats(),
                "replies_waiting": self.replies.sending,
                "reply_fds_in_flight": self.budget.inflight, "limits": self.limits.to_json()}, []
