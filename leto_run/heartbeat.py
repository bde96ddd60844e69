"""The agent's end of the heartbeat channel: an AF_UNIX datagram socket in the private run dir.

Trainers (through `leto_runtime.heartbeat`) send one small JSON datagram per step.  The kernel
attaches the sender's credentials (SO_PASSCRED), so a datagram is only accepted from a pid the
agent started in this generation and from our own uid; anything else — wrong uid, unknown pid,
oversized, not JSON, wrong version — is counted and dropped, never trusted.

Contract: `HeartbeatServer.fileno()` goes into the agent's selector; when readable, `drain()`
returns the accepted `Beat`s.  Nothing here blocks.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import dataclass

from leto_runtime.wire import contract as C

_UCRED = struct.Struct("3i")
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

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self, known_pids: set[int]) -> list[Beat]:
        beats: list[Beat] = []
        while True:
            try:
                data, anc, flags, _ = self._sock.recvmsg(
                    C.HEARTBEAT_MAX_BYTES + 1, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                break
            now = time.monotonic()
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
            return Beat(kind=kind, pid=pid, rank=int(msg.get("rank", -1)),
                        role=str(msg.get("role", "")), generation=int(msg.get("gen", -1)),
                        step=None if step is None else int(step),
                        detail=None if detail is None else str(detail)[:2048], mono=now)
        except (ValueError, TypeError):
            return None

    def close(self) -> None:
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
