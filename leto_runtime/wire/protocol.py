"""The Resilient Memory Pool wire protocol: framing, fd passing, typed errors, peer checks.

Role: the one definition of how a trainer (`leto_runtime.rmp.client`), the state manager
(`leto_run.state_manager.server`) and the agent's fd keeper (`leto_run.state_manager.keeper`)
talk.  It lives in `leto_runtime` because `leto_runtime` never imports `leto_run`.

Framing (AF_UNIX SOCK_STREAM)::

    message  = length (4 bytes, big-endian) + header (UTF-8 JSON object, `length` bytes)
    header   = {"v": VERSION, "nfds": n, ...}      n file descriptors ride on this message
               (SCM_RIGHTS, attached to its first byte, at most 253 = SCM_MAX_FD)

More than 253 fds travel as one *fd train*: the first header says ``"nfds_total": N`` and the
following messages are continuations ``{"v", "cont": i, "nfds"}`` carrying the rest.

Why a stream and not SEQPACKET: a reply may be large (the page table of a 64 GiB state), and a
stream lets the receiver check the length against `MAX_MESSAGE` *before* reading the body.

Calling contract:
* `send_message` / `recv_message` take an absolute `deadline` (time.monotonic()); each blocking
  socket call gets the time left, so nothing blocks past it.  A deadline of None on receive
  means "idle wait": the caller is waiting for the *next* message and polls `idle_check()`
  every `IDLE_POLL` seconds (that is how a server thread notices shutdown); once the first
  byte arrived, the rest must arrive within `MESSAGE_TIMEOUT`.
* Every framing problem raises a `ProtocolError` subclass whose `code` is an `ErrorCode`;
  `desync` says whether the stream position is lost (then the connection must be closed).
  Received fds of a rejected message are closed here, never leaked.
* Replies are ``{"v", "ok": true, ...}`` or ``{"v", "ok": false, "error": {"code", "message"}}``;
  `raise_for_reply` turns the latter into the exception class registered for the code.
* A header is plain data within `header.py`'s limits (nesting, int64, finite numbers); past
  them it is a `BadMessage` that keeps the stream in sync, never an exception of the parser.
* Between requests a server may close a connection (idle, stopping) after one unasked
  ``closing`` error.  `Closing` and `NotSent` (the request could not be sent) are
  `NotProcessed`: the request never ran, any op may be repeated on a new connection.
"""
from __future__ import annotations

import array
import enum
import json
import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from leto_runtime.wire import header as _header

# 1: the first protocol.  2: `refresh` (what changed since a mapping was made), "uid" and
# "version" in attach/allocate/list replies, retired pages marked by localize.
VERSION = 2
MAX_MESSAGE = 4 << 20            # bytes of one JSON header; checked before the body is read
MAX_FDS_PER_MESSAGE = 253        # SCM_MAX_FD: 254 fails with EINVAL (docs/MEMORY.md, "Limits")
MESSAGE_TIMEOUT = 5.0            # a started message must be complete within this
IDLE_POLL = 0.5                  # how often an idle receive re-checks its stop condition
DEFAULT_CALL_TIMEOUT = 60.0      # client: one request/reply round trip
_PREFIX = struct.Struct(">I")
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)

# Request operations of the state manager socket (the keeper has its own, see keeper.py).
OPS = ("hello", "allocate", "attach", "list", "localize", "remap", "clear_marks", "release",
       "inject", "status", "refresh")
KINDS = ("model", "process")      # protected model state / unprotected process state
TIERS = ("device", "host")


# ---- typed errors ------------------------------------------------------------------------
class ErrorCode(str, enum.Enum):
    BAD_MESSAGE = "bad_message"          # not JSON, not an object, missing or mistyped fields
    BAD_VERSION = "bad_version"
    TOO_LARGE = "too_large"
    TRUNCATED = "truncated"              # the peer stopped in the middle of a message
    BAD_FDS = "bad_fds"                  # fd count differs from the header, or CTRUNC
    UNKNOWN_OP = "unknown_op"
    BAD_ARGUMENT = "bad_argument"
    UNKNOWN_NAME = "unknown_name"
    EXISTS = "exists"
    SIZE_MISMATCH = "size_mismatch"
    NOT_AUTHORIZED = "not_authorized"
    FD_LIMIT = "fd_limit"                # the pool would exceed RLIMIT_NOFILE
    OUT_OF_MEMORY = "out_of_memory"
    DEVICE_UNAVAILABLE = "device_unavailable"
    BUSY = "busy"                        # too many connections
    INTERNAL = "internal"
    TIMEOUT = "timeout"                  # client side: no reply in time
    DISCONNECTED = "disconnected"        # client side: the state manager went away
    VIEWS_ALIVE = "views_alive"          # client side: unmap while tensors still exist
    UNRECOVERABLE = "unrecoverable"      # client side: more lost pages than the parity tolerates
    CLOSING = "closing"                  # the server closed the connection between requests


