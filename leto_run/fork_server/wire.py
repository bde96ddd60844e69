"""Framed JSON messages with file descriptors over the agent's socket pair with its fork server.

A frame: 4 bytes of big-endian length (the descriptors ride on them, SCM_RIGHTS), then that
many bytes of JSON.  Both ends are this package's, on a socket pair nobody else holds; the
bounds still hold a broken peer to a clear error instead of a huge allocation.

Contract: `send(sock, obj, fds)`; `recv(sock)` -> (obj, fds), or None at EOF; both raise
`OSError` (a timeout included: the caller sets it on the socket) or `ValueError` (a bad frame).
"""
from __future__ import annotations

import json
import os
import socket
import struct

MAX_FRAME = 16 << 20
MAX_FDS = 16


def send(sock: socket.socket, obj, fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"a fork-server message of {len(body)} bytes exceeds {MAX_FRAME}")
    head = struct.pack(">I", len(body))
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(body)


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = sock.recv(min(n - got, 1 << 20))
        if not b:
            raise ValueError("the fork-server peer closed the socket mid-message")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def recv(sock: socket.socket):
    head, fds, _, _ = socket.recv_fds(sock, 4, MAX_FDS)
    if not head:
        for fd in fds:
            os.close(fd)
        return None
    try:
        if len(head) < 4:
            head += _exactly(sock, 4 - len(head))
        (n,) = struct.unpack(">I", head)
        if n > MAX_FRAME:
            raise ValueError(f"a fork-server message of {n} bytes exceeds {MAX_FRAME}")
        return json.loads(_exactly(sock, n)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
