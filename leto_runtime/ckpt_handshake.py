"""The checkpoint handshake between rank 0's active trainer and its shadow (the snapshot writer).

Role: the keys and the one atomic decision of a checkpoint taken by the shadow
(`leto_runtime.ckpt_snapshot`) from retained memory while the active computes.  All values
live in the job's worker store, signed with the job's key (`AuthStore`); the keys carry the
shadow's generation G and epoch E, so a request can only reach the shadow it was meant for:

    leto/ckpt/g{G}/r{R}/server         the shadow serves: JSON {"epoch", "pid"} (its own set)
    leto/ckpt/g{G}/e{E}/r{R}/n{N}/req  request N: the step and what retained memory does not
                                       hold (torch.save bytes: group values, scheduler, buffers)
    .../n{N}/claim                     the verdict, first writer wins (`compare_set` on an
                                       absent key): "shadow:ok" (its copy of the state of
                                       that step is complete), "shadow:skip <why>", or
                                       "trainer" (the trainer gave up waiting)
    .../n{N}/written                   the shadow's write ended: JSON {"ok", "path"|"error", "write_s"}

Why a claim and not two flags: the trainer must never write retained memory while the
shadow's copy could still count.  Whoever sets the claim first decides: a shadow that claims
"ok" has finished reading; a trainer that claims "trainer" makes a late copy worthless (the
shadow sees the claim taken and discards it).  A forged value does not verify and is taken
as "not copied" by both sides: forgery can cost a checkpoint, never make a torn one count.
The trainer must *know* the claim before it updates: a store that does not answer its claim
(after fresh clients, `SETTLE_S`) raises `ClaimUnsettled`, and the trainer stops before its
update writes retained memory -- a shadow's claim that the trainer could not read may stand.

Request numbers stay in step: a request the trainer may not have delivered is claimed by it
("trainer") and then voided (`void`: the request key gets a void value), so the shadow moves
on to the next number instead of waiting for one that never comes; a void that cannot be
written retires the epoch (the trainer copies the state until a new shadow serves).

Calling contract: each side owns its `Handshake` (a store client of its own, made on first
use; one that failed or timed out is dropped and the next call connects anew).  Every call
is bounded: a TCPStore call to a store that stopped answering never returns, whatever its
client's timeout, so each runs in a thread of its own that is abandoned at its bound.
"""
from __future__ import annotations

import datetime
import io
import json
import threading
import time

from leto_runtime.control_auth import ForgedControlKey

SHADOW_OK, SHADOW_SKIP, TRAINER = "shadow:ok", "shadow:skip", "trainer"
SETTLE_S = 10.0             # the bound on settling a claim over fresh clients
CALL_S = 5.0                # one store call's bound (a wait: its own timeout plus this)
MAX_VALUE = (8 << 20) - (64 << 10)   # TCPStore's server refuses a value over 8 MiB


class BadRequest(ValueError):
    """A request that is there but cannot be served (forged, or not a request)."""


class ClaimUnsettled(BaseException):
    """The claim of a snapshot request could not be read: the trainer must not update (the
    shadow's "ok" may stand).  A BaseException, like `demotion.Demoted`: a script's
    `except Exception` retry loop must not swallow it and update anyway."""


class StoreTimeout(TimeoutError):
    """A store call that did not return within its bound; its client is dropped."""


class NotSent(ConnectionError):
    """A store call that certainly never reached the store (no connection, or abandoned
    before it began): nothing it would have written is there, or ever will be."""


def server_key(generation: int, rank: int) -> str:
    return f"leto/ckpt/g{generation}/r{rank}/server"


def base(generation: int, epoch: int, rank: int, n: int) -> str:
    return f"leto/ckpt/g{generation}/e{epoch}/r{rank}/n{n}"


def pack(obj) -> bytes:
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes):
    import torch
    # The store is the job's authenticated one: only holders of the job key wrote this value
    # (the scheduler's state may hold any picklable object, as torch's own checkpoints do).
    return torch.load(io.BytesIO(data), weights_only=False)