class RmpError(Exception):
    """Base of every typed Resilient Memory Pool error; `code` names it on the wire."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "", details: dict | None = None):
        self.message = message or self.code.value
        self.details = details or {}
        super().__init__(f"[{self.code.value}] {self.message}")

    def to_wire(self) -> dict:
        return {"code": self.code.value, "message": self.message, "details": self.details}


class ProtocolError(RmpError):
    """A framing problem.  `desync`: the stream position is lost; close the connection."""

    desync = False


def _error_class(name: str, code: ErrorCode, base=RmpError, desync: bool = False, doc: str = ""):
    cls = type(name, (base,), {"code": code, "__doc__": doc or code.value})
    if desync:
        cls.desync = True
    return cls


BadMessage = _error_class("BadMessage", ErrorCode.BAD_MESSAGE, ProtocolError)
BadVersion = _error_class("BadVersion", ErrorCode.BAD_VERSION, ProtocolError)
MessageTooLarge = _error_class("MessageTooLarge", ErrorCode.TOO_LARGE, ProtocolError, desync=True)
TruncatedMessage = _error_class("TruncatedMessage", ErrorCode.TRUNCATED, ProtocolError, desync=True)
BadFds = _error_class("BadFds", ErrorCode.BAD_FDS, ProtocolError, desync=True)
UnknownOp = _error_class("UnknownOp", ErrorCode.UNKNOWN_OP)
BadArgument = _error_class("BadArgument", ErrorCode.BAD_ARGUMENT)
UnknownName = _error_class("UnknownName", ErrorCode.UNKNOWN_NAME)
AlreadyExists = _error_class("AlreadyExists", ErrorCode.EXISTS)
SizeMismatch = _error_class("SizeMismatch", ErrorCode.SIZE_MISMATCH)
NotAuthorized = _error_class("NotAuthorized", ErrorCode.NOT_AUTHORIZED)
FdLimit = _error_class("FdLimit", ErrorCode.FD_LIMIT)
BEYOND_HARD_LIMIT = "beyond_hard_limit"     # FdLimit.details: the hard limit is below the need
PoolOutOfMemory = _error_class("PoolOutOfMemory", ErrorCode.OUT_OF_MEMORY)
DeviceUnavailable = _error_class("DeviceUnavailable", ErrorCode.DEVICE_UNAVAILABLE)
Busy = _error_class("Busy", ErrorCode.BUSY)
InternalError = _error_class("InternalError", ErrorCode.INTERNAL)
RmpTimeout = _error_class("RmpTimeout", ErrorCode.TIMEOUT)
Disconnected = _error_class("Disconnected", ErrorCode.DISCONNECTED)
ViewsAlive = _error_class("ViewsAlive", ErrorCode.VIEWS_ALIVE)
NotProcessed = _error_class("NotProcessed", ErrorCode.DISCONNECTED, Disconnected,
                            doc="connection gone, request never ran: safe to repeat any op")
NotSent = _error_class("NotSent", ErrorCode.DISCONNECTED, NotProcessed, doc="peer had closed")
Closing = _error_class("Closing", ErrorCode.CLOSING, NotProcessed, doc="closed between requests")

ERRORS: dict[str, type[RmpError]] = {
    c.code.value: c for c in (BadMessage, BadVersion, MessageTooLarge, TruncatedMessage, BadFds,
                              UnknownOp, BadArgument, UnknownName, AlreadyExists, SizeMismatch,
                              NotAuthorized, FdLimit, PoolOutOfMemory, DeviceUnavailable, Busy,
                              InternalError, RmpTimeout, Disconnected, ViewsAlive, Closing)}


def error_reply(err: RmpError) -> dict:
    return {"ok": False, "error": err.to_wire()}


def raise_for_reply(reply: dict) -> dict:
    """Return `reply` if it is ok; else raise the registered class for its error code."""
    if reply.get("ok") is True:
        return reply
    err = reply.get("error")
    if not isinstance(err, dict):
        raise BadMessage(f"reply is neither ok nor an error: {str(reply)[:200]}")
    cls = ERRORS.get(str(err.get("code")), InternalError)
    details = err.get("details") if isinstance(err.get("details"), dict) else {}
    raise cls(str(err.get("message", "")), details)


# ---- argument checking (servers validate every field; nothing trusts the peer) --------------
_MISSING = object()


def arg(header: dict, key: str, types: type | tuple, *, default: Any = _MISSING,
        check: Callable[[Any], bool] | None = None, what: str = "") -> Any:
    """header[key] checked against `types` (bool is never an int here) and `check`."""
    v = header.get(key, _MISSING)
    if v is _MISSING or (v is None and default is not _MISSING):
        if default is _MISSING:
            raise BadArgument(f"missing field {key!r}")
        return default
    tt = types if isinstance(types, tuple) else (types,)
    if isinstance(v, bool) and bool not in tt:
        raise BadArgument(f"{key}={v!r} must be {what or '/'.join(t.__name__ for t in tt)}")
    if not isinstance(v, tt) or (check is not None and not check(v)):
        raise BadArgument(f"{key}={str(v)[:80]!r} must be {what or '/'.join(t.__name__ for t in tt)}")
    return v


# ---- fds -----------------------------------------------------------------------------------
def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _fds_from_ancdata(ancdata) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return fds


@dataclass
class Message:
    header: dict
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        close_fds(self.fds)
        self.fds = []


# ---- send ----------------------------------------------------------------------------------
def _left(deadline: float) -> float:
    t = deadline - time.monotonic()
    if t <= 0:
        raise RmpTimeout("deadline passed while sending or receiving")
    return t


def encode(header: dict, nfds: int) -> bytes:
    """The framed bytes of `header` announcing `nfds` fds (`MessageTooLarge` past MAX_MESSAGE)."""
    body = json.dumps({**header, "v": VERSION, "nfds": nfds}, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise MessageTooLarge(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return _PREFIX.pack(len(body)) + body


def send_message(sock: socket.socket, header: dict | bytes, fds: Sequence[int] = (), *,
                 deadline: float) -> None:
    """One framed message (`header`, or its `encode`d bytes) with at most 253 fds (which stay
    open: the caller owns them).  A peer that had closed the connection raises `NotSent`: the
    message did not arrive whole, and an incomplete one is never acted on."""
    if len(fds) > MAX_FDS_PER_MESSAGE:
        raise BadFds(f"{len(fds)} fds in one message (at most {MAX_FDS_PER_MESSAGE})")
    data = header if isinstance(header, bytes) else encode(header, len(fds))
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        sock.settimeout(_left(deadline))
        sent = sock.sendmsg([data], anc)
        view = memoryview(data)[sent:]
        while view:
            sock.settimeout(_left(deadline))
            n = sock.send(view)
            view = view[n:]
    except socket.timeout:
        raise RmpTimeout("peer did not accept the message in time") from None
    except (BrokenPipeError, ConnectionResetError) as e:
        raise NotSent(f"peer closed the connection ({e.strerror})") from None


def send_fd_train(sock: socket.socket, header: dict, fds: Sequence[int], *,
                  deadline: float) -> None:
    """`header` plus any number of fds: the first 253 ride on it, the rest on continuations."""
    fds = list(fds)
    first = fds[:MAX_FDS_PER_MESSAGE]
    send_message(sock, {**header, "nfds_total": len(fds)}, first, deadline=deadline)
    for i, start in enumerate(range(MAX_FDS_PER_MESSAGE, len(fds), MAX_FDS_PER_MESSAGE), 1):
        send_message(sock, {"cont": i}, fds[start:start + MAX_FDS_PER_MESSAGE], deadline=deadline)


# ---- receive -------------------------------------------------------------------------------
def _wait_readable(sock: socket.socket, idle_check: Callable[[], bool] | None) -> None:
    """Idle wait for the first byte of the next message, polling the stop condition."""
    # poll, not select: a state manager holds thousands of page fds, so connection fds are
    # above select()'s FD_SETSIZE (1024).
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        if poller.poll(IDLE_POLL * 1000):
            return
        if idle_check is not None and idle_check():
            raise Disconnected("stopped while idle")


def recv_message(sock: socket.socket, *, deadline: float | None, max_fds: int = 0,
                 idle_check: Callable[[], bool] | None = None) -> Message:
    """Read one framed message; returns its header and fds (len(fds) == header["nfds"])."""
    if deadline is None:
        _wait_readable(sock, idle_check)
        deadline = time.monotonic() + MESSAGE_TIMEOUT
    fds: list[int] = []
    try:
        prefix = _recv_exact(sock, _PREFIX.size, deadline, fds, first=True)
        (length,) = _PREFIX.unpack(prefix)
        if length > MAX_MESSAGE:
            raise MessageTooLarge(f"declared length {length} exceeds {MAX_MESSAGE}")
        if length == 0:
            raise BadMessage("empty message")
        body = _recv_exact(sock, length, deadline, fds, first=False)
        if len(fds) > max_fds:
            err = BadFds(f"{len(fds)} fds received, at most {max_fds} accepted here")
            err.desync = False          # the whole message was read: the stream is in sync
            raise err
        try:
            header = _header.loads(body)
        except _header.HeaderRefused as e:
            raise BadMessage(f"header refused: {e}") from None
        if not isinstance(header, dict):
            raise BadMessage(f"header is a JSON {type(header).__name__}, not an object")
        if header.get("v") != VERSION:
            raise BadVersion(f"protocol version {header.get('v')!r}, this side speaks {VERSION}")
        if header.get("nfds", 0) != len(fds):
            err = BadFds(f"header says nfds={header.get('nfds')!r}, {len(fds)} fds arrived")
            err.desync = False          # the stream itself is intact
            raise err
        return Message(header, fds)
    except BaseException:
        close_fds(fds)
        raise


def recv_fd_train(sock: socket.socket, *, deadline: float | None, max_fds: int,
                  idle_check: Callable[[], bool] | None = None) -> Message:
    """Inverse of `send_fd_train`: one header and all of its fds (bounded by `max_fds`)."""
    msg = recv_message(sock, deadline=deadline, max_fds=min(max_fds, MAX_FDS_PER_MESSAGE),
                       idle_check=idle_check)
    try:
        total = msg.header.get("nfds_total", len(msg.fds))
        if isinstance(total, bool) or not isinstance(total, int) or total < len(msg.fds):
            raise BadFds(f"nfds_total={total!r} is not a count >= {len(msg.fds)}")
        if total > max_fds:
            e = BadFds(f"{total} fds announced, at most {max_fds} accepted")
            e.desync = total > len(msg.fds)
            raise e
        if total > len(msg.fds) and len(msg.fds) != MAX_FDS_PER_MESSAGE:
            raise BadFds("an fd train must fill its first message")
        end = time.monotonic() + MESSAGE_TIMEOUT if deadline is None else deadline
        seq = 1
        while len(msg.fds) < total:
            cont = recv_message(sock, deadline=end, max_fds=MAX_FDS_PER_MESSAGE)
            msg.fds.extend(cont.fds)
            if cont.header.get("cont") != seq:
                raise BadFds(f"continuation {cont.header.get('cont')!r} out of order (want {seq})")
            seq += 1
        if len(msg.fds) != total:
            raise BadFds(f"fd train carried {len(msg.fds)} fds, announced {total}")
        return msg
    except BaseException:
        msg.close_fds()
        raise


def iter_fd_train(sock: socket.socket, *, deadline: float, max_fds: int):
    """Like `recv_fd_train`, but yields (header, fds, offset) per message as it arrives.

    The consumer owns (and must close or map) each batch; at most 253 fds are open at a time,
    so a receiver can take a 32,768-page state under a small RLIMIT_NOFILE.  If the consumer
    stops early the stream is desynchronized: close the connection.
    """
    msg = recv_message(sock, deadline=deadline, max_fds=MAX_FDS_PER_MESSAGE)
    header = msg.header
    total = header.get("nfds_total", len(msg.fds))
    if isinstance(total, bool) or not isinstance(total, int) or total < len(msg.fds) \
            or total > max_fds or (total > len(msg.fds) != MAX_FDS_PER_MESSAGE):
        msg.close_fds()
        raise BadFds(f"nfds_total={total!r} with {len(msg.fds)} fds (at most {max_fds} accepted)")
    got, seq = len(msg.fds), 1
    yield header, msg.fds, 0
    while got < total:
        cont = recv_message(sock, deadline=deadline, max_fds=MAX_FDS_PER_MESSAGE)
        if cont.header.get("cont") != seq or got + len(cont.fds) > total or not cont.fds:
            cont.close_fds()
            raise BadFds(f"continuation {cont.header.get('cont')!r} out of order or overfull")
        yield header, cont.fds, got
        got += len(cont.fds)
        seq += 1


def _recv_exact(sock: socket.socket, n: int, deadline: float, fds: list[int],
                first: bool) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            sock.settimeout(_left(deadline))
            k, anc, flags, _ = sock.recvmsg_into([view[got:]], _ANC_SPACE,
                                                 socket.MSG_CMSG_CLOEXEC)
        except (socket.timeout, RmpTimeout):
            if first and got == 0:
                raise RmpTimeout("no message arrived in time") from None
            raise TruncatedMessage(f"message stopped after {got} of {n} bytes") from None
        except (ConnectionResetError, BrokenPipeError):
            k, anc, flags = 0, [], 0
        new = _fds_from_ancdata(anc)
        fds.extend(new)
        if flags & socket.MSG_CTRUNC:
            raise BadFds("control data truncated (too many fds, or the receiver's fd limit)")
        if new and not (first and got == 0):
            raise BadFds("fds attached to the middle of a message")
        if k == 0:
            if first and got == 0:
                raise Disconnected("peer closed the connection")
            raise TruncatedMessage(f"peer closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def peer_closed(sock: socket.socket) -> bool:
    """Whether an idle connection can no longer carry a request: the peer closed it, or sent
    its `closing` message (a server sends nothing else unasked).  One poll, no wait."""
    p = select.poll()
    p.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(p.poll(0))


# ---- peers and sockets ---------------------------------------------------------------------
@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """SO_PEERCRED: the credentials the peer had when it called connect()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return PeerCred(*struct.unpack("3i", raw))


