"""The agent's end of the heartbeat channel: an AF_UNIX datagram socket in the private run dir.

Trainers (through `leto_runtime.heartbeat`) send one small JSON datagram per step.  The kernel
attaches the sender's credentials (SO_PASSCRED), so a datagram is only accepted from a pid the
agent started in this generation and from our own uid; anything else — wrong uid, unknown pid,
oversized, not JSON, wrong version — is counted and dropped, never trusted.

A reader thread moves datagrams out of the kernel's queue as they arrive.  That queue holds
only net.unix.max_dgram_qlen (often 10) datagrams, and a trainer's control datagram waits
(bounded) for room in it: while the agent's control loop was busy in a recovery (deciding,
spawning the replacement shadows), a promoted trainer's phase reports waited for it -- 41 ms
of a CPU recovery's critical path, between its wake and its first step.  The thread only
reads (no parsing, no agent state); `drain()` parses in the control loop, in arrival order.

Contract: `HeartbeatServer.fileno()` goes into the agent's selector; when readable, `drain()`
returns the accepted `Beat`s (`Beat.mono`: when the datagram was read).  Nothing here blocks;
`close()` stops the thread.
"""
from __future__ import annotations

import json
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

from leto_runtime.wire import contract as C

_UCRED = struct.Struct("3i")
READ_POLL_MS = 200          # the reader thread checks for close() this often
MAX_PENDING = 65536         # datagrams read and not yet drained; beyond, new ones are dropped
# Datagram kinds (leto_runtime.wire.contract, "Heartbeat datagram"); anything else is dropped.
KINDS = frozenset({"beat", "register", "inject", "unfired", "bye", "inplace", "promoted",
                   "phase", "demoted", "forged", "reclaim"})


@dataclass(frozen=True)
class Beat:
    kind: str            # one of KINDS
    pid: int             # from the kernel, not from the payload
    rank: int
    role: str
    generation: int
    step: int | None
    detail: str | None
    mono: float
    sent: float | None = None   # the sender's CLOCK_MONOTONIC when it sent it, if plausible


class HeartbeatServer:
    def __init__(self, path: str):
        self.path = path
        self.rejected = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        old = os.umask(0o177)          # socket file 0600: only our uid may even connect
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.setblocking(False)
        self._uid = os.getuid()
        self.dropped = 0                    # read but over MAX_PENDING: never parsed
        self._pending: deque = deque()      # (data, anc, flags, mono), arrival order
        self._lock = threading.Lock()       # the socket's reads and `_pending` (no blocking call)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="leto-heartbeat-reader",
                                        daemon=True)
        self._reader.start()

    def fileno(self) -> int:
        """Readable when datagrams wait for `drain()`."""
        return self._wake_r

    def _read_available(self) -> int:
        """Move every datagram the kernel holds into `_pending` (caller holds `_lock`)."""
        n = 0
        while True:
            try:
                data, anc, flags, _ = self._sock.recvmsg(
                    C.HEARTBEAT_MAX_BYTES + 1, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return n
            except OSError:             # closed under us
                return n
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                continue
            self._pending.append((data, anc, flags, time.monotonic()))
            n += 1

    def _read_loop(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(READ_POLL_MS):
                    continue
            except (OSError, ValueError):
                return
            with self._lock:
                n = self._read_available()
            if n:
                try:
                    os.write(self._wake_w, b"!")
                except (BlockingIOError, OSError):
                    pass                # a wake-up is pending already (or we are closing)

    def drain(self, known_pids: set[int]) -> list[Beat]:
        with self._lock:
            self._read_available()      # what arrived since the thread last looked, after it
            got, self._pending = self._pending, deque()
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        beats: list[Beat] = []
        for data, anc, flags, now in got:
            pid = uid = None
            for level, ctype, cdata in anc:
                if level == socket.SOL_SOCKET and ctype == socket.SCM_CREDENTIALS:
                    pid, uid, _gid = _UCRED.unpack(cdata[:_UCRED.size])
            beat = self._parse(data, flags, pid, uid, known_pids, now)
            if beat is None:
                self.rejected += 1
            else:
                beats.append(beat)
        return beats

    def _parse(self, data, flags, pid, uid, known_pids, now) -> Beat | None:
        if pid is None or uid != self._uid or pid not in known_pids:
            return None
        if len(data) > C.HEARTBEAT_MAX_BYTES or flags & socket.MSG_TRUNC:
            return None
        try:
            msg = json.loads(data)
            if not isinstance(msg, dict) or msg.get("v") != C.HEARTBEAT_VERSION:
                return None
            kind = msg.get("kind", "beat")
            if kind not in KINDS:
                return None
            step = msg.get("step")
            detail = msg.get("detail")
            sent = msg.get("t")
            # Plausible: not after its arrival, not long before (one machine, one clock).
            sent = float(sent) if isinstance(sent, (int, float)) and now - 60.0 <= sent <= now else None
            return Beat(kind=kind, pid=pid, rank=int(msg.get("rank", -1)),
                        role=str(msg.get("role", "")), generation=int(msg.get("gen", -1)),
                        step=None if step is None else int(step),
                        detail=None if detail is None else str(detail)[:2048], mono=now, sent=sent)
        except (ValueError, TypeError):
            return None

    def close(self) -> None:
        self._stop.set()
        self._reader.join(timeout=2 * READ_POLL_MS / 1000 + 1.0)
        with self._lock:
            self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
