"""The trainer's side of the in-place recovery protocol (docs/ARCHITECTURE.md; keys and datagrams
in `leto_runtime.wire.contract`, "In-place recovery protocol" and "Heartbeat datagram").

Role: small, stateless helpers that `leto_runtime.init()` / `job.steps()` (or a test script)
call in this order:

    ctx = Context.from_env()
    store = worker_store(ctx)                         # the job's worker store (an AuthStore)
    announce_inplace()                                # active: "my slot runs in place"
    ... shadow at L3: form the process group of generation ctx.generation over
        PrefixStore(contract.pg_prefix(ctx.generation, ctx.shadow_epoch), store), the script's
        set-up, pre-attach (below L3 none of it: leto_runtime.levels) ...
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

Authentication (`leto_runtime.auth_store`): `worker_store` is an `AuthStore` with the job's key
(LETO_JOB_KEY), so every value this process reads there -- the go key, the keys its process
group is formed through -- verified, or was refused.  A refused value is reported to the agent
once per key (datagram `forged`; the agent stops the job).  `wait_for_promotion` then keeps
waiting: it acts only on a go key that verifies (the agent's own set overwrites a forged one),
and a shadow that exited instead would be restarted and meet the same value again.  A
process-group key that does not verify fails the group's formation (`ForgedControlKey` out of
`init_process_group`): torch cannot be told to wait for a second value.
"""
from __future__ import annotations

import datetime
import json
import signal
import sys
import threading
import time

import torch.distributed as dist

from leto_runtime import beats
from leto_runtime.wire import contract as C
from leto_runtime.auth_store import AuthStore
from leto_runtime.context import Context
from leto_runtime.control_auth import ForgedControlKey, mac_words, verify_words


def worker_store(ctx: Context, timeout: float | None = None) -> AuthStore:
    """A client of the job's worker store (MASTER_ADDR/MASTER_PORT), `ctx.pg_timeout` bounded,
    verifying every value with the job's key."""
    if not ctx.master_addr or not ctx.master_port:
        raise RuntimeError("MASTER_ADDR/MASTER_PORT are not set: not started by leto-run or "
                           "torchrun")
    if ctx.job_key is None:
        raise RuntimeError(f"{C.LETO_JOB_KEY} is not set, so the job's store cannot be "
                           "authenticated: start the trainer with leto-run --recovery inplace "
                           "of the same Leto version")
    t = datetime.timedelta(seconds=float(timeout if timeout is not None else ctx.pg_timeout))
    raw = dist.TCPStore(ctx.master_addr, int(ctx.master_port), is_master=False, timeout=t,
                        wait_for_workers=False)
    return AuthStore(raw, ctx.job_key, on_forged=report_forged)


_reported: set[str] = set()


def report_forged(key: str, reason: str) -> None:
    """A value under `key` did not verify: tell the agent (datagram `forged`) and this rank's
    log, once per key."""
    if key in _reported:
        return
    _reported.add(key)
    sys.stderr.write(f"[leto_runtime] refused the value under {key!r} in the job's store: "
                     f"{reason}\n")
    sys.stderr.flush()
    beats.send("forged", None, json.dumps({"key": key, "reason": reason}))


def announce_inplace(detail: dict | None = None) -> None:
    """Datagram `inplace`: this slot runs in place (active; detail None or {"uuid": its CUDA
    device's}), or this shadow reached its preinit level (detail {"level": "L3", "seconds":
    preinit seconds})."""
    if detail is not None and _wake_installed:
        detail = {**detail, "wake": True}
    beats.send("inplace", None, None if detail is None else json.dumps(detail))


def announce_active(device) -> None:
    """An active's `inplace` datagram, with its CUDA device's UUID as NVML spells it
    ("GPU-..."): the agent observes the device by it (CUDA's ordinals follow
    CUDA_DEVICE_ORDER, fastest first by default, where NVML counts in PCI order)."""
    uuid = None
    if device.type == "cuda":
        import torch
        try:
            uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        except (RuntimeError, AttributeError):
            pass
    announce_inplace(None if uuid is None else {"uuid": uuid})


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


def wait_for_promotion(ctx: Context, store, slice_s: float = WAKE_POLL_S,
                       until=None) -> float | None:
    """Block until the agent promotes this shadow (go key of its generation and rank is set);
    return the monotonic wake time, after sending the `promoted` datagram.  `until`: a
    predicate checked once per slice after the go key; when it is true the wait ends
    without a promotion and returns None (the shadow has work to do while it waits, and
    waits again).

    Why not `store.wait`: a TCPStore client whose wait timed out can miss the key set after
    (seen: a shadow woke 152 s after its go key, through two 60 s slices).  Non-blocking checks
    cannot; the agent's PROMOTE_SIGNAL makes them immediate, and the slow poll is the safety
    net (a few requests a second per shadow, never a burst on the store).

    Only a go key that verifies wakes it (module docstring); `store` is `worker_store(ctx)`."""
    if not isinstance(store, AuthStore):
        raise TypeError("wait_for_promotion(ctx, store): store must be worker_store(ctx), "
                        "which verifies the go key")
    from leto_runtime import ctx_limits
    key = C.go_key(ctx.generation, ctx.rank)
    waited = False
    try:
        while True:
            # DistNetworkError: the store is gone (restart or end)
            if store.check([key]) and _verified(store, key):
                break
            if until is not None and until():
                return None
            if not waited:              # a smaller context while it waits (L2 and L3)
                ctx_limits.shrink()
                waited = True
            _woken.wait(slice_s)
            _woken.clear()
    finally:
        ctx_limits.restore()            # the driver's default again, before its first kernel
    woke = time.monotonic()
    beats.send("promoted", None, json.dumps({"mono": woke}))
    return woke


def _verified(store: AuthStore, key: str) -> bool:
    try:
        store.get(key)
        return True
    except ForgedControlKey:
        return False        # reported (report_forged); the agent's set overwrites it


def _agree_name(ctx: Context, rank: int) -> str:
    return f"leto/agree/{ctx.generation}/{ctx.shadow_epoch}/{rank}"


def seal_progress(ctx: Context, words: list[int]) -> list[int]:
    """This rank's agreement values (`resume.gather`) followed by their MAC (four int64)."""
    return list(words) + mac_words(ctx.job_key, _agree_name(ctx, ctx.rank), words)


def open_progress(ctx: Context, rows: list[list[int]]) -> list[list[int]]:
    """Every rank's values of the all-gather, each checked against its MAC under its own rank
    (so no row reads as another rank's or another generation's); a row that does not verify
    is reported (`report_forged`) and raises ForgedControlKey: no resume point is derived."""
    out = []
    for r, row in enumerate(rows):
        words, mac = row[:-4], row[-4:]
        try:
            verify_words(ctx.job_key, _agree_name(ctx, r), words, mac)
        except ForgedControlKey as e:
            report_forged(e.key, e.reason)
            raise
        out.append(words)
    return out


def report_phase(name: str, seconds: float, **fields) -> None:
    """Datagram `phase`: recovery phase `name` (attach | localize | reconstruct | agree | finish
    | resume) took `seconds`; extra JSON-able fields (resume="finish"|"redo", step, pages...)."""
    detail = {"phase": name, "seconds": float(seconds), **fields}
    beats.send("phase", None, json.dumps(detail, default=str))
