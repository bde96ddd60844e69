"""The trainer's side of the Resilient Memory Pool: ask the state manager, map, expose tensors.

Role: `RmpClient` talks to this rank slot's state manager (socket from `Context.sm_socket`, i.e.
LETO_SM_SOCKET); every state it allocates or attaches is mapped into this process as a
`RetainedState` -- its pages back to back in one reserved address range (GPU or host, see
`mapping.py`), and, for protected state, its parity pages in a second (host) range, pinned on
GPU machines.  Tensors are zero-copy views (`tensors.py`).

Typical use (a promoted trainer after a failure)::

    c = RmpClient()                          # connects; retries while the socket appears
    w = c.attach("model.params")             # the stable name finds the same memory
    rep = c.localize()                       # probe device pages here, host pages in the SM
    c.remap()                                # fresh memory behind every failed page
    reconstruct(c)                           # leto_runtime.rmp.reconstruct: parity -> pages
    t = w.tensor()                           # zero-copy torch view (dtype/shape as allocated)

A shadow trainer maps the states while it waits (attach only; it never writes them) and, at
promotion, catches up in one round trip before the same recovery steps::

    c = RmpClient(); w = c.attach("model.params")     # while waiting: the cold attach
    ...promoted...
    c.refresh()                              # only pages changed since then, same addresses
    c.localize(); c.remap(); reconstruct(c)  # faults after the attach are still found here

Calling contract:
* Every call has a timeout (`timeout`, default 60 s) and raises a `protocol.RmpError` subclass:
  `UnknownName`, `SizeMismatch`, `AlreadyExists`, `NotAuthorized`, `Disconnected`, ...
* If the state manager restarts (crash, respawn by the agent), idempotent calls (hello,
  attach, list, localize, clear_marks, status, refresh) reconnect and retry once; the others raise
  `Disconnected` (re-attach and repeat the recovery step: every step is safe to repeat).
* fds are mapped as they arrive and closed at once (GPU pages: in native batches of at most
  `mapping.MAP_BATCH` fds, bounded by RLIMIT_NOFILE).
* `RetainedState.unmap()` waits until no tensor view is alive (or raises `ViewsAlive`); the
  memory itself stays in the pool.  Only `release()` gives it back (when no mapping is left).
* One client per thread at a time (calls are serialized by a lock).
"""
from __future__ import annotations

import threading
import time

from leto_runtime.wire import protocol as P
from leto_runtime.rmp.retained import (GroupInfo, LocalizeReport, Marks,  # noqa: F401 (re-exported)
                                       RefreshReport, RetainedState)

RETRYABLE = frozenset({"hello", "attach", "list", "localize", "clear_marks", "status", "refresh"})
FRESH_FILL = 0xA5          # remapped pages start as this pattern, never as stale or zero data