def bind_private(path: str, backlog: int = 64) -> socket.socket:
    """A listening AF_UNIX stream socket whose file is 0600 from the moment it exists."""
    try:
        os.unlink(path)                      # a stale socket of a crashed predecessor
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)                    # no window in which the socket is group/world-open
    try:
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(backlog)
    return s


def connect(path: str, *, deadline: float) -> socket.socket:
    """Connect, retrying while the socket does not exist yet or refuses (server restarting)."""
    delay = 0.005
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(max(0.01, min(1.0, deadline - time.monotonic())))
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError, socket.timeout) as e:
            s.close()
            if time.monotonic() + delay >= deadline:
                raise Disconnected(f"cannot connect to {path}: {e}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        except BaseException:
            s.close()
            raise


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (each page is one fd); return (soft, hard).

    The hard limit is left alone (raising it needs privileges and is the operator's call:
    `check_nofile` names the fix).  Why: SCM_RIGHTS silently drops fds beyond the limit
    (unix(7)); a pool of 64 GiB in 2 MiB pages is 32,768 fds here and in the agent's keeper."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft, hard


def nofile_fix(need: int, hard: int, who: str = "this process") -> str:
    """How to give `who` `need` fds when the hard RLIMIT_NOFILE (`hard`) is below that."""
    return (f"{who} needs about {need} open files but the hard RLIMIT_NOFILE is {hard} (every "
            f"retained page is one fd); raise the hard limit before starting leto-run "
            f"(`ulimit -Hn {need}` as root, `docker run --ulimit nofile={need}:{need}`, systemd "
            f"`LimitNOFILE={need}`, or the `nofile` line in /etc/security/limits.conf), or use "
            f"larger pages (recovery.page_bytes / --page-bytes: twice the page size halves the "
            f"fds)")


def check_nofile(need: int, who: str = "this process") -> tuple[int, int]:
    """Make room for `need` open files (soft limit raised to the hard one); raise `FdLimit`
    naming the fix when the hard limit is below `need`.  Returns (soft, hard)."""
    soft, hard = raise_nofile_limit()
    if need > soft:
        raise FdLimit(nofile_fix(need, hard, who), {"need": need, "soft": soft, "hard": hard,
                                                    BEYOND_HARD_LIMIT: True})
    return soft, hard
