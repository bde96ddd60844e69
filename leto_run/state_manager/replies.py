"""Sending the state manager's replies without holding the pool lock.

Role: a reply may carry thousands of page fds (an fd train, `protocol.send_fd_train`'s format)
and the client may stop reading; the pool lock must not wait for it, yet no fd may be closed
(a concurrent `release`) while the kernel has not taken it.  So each message is offered under
the lock *without waiting* (`Replies.offer`): from the first byte the kernel accepted, it holds
the message's fds.  If it took nothing, the fds are duplicated (counted in `FdBudget`) and the
message is sent after the lock is released, within `Limits.send_stall` seconds, or the
connection is closed.  The common case -- a reader that keeps up -- makes no duplicate.

Later messages of a train look their pages' fds up again, under the lock, just before they go:
a page released or given new memory since the reply was made ends the reply (the connection
closes; the client asks again) rather than send other memory than the reply described.

Calling contract: `offer` runs with the pool lock held, `next` takes it, `deliver` runs
without it.  `WaitFds` (raised by the dispatcher when `offer` finds no room for a read-only op's reply)
means: wait with `FdBudget.wait`, then run the op again.
"""
from __future__ import annotations

import array
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from leto_run.state_manager.budget import FdBudget, dup_all
from leto_runtime.wire import protocol as P

N = P.MAX_FDS_PER_MESSAGE


@dataclass
class Part:
    """One reply message on its way: `sent` bytes of `data` the kernel took (-1: the peer is
    gone); `dups`: duplicates of its fds, to attach if nothing was sent yet."""

    data: bytes
    sent: int = 0
    dups: list[int] = field(default_factory=list)


def plain(reply: dict, rid) -> Part:
    """A reply without fds (errors included), with the request's id."""
    return Part(P.encode({**reply, **({} if rid is None else {"id": rid})}, 0))


class WaitFds(Exception):
    """The request needs `n` fds that replies in flight hold now: wait for them, run again."""

    def __init__(self, n: int):
        super().__init__(n)
        self.n = n


class Replies:
    def __init__(self, pool, budget: FdBudget, send_stall: float,
                 log: Callable[[str], None], warn: Callable[[str], None]):
        self.pool, self.budget, self.send_stall = pool, budget, send_stall
        self.log, self.warn = log, warn          # warn: rate-limited (a flood of dropped peers)
        self.sending = 0                         # messages waiting for their reader now
        self._count = threading.Lock()

    def offer(self, conn, data: bytes, fds: list[int]) -> Part | None:
        """Pool lock held: the message `data` with the pool's `fds`, offered to the socket
        without waiting.  If the kernel took nothing, duplicates are made to send it later
        without the lock (None: the budget has no room for them now)."""
        if not fds:
            return Part(data)
        conn.setblocking(False)
        try:
            sent = conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                          array.array("i", fds))])
        except BlockingIOError:
            sent = 0
        except (BrokenPipeError, ConnectionResetError):
            return Part(data, -1)
        finally:
            conn.setblocking(True)
        if sent:
            return Part(data, sent)
        if not self.budget.take(len(fds)):
            return None
        try:
            return Part(data, 0, dup_all(fds))
        except OSError:
            self.budget.release(len(fds))
            raise

    def deliver(self, conn, part: Part, rest: list[int], version: int) -> bool:
        """Finish sending `part` (its duplicates are given back here), then the messages with
        the fds of the pages `rest`, one at a time; False if the connection must close."""
        seq = 0
        while part is not None:
            try:
                if part.sent < 0 or (part.sent < len(part.data) and not self._send(
                        conn, part.data[part.sent:], part.dups if part.sent == 0 else [])):
                    return False
            finally:
                self.budget.give(part.dups)
            chunk = rest[seq * N:(seq + 1) * N]
            seq += 1
            part = self.next(conn, seq, chunk, version) if chunk else None
            if chunk and part is None:
                return False
        return True

    def next(self, conn, seq: int, pids: list[int], version: int) -> Part | None:
        """Continuation `seq` with the pool's current fds of `pids`, if none changed after
        `version` (None: the reply is abandoned).  Waits, without the lock, for fd room."""
        deadline = time.monotonic() + self.send_stall
        while True:
            with self.pool.lock:
                fds = [self.pool.fds.get(pid) for pid in pids]
                moved = [pid for pid, fd in zip(pids, fds) if fd is None or
                         self.pool.meta.epochs.get(pid, -1) > version]
                if moved:
                    self.log(f"reply abandoned: page {moved[0]} changed while the reply was "
                             "being sent (the client asks again on a new connection)")
                    return None
                try:
                    part = self.offer(conn, P.encode({"cont": seq}, len(fds)), fds)
                except OSError as e:
                    self.log(f"reply abandoned: duplicating its fds failed ({e.strerror})")
                    return None
                if part is not None:
                    return part
            if not self.budget.wait(len(pids), deadline):
                self.log("reply abandoned: no fds free to send it")
                return None

    def _send(self, conn, data: bytes, fds: list[int]) -> bool:
        with self._count:
            self.sending += 1
        try:
            P.send_message(conn, data, fds, deadline=time.monotonic() + self.send_stall)
            return True
        except P.RmpError as e:
            self.warn(f"reply not delivered ({e.message}); connection closed")
            return False
        finally:
            with self._count:
                self.sending -= 1