class RmpClient:
    """A connection to one state manager; see the module docstring."""

    def __init__(self, socket_path: str | None = None, *, timeout: float = P.DEFAULT_CALL_TIMEOUT,
                 connect_timeout: float = 10.0):
        if socket_path is None:
            from leto_runtime.context import Context

            socket_path = Context.from_env().sm_socket
            if not socket_path:
                raise P.Disconnected("no state manager: LETO_SM_SOCKET is not set (not started "
                                     "by leto-run with in-place recovery?)")
        P.raise_nofile_limit()
        self.path, self.timeout, self.connect_timeout = socket_path, timeout, connect_timeout
        self._lock = threading.RLock()
        self._sock = None
        self._id = 0
        self.states: dict[str, RetainedState] = {}
        self.last_remap: list[dict] = []          # what the last remap() replaced
        self._bulletin = None                     # bulletin.Reader once opened; False: none
        self.info = self._call("hello").header

    # ---- transport -----------------------------------------------------------------------
    @property
    def connection(self):
        """The socket of the current connection to the state manager (None when there is
        none: the next call connects); for observing it only -- requests go through the
        methods."""
        return self._sock

    def _connect(self) -> None:
        self._sock = P.connect(self.path, deadline=time.monotonic() + self.connect_timeout)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _call(self, op: str, *, on_fds=None, **args) -> P.Message:
        """One request/reply.  `on_fds(header, fds, offset)` consumes an fd train as it comes."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is not None and P.peer_closed(self._sock):
                        self._drop()             # closed while idle (or stopping): a new one
                    if self._sock is None:
                        self._connect()
                    return self._roundtrip(op, args, on_fds)
                except P.Disconnected as e:
                    self._drop()
                    # NotProcessed: the server closed between requests (Closing) or the request
                    # could not be sent (NotSent) -- it never ran, so any op may be repeated
                    if attempt or not (op in RETRYABLE or isinstance(e, P.NotProcessed)):
                        raise
                except BaseException:
                    self._drop()                 # the stream may be mid-message: start over
                    raise
        raise AssertionError("unreachable")

    def _roundtrip(self, op, args, on_fds) -> P.Message:
        self._id += 1
        deadline = time.monotonic() + self.timeout
        try:
            P.send_message(self._sock, {"op": op, "id": self._id, **args}, deadline=deadline)
        except P.NotSent:
            self._raise_queued_reply()
            raise
        if on_fds is None:
            msg = P.recv_message(self._sock, deadline=deadline)
            P.raise_for_reply(msg.header)
            return msg
        header = None
        for header, fds, offset in P.iter_fd_train(self._sock, deadline=deadline,
                                                   max_fds=1 << 24):
            if offset == 0:
                try:
                    P.raise_for_reply(header)
                except P.RmpError:
                    P.close_fds(fds)
                    raise
            on_fds(header, fds, offset)
        return P.Message(header)

    def _raise_queued_reply(self) -> None:
        """The request could not be sent (EPIPE: the server had closed).  A server that closes
        unasked says why first -- a refusal at connect time (`not_authorized`, `busy`) or
        `closing` between requests -- and that message is still queued on our side of the
        socket: raise it, so the caller sees the reason and not the broken pipe (whether the
        server's close or our send came first is a race on a loaded machine)."""
        try:
            msg = P.recv_message(self._sock, deadline=time.monotonic() + 1.0)
        except P.RmpError:
            return                      # nothing was queued: the NotSent stands
        P.raise_for_reply(msg.header)

    # ---- states ----------------------------------------------------------------------------
    def _device(self) -> str:
        dev = self.info["device"]
        return f"cuda:{dev['ordinal']}" if dev["kind"] == "cuda" else "cpu"

    def _map_reply(self, op: str, into: RetainedState | None = None,
                   **args) -> tuple[RetainedState, dict]:
        """Map the state an allocate/attach reply describes; `into`: re-import into that
        existing mapping (same addresses) when the layout matches."""
        box: dict = {}

        def on_fds(header, fds, offset):
            if offset == 0:
                d, geo = header["state"], self.info["geometry"]
                if into is not None and into._rebind(d, geo):
                    box["st"] = into
                else:
                    box["st"] = RetainedState(d, self._device(), geo)
            box["st"]._map_batch(fds, offset)

        try:
            msg = self._call(op, on_fds=on_fds, **args)
            st = box["st"]
            st._finish_map()
        except BaseException:
            if "st" in box:
                box["st"]._abort()
                if box["st"] is not into:
                    box["st"].unmap(timeout=0)
            raise
        old = self.states.get(st.name)
        self.states[st.name] = st
        if old is not None and old is not st and old.views.alive() == 0:
            old.unmap(timeout=0)
        return st, msg.header

    def allocate(self, name: str, nbytes: int, *, kind: str = "model", protected: bool | None = None,
                 tier: str = "device", dtype: str | None = None, shape=None,
                 exist_ok: bool = False) -> RetainedState:
        """A new retained state (or, with exist_ok, the existing one of the same size and kind)."""
        args = {"name": name, "nbytes": int(nbytes), "kind": kind, "tier": tier,
                "exist_ok": exist_ok, "dtype": dtype,
                "shape": None if shape is None else [int(s) for s in shape]}
        if protected is not None:
            args["protected"] = protected
        return self._map_reply("allocate", **args)[0]

    def retain(self, name: str, nbytes: int, **kw) -> RetainedState:
        """`allocate(..., exist_ok=True)`: the first trainer creates, later ones attach."""
        return self.allocate(name, nbytes, exist_ok=True, **kw)

    def attach(self, name: str, nbytes: int | None = None) -> RetainedState:
        """Map an existing state by its stable name (`UnknownName`, `SizeMismatch`)."""
        return self._map_reply("attach", name=name, nbytes=nbytes)[0]

    def list(self) -> list[dict]:
        return self._call("list").header["states"]

    def loss_count(self) -> int | None:
        """The state manager's loss bulletin (`bulletin.py`): a counter that moves whenever it
        registers a page loss; None where it has none (then ask `status()`)."""
        if self._bulletin is None:
            from leto_runtime.wire import bulletin
            self._bulletin = bulletin.open(bulletin.path_for(self.path)) or False
        return self._bulletin.value() if self._bulletin else None

    def status(self) -> dict:
        return self._call("status").header

    def release(self, name: str) -> int:
        """Drop the state from the pool (local mappings keep their memory until unmapped)."""
        return self._call("release", name=name).header["pages"]

    def clear_marks(self, name: str) -> int:
        n = self._call("clear_marks", name=name).header["cleared"]
        if name in self.states:
            self.states[name].marks = Marks()
        return n

    def inject_pages(self, *, tier: str, count: int = 1, first: int = 0, part: str | None = None,
                     group: int | None = None, state: str | None = None) -> dict:
        """Emulated memory fault (see leto_run/state_manager/pool.py): destroy + make unavailable."""
        return self._call("inject", tier=tier, count=count, first=first, part=part, group=group,
                          state=state).header

    # ---- pre-attached mappings ---------------------------------------------------------------
    def refresh(self, names: list[str] | None = None, *, max_pages: int = 4096) -> RefreshReport:
        """Bring mappings made earlier up to date with the pool, at the same addresses.

        For a shadow that attached while it waited: at promotion, before `localize()`.  One
        round trip asks what changed since each state's `version`; only those pages are
        re-imported in place (a remap gave them fresh memory), and pages the pool no longer
        holds memory for (an emulated GPU retirement) are unmapped here, so the probe in
        `localize()` finds them.  A state re-created under its name, or with more than
        `max_pages` changed pages, is re-attached: every page re-imported, same addresses when
        the layout matches (`reattached`), else a new `RetainedState` (`replaced`: views made
        from the old object are stale).  No GPU work may use the states meanwhile.
        """
        t0 = time.perf_counter()
        targets = [st for n, st in self.states.items()
                   if st.mapped and st.uid is not None and (names is None or n in names)]
        req = [{"name": st.name, "uid": st.uid, "version": st.version} for st in targets]
        box: dict = {"unpinned": []}

        def on_fds(header, fds, offset):
            if offset == 0:
                box["h"] = header
                plan: dict[int, tuple] = {}
                for name, e in header["states"].items():
                    st = self.states.get(name)
                    if st is None or e.get("status") != "changed":
                        continue
                    drops: dict[int, tuple[object, list]] = {}
                    for role, g, i, slot in e["pages"]:
                        m, pos = st._page_pos(role, g, i)
                        if m is st._parity and m.pinned:
                            m.unpin()                  # a registered range cannot change
                            box["unpinned"].append(m)
                        if slot < 0:
                            drops.setdefault(id(m), (m, []))[1].append(pos)
                        else:
                            plan[slot] = (m, pos)
                    for m, pos in drops.values():
                        m.unmap_pages(pos)
                box["plan"] = plan
            by_map: dict[int, tuple[object, list]] = {}
            for j, fd in enumerate(fds):
                t = box["plan"].get(offset + j)
                if t is None:
                    P.close_fds([fd])
                    continue
                by_map.setdefault(id(t[0]), (t[0], []))[1].append((t[1], fd))
            for m, pairs in by_map.values():
                m.replace_pages(pairs)

        try:
            msg = self._call("refresh", on_fds=on_fds, states=req, max_pages=max_pages)
        finally:
            for m in box["unpinned"]:
                m.pin()
        h = box.get("h", msg.header)
        rep = RefreshReport(version=h["version"])
        for name, e in h["states"].items():
            st = self.states.get(name)
            if st is None:
                continue
            status = e.get("status")
            if status in ("same", "changed"):
                st.version = h["version"]
                st.marks = Marks.from_wire(e.get("marks"))
                if status == "same":
                    rep.same.append(name)
                else:
                    rep.changed[name] = sum(1 for p in e["pages"] if p[3] >= 0)
                    nd = sum(1 for p in e["pages"] if p[3] < 0)
                    if nd:
                        rep.dropped[name] = nd
            elif status in ("stale", "recreated"):
                new, _ = self._map_reply("attach", into=st, name=name)
                (rep.reattached if new is st else rep.replaced).append(name)
            elif status == "gone":
                rep.gone.append(name)
        rep.new = [n for n in h.get("names", []) if n not in self.states]
        rep.seconds = time.perf_counter() - t0
        return rep

    # ---- failure handling ------------------------------------------------------------------
    def localize(self) -> LocalizeReport:
        """Probe the device pages mapped here, then let the state manager scan host pages."""
        t0 = time.perf_counter()
        failures, probed = {}, 0
        for st in self.states.values():
            if st.tier == "device" and st.mapped:
                probed += st.n_pages
                bad = st.probe()
                if bad:
                    failures[st.name] = bad
        t1 = time.perf_counter()
        h = self._call("localize", device_failures=failures).header
        marks = {n: Marks.from_wire(m) for n, m in h["marks"].items()}
        for n, st in self.states.items():
            st.marks = marks.get(n, Marks())
        return LocalizeReport(marks, probed, t1 - t0, h["host_pages_scanned"], h["host_scan_s"],
                              time.perf_counter() - t0, float(h.get("commit_s", 0.0)),
                              int(h.get("host_pages_deferred", 0)))

    def remap(self, names: list[str] | None = None) -> list[dict]:
        """Fresh memory behind every failed page; mapped here in place (other pages untouched)."""
        pinned = [st for st in self.states.values() if st._parity is not None and st._parity.pinned]
        for st in pinned:
            st._parity.unpin()                    # a registered range cannot change underneath
        box: dict = {}

        def on_fds(header, fds, offset):
            box["h"] = header
            by_slot = {e["fd"]: e for e in header["replaced"]}
            for j, fd in enumerate(fds):
                e = by_slot.get(offset + j)
                st = self.states.get(e["state"]) if e else None
                if st is None or not st.mapped:
                    P.close_fds([fd])
                    continue
                if e["role"] == "data":
                    st._data.map_page(e["index"], fd)
                    st._data.fill(e["index"], FRESH_FILL)
                else:
                    pos = e["group"] * (st.h1 + st.h2) + e["index"] + (st.h1 if e["role"] == "p2" else 0)
                    st._parity.map_page(pos, fd)
                    st._parity.fill(pos, FRESH_FILL)

        mapped = [{"name": st.name, "uid": st.uid, "version": st.version}
                  for st in self.states.values() if st.mapped and st.uid is not None]
        try:
            msg = self._call("remap", on_fds=on_fds, names=names, mapped=mapped)
        finally:
            for st in pinned:
                st._parity.pin()
        h = box.get("h", msg.header)
        for n, v in (h.get("current") or {}).items():
            if n in self.states:
                self.states[n].version = v          # our mapping is current: refresh skips it
        for n, m in h.get("marks", {}).items():
            if n in self.states:
                self.states[n].marks = Marks.from_wire(m)
        self.last_remap = h["replaced"]
        return h["replaced"]

    def close(self, unmap: bool = True, timeout: float = 10.0) -> None:
        if unmap:
            for st in list(self.states.values()):
                st.unmap(timeout)
        self._drop()

    def __enter__(self) -> "RmpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
