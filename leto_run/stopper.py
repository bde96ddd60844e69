"""Stopping a set of processes and everything they started: SIGTERM -> grace -> SIGKILL.

Why it is thorough: an orphaned grandchild that keeps GPU memory makes the restarted rank fail
to allocate (docs/COMPATIBILITY.md, "Behaviour that differs").  So the stop covers the worker,
its process group, every descendant seen while the worker lived (setsid escapees included), and
every process that carries the job token; and it waits until they are all gone.

Contract: `stop_processes` returns when every process and descendant is dead and reaped, or
after ``grace + kill_wait`` seconds at most.  A second terminating signal arriving on
`escalate_fd` during the grace period skips straight to SIGKILL (a user pressing Ctrl-C twice).
"""
from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable

import psutil

from leto_run.procs import Proc, kill_pids, pids_with_token, reap_orphans


def _alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_processes(procs: list[Proc], *, grace: float, first_signal: int = signal.SIGTERM,
                   token_kv: str | None = None, escalate_fd: int | None = None,
                   log: Callable[[str], None] | None = None, kill_wait: float = 10.0,
                   spare: frozenset[int] = frozenset()) -> None:
    """`spare`: pids that carry the job token but are not part of this stop (the slots'
    state managers, which outlive restarts)."""
    # Signal first, look second: every millisecond before the SIGTERM is a millisecond the
    # survivors spend blocked on a dead peer.  The descendant snapshot right after still sees
    # the tree (a worker needs far longer than that to handle SIGTERM and exit), and anything
    # orphaned in between reparents to us, the subreaper, so nothing is lost.
    for p in procs:
        if p.alive:
            p.send_group(first_signal)
    deadline = time.monotonic() + max(0.0, grace)
    descendants: set[int] = set()
    for p in procs:
        descendants |= p.snapshot_descendants()
    if token_kv:
        descendants |= set(pids_with_token(token_kv))
    descendants -= spare
    known = {p.pid for p in procs} | set(spare)   # never reap a managed child here

    def pending() -> list[Proc]:
        return [p for p in procs if p.poll_exit() is None]

    # Wait (event driven on the pidfds) for the workers themselves.
    while True:
        live = pending()
        if not live:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        fds = [p.pidfd for p in live]
        if escalate_fd is not None:
            fds.append(escalate_fd)
        # poll, not select: the agent's fd keeper holds thousands of page fds, so pidfd
        # numbers exceed select()'s FD_SETSIZE (1024).
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(left * 1000)}
        if escalate_fd is not None and escalate_fd in ready:
            try:
                sigs = os.read(escalate_fd, 512)
            except BlockingIOError:
                sigs = b""
            if any(s in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP) for s in sigs):
                if log:
                    log(f"second termination signal: killing now {list(sigs)}")
                break
    # Then for their descendants, within the same grace period (polling is fine here: this is
    # the shutdown path and the set is small).
    while time.monotonic() < deadline and any(_alive(d) for d in descendants) and not pending():
        time.sleep(0.02)
        reap_orphans(known)
    live = pending()
    stragglers = [d for d in descendants if _alive(d)]
    if token_kv:
        stragglers += [d for d in pids_with_token(token_kv)
                       if d not in stragglers and d not in spare]
    if (live or stragglers) and log:
        log(f"grace period over: SIGKILL to {len(live)} worker(s) and "
            f"{len(stragglers)} descendant(s)")
    for p in procs:
        p.send_group(signal.SIGKILL)
        p.send(signal.SIGKILL)
    kill_pids(stragglers)
    end = time.monotonic() + kill_wait
    while time.monotonic() < end:
        reap_orphans(known)
        if not pending() and not any(_alive(d) for d in descendants | set(stragglers)):
            break
        time.sleep(0.01)
    reap_orphans(known)
