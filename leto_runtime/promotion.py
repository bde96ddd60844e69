"""The trainer's side of the in-place recovery protocol (DESIGN.md §3; keys and datagrams in
`leto_runtime.contract`, "In-place recovery protocol" and "Heartbeat datagram").

Role: small, stateless helpers that `leto_runtime.init()` / `job.steps()` (or a test script)
call in this order:

    ctx = Context.from_env()
    store = worker_store(ctx)                         # the job's worker TCPStore (a client)
    announce_inplace()                                # active: "my slot runs in place"
    ... shadow: form the process group of generation ctx.generation over
        PrefixStore(contract.pg_prefix(ctx.generation, ctx.shadow_epoch), store)  (level L3) ...
    announce_inplace({"level": "L3", "seconds": s})   # shadow: ready at its preinit level
    t = wait_for_promotion(ctx, store)                # shadow: blocks until the agent says go
    ... attach, localize, reconstruct, agree, finish/redo ...
    report_phase("attach", seconds, pages=n)          # one datagram per recovery phase

Calling contract: every blocking call has a timeout: the store client's (ctx.pg_timeout) for
connecting, and `wait_for_promotion` checks the store (non-blocking) at least every
WAKE_POLL_S and at once on the agent's PROMOTE_SIGNAL (`install_wake()` first), until the agent
sets `go_key(generation, rank)`, which it does only after every older process of this rank is
gone.  It waits as long as the
shadow is not needed; the agent kills the shadow when the job ends or restarts.  A store that
goes away (the job restarted) raises `torch.distributed.DistNetworkError`.  Datagrams never block
and are dropped silently outside Leto.
"""
from __future__ import annotations

import datetime
import importlib
import json
import signal
import threading
import time

import torch.distributed as dist

from leto_runtime import contract as C
from leto_runtime.context import Context

# The module, not the package's `heartbeat` function of the same name.
heartbeat = importlib.import_module("leto_runtime.heartbeat")


def worker_store(ctx: Context, timeout: float | None = None) -> "dist.TCPStore":
    """A client of the job's worker store (MASTER_ADDR/MASTER_PORT), `ctx.pg_timeout` bounded."""
    if not ctx.master_addr or not ctx.master_port:
        raise RuntimeError("MASTER_ADDR/MASTER_PORT are not set: not started by leto-run or "
                           "torchrun")
    t = datetime.timedelta(seconds=float(timeout if timeout is not None else ctx.pg_timeout))
    return dist.TCPStore(ctx.master_addr, int(ctx.master_port), is_master=False, timeout=t,
                         wait_for_workers=False)


def announce_inplace(detail: dict | None = None) -> None:
    """Datagram `inplace`: this slot runs in place (active), or this shadow reached its preinit
    level (detail {"level": "L3", "seconds": preinit seconds})."""
    if detail is not None and _wake_installed:
        detail = {**detail, "wake": True}
    heartbeat.send("inplace", None, None if detail is None else json.dumps(detail))


_woken = threading.Event()
_wake_installed = False
WAKE_POLL_S = 0.5          # the store is checked at least this often (the signal is the fast path)


def install_wake() -> None:
    """Shadow, before it announces readiness: the agent's PROMOTE_SIGNAL ends a wait at once.
    The readiness datagram then says so ("wake": true); the agent signals only such shadows
    (the signal's default action would end any other process)."""
    global _wake_installed
    signal.signal(C.PROMOTE_SIGNAL, lambda signum, frame: _woken.set())
    _wake_installed = True


def wait_for_promotion(ctx: Context, store, slice_s: float = WAKE_POLL_S) -> float:
    """Block until the agent promotes this shadow (go key of its generation and rank is set);
    return the monotonic wake time, after sending the `promoted` datagram.

    Why not `store.wait`: a TCPStore client whose wait timed out can miss the key set after
    (seen: a shadow woke 152 s after its go key, through two 60 s slices).  Non-blocking checks
    cannot; the agent's PROMOTE_SIGNAL makes them immediate, and the slow poll is the safety
    net (a few requests a second per shadow, never a burst on the store)."""
    key = C.go_key(ctx.generation, ctx.rank)
    while True:
        if store.check([key]):      # DistNetworkError: the store is gone (restart or end)
            break
        _woken.wait(slice_s)
        _woken.clear()
    woke = time.monotonic()
    heartbeat.send("promoted", None, json.dumps({"mono": woke}))
    return woke


def report_phase(name: str, seconds: float, **fields) -> None:
    """Datagram `phase`: recovery phase `name` (attach | localize | reconstruct | agree | finish
    | resume) took `seconds`; extra JSON-able fields (resume="finish"|"redo", step, pages...)."""
    detail = {"phase": name, "seconds": float(seconds), **fields}
    heartbeat.send("phase", None, json.dumps(detail, default=str))
