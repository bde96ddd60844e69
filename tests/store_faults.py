"""Network faults between TCPStore clients and a real TCPStore server, on cue (test helper).

`StoreProxy(port)` listens on a port of its own and forwards every connection to the server;
two one-shot faults are armed by the bytes a client sends:

- `hold(marker, seconds)`: after forwarding the client chunk that contains `marker`, stop
  reading from that client for `seconds` -- a large value being sent blocks in the client (its
  socket buffers fill), as against a slow or briefly stalled store;
- `sever(marker)`: forward the chunk that contains `marker` to the server, drop the server's
  reply, and close the client's connection -- the request was carried out, its answer is lost.

`StoreServer()` runs a TCPStore server in a process of its own (`stop()`/`cont()` SIGSTOP and
SIGCONT it: a store that hangs; `kill()`).  `connect(port, timeout_s)`: a client as the
checkpoint handshake has one (an AuthStore with the tests' job key)."""
from __future__ import annotations

import datetime
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

KEY = bytes(range(32))
_SERVER = ("import sys, time, datetime, torch.distributed as dist\n"
           "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False,\n"
           "                  timeout=datetime.timedelta(seconds=30))\n"
           "print(s.port, flush=True)\n"
           "time.sleep(600)\n")


def connect(port: int, timeout_s: float = 2.0):
    import torch.distributed as dist
    from leto_runtime.auth_store import AuthStore
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    return AuthStore(raw, KEY)


class StoreServer:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE,
                                     text=True)
        self.port = int(self.proc.stdout.readline())

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class StoreProxy:
    def __init__(self, target_port: int):
        self.target = target_port
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)   # fills fast
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.faults: dict[str, tuple[bytes, float]] = {}
        self.fired: list[str] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, marker: bytes, seconds: float) -> None:
        with self.lock:
            self.faults["hold"] = (marker, seconds)

    def sever(self, marker: bytes) -> None:
        with self.lock:
            self.faults["sever"] = (marker, 0.0)

    def close(self) -> None:
        self.closed = True
        self.lsock.close()

    def _take(self, seen: bytes) -> tuple[str, float] | None:
        with self.lock:
            for kind, (marker, seconds) in list(self.faults.items()):
                if marker in seen:
                    del self.faults[kind]
                    self.fired.append(kind)
                    return kind, seconds
        return None

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            conn = {"mute": False}
            threading.Thread(target=self._up, args=(client, server, conn), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, conn), daemon=True).start()

    def _up(self, client, server, conn) -> None:
        """Client -> server, with the faults."""
        tail = b""
        try:
            while True:
                chunk = client.recv(1 << 16)
                if not chunk:
                    break
                fault = self._take(tail + chunk)        # (a marker split between chunks)
                tail = chunk[-64:]
                if fault and fault[0] == "sever":
                    conn["mute"] = True
                server.sendall(chunk)
                if fault and fault[0] == "sever":
                    time.sleep(0.3)             # the server carries it out; its reply is dropped
                    break
                if fault and fault[0] == "hold":
                    time.sleep(fault[1])
        except OSError:
            pass
        _close(client, server)

    def _down(self, server, client, conn) -> None:
        try:
            while True:
                r, _, _ = select.select([server], [], [], 1.0)
                if not r:
                    continue
                chunk = server.recv(1 << 16)
                if not chunk:
                    break
                if not conn["mute"]:
                    client.sendall(chunk)
        except (OSError, ValueError):
            pass
        _close(client, server)


def _close(*socks) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