class Handshake:
    """One side of the handshake with the server (G, E) of rank R; `connect()` -> a store."""

    def __init__(self, connect, generation: int, rank: int):
        self.connect, self.generation, self.rank = connect, generation, rank
        self.store = None                   # connected by the first call

    def fresh(self) -> None:
        self.store = None                   # the next call connects anew

    def _call(self, fn, bound: float | None = None):
        """`fn(store)` in a thread of its own, abandoned after `bound` s (`StoreTimeout`;
        `NotSent` when `fn` never began: the connection failed or was not made in time)."""
        bound = CALL_S if bound is None else bound
        box: dict = {}
        gate = threading.Lock()

        def run():
            try:
                st = self.store if self.store is not None else self.connect()
            except BaseException as e:
                box["e"] = NotSent(f"no connection to the job's store ({type(e).__name__}: {e})")
                return
            self.store = st
            with gate:
                if box.get("cancelled"):
                    return
                box["started"] = True
            try:
                box["v"] = fn(st)
            except BaseException as e:      # handed to the caller
                box["e"] = e
        th = threading.Thread(target=run, name="leto-ckpt-store", daemon=True)
        th.start()
        th.join(max(bound, 0.001))
        if th.is_alive():
            self.store = None
            with gate:
                box["cancelled"] = True
                began = box.get("started", False)
            if not began:
                raise NotSent(f"the job's store did not take a connection within {bound:g} s")
            raise StoreTimeout(f"the job's store did not answer within {bound:g} s")
        if "e" in box:
            if not isinstance(box["e"], ForgedControlKey):
                self.store = None           # a client that failed is not used again
            raise box["e"]
        return box.get("v")

    def _settle(self, key: str, value: str, bound: float) -> str:
        """Set `key` to `value` unless it is set, and read the value that stands for certain:
        retried on fresh clients (after a lost reply it is unknown whose claim stood) for up
        to `bound` s, else `ClaimUnsettled`.  A forged value: SKIP (it counts for no one)."""
        end, err = time.monotonic() + bound, None
        while True:
            left = end - time.monotonic()
            try:
                out = self._call(lambda s: s.compare_set(key, "", value),
                                 min(CALL_S, max(left, 0.05)))
                return out.decode() if isinstance(out, bytes) else str(out)
            except ForgedControlKey:        # the value is there and does not verify
                return f"{SHADOW_SKIP} the claim does not verify"
            except Exception as e:
                err = e
            if time.monotonic() + 0.2 >= end:
                raise ClaimUnsettled(
                    f"the job's store did not answer the checkpoint claim {key} for {bound:g} s "
                    f"({type(err).__name__}: {err})")
            time.sleep(0.2)

    # ---- the trainer's side ------------------------------------------------------------------
    def server(self) -> dict | None:
        """The serving shadow's {"epoch", "pid"}, or None (no shadow serves, or a forged value,
        or the store did not answer)."""
        key = server_key(self.generation, self.rank)
        try:
            return self._call(lambda s: json.loads(s.get(key)) if s.check([key]) else None)
        except Exception:
            return None

    def request(self, epoch: int, n: int, payload: dict) -> None:
        """Send request n; `NotSent` when it is too large for the store (its buffers)."""
        data = pack(payload)
        if len(data) > MAX_VALUE:
            raise NotSent(f"the request is {len(data)} bytes, more than the store takes "
                          f"({MAX_VALUE}): the buffers and the scheduler's state are too large")
        self._call(lambda s: s.set(base(self.generation, epoch, self.rank, n) + "/req", data))

    def void(self, epoch: int, n: int, why: str) -> None:
        """Request `n` was claimed by the trainer and may never have arrived: mark it void, so
        the shadow goes on to n + 1.  Raises when the store does not take it."""
        data = pack({"void": why})
        self._call(lambda s: s.set(base(self.generation, epoch, self.rank, n) + "/req", data))

    def verdict(self, epoch: int, n: int, timeout: float, settle: bool = True) -> str | None:
        """Wait (bounded) for the shadow's claim; with `settle`, then settle it: the claim's
        value, or TRAINER when the trainer set it (the shadow did not answer in time); raises
        `ClaimUnsettled` when the store does not tell (`SETTLE_S`).  Without `settle`, None
        when the shadow has not claimed yet."""
        key = base(self.generation, epoch, self.rank, n) + "/claim"
        wait = datetime.timedelta(seconds=max(timeout, 0.001))
        try:
            self._call(lambda s: s.wait([key], wait), timeout + CALL_S)
        except Exception:           # timed out (the client is dropped), or no store
            if not settle:
                return None
        return self._settle(key, TRAINER, SETTLE_S)

    def written(self, epoch: int, n: int) -> dict | None:
        """The shadow's report of request `n`'s write; None while it is still writing or when
        the store did not answer (ask again); a forged report: not ok."""
        key = base(self.generation, epoch, self.rank, n) + "/written"
        try:
            return self._call(lambda s: json.loads(s.get(key)) if s.check([key]) else None)
        except ForgedControlKey:
            return {"ok": False, "error": "the write's report did not verify"}
        except Exception:
            return None

    # ---- the shadow's side --------------------------------------------------------------------
    def serve(self, epoch: int, pid: int) -> None:
        value = json.dumps({"epoch": epoch, "pid": pid})
        self._call(lambda s: s.set(server_key(self.generation, self.rank), value))

    def next_request(self, epoch: int, n: int, slice_s: float) -> dict | None:
        """Request `n` ({"void": why}: claimed by the trainer, never to be served), waiting at
        most `slice_s` (None: not yet, or the store did not answer)."""
        key = base(self.generation, epoch, self.rank, n) + "/req"
        wait = datetime.timedelta(seconds=slice_s)
        try:
            data = self._call(lambda s: (s.wait([key], wait), s.get(key))[1], slice_s + CALL_S)
        except ForgedControlKey as e:
            raise BadRequest(f"request {n} does not verify ({e})") from None
        except Exception:           # timed out, or the store is not answering: ask again
            return None
        try:
            return unpack(data)
        except Exception as e:
            raise BadRequest(f"request {n} does not unpack ({type(e).__name__}: {e})") from None

    def answer(self, epoch: int, n: int, verdict: str, bound: float | None = None) -> bool:
        """The shadow's claim; True when it stands (the trainer has not given up).  Raises
        `ClaimUnsettled` when the store does not tell within `bound` (`SETTLE_S`)."""
        key = base(self.generation, epoch, self.rank, n) + "/claim"
        return self._settle(key, verdict, SETTLE_S if bound is None else bound) == verdict

    def report_written(self, epoch: int, n: int, info: dict) -> None:
        value = json.dumps(info)
        self._call(lambda s: s.set(base(self.generation, epoch, self.rank, n) + "/written",
                                   value))
