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

Calling contract: each side owns its `Handshake` over its own store client (a TCPStore client
whose wait timed out is not used again: `fresh()` makes a new one); every call is bounded by
the timeout it is given.
"""
from __future__ import annotations

import datetime
import io
import json
import time

from leto_runtime.control_auth import ForgedControlKey

SHADOW_OK, SHADOW_SKIP, TRAINER = "shadow:ok", "shadow:skip", "trainer"
SETTLE_S = 10.0             # the trainer's bound on settling a claim over fresh clients


class BadRequest(ValueError):
    """A request that is there but cannot be served (forged, or not a request)."""


class ClaimUnsettled(RuntimeError):
    """The trainer could not learn the claim of a snapshot request: it must not update."""


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
        self.store = connect()

    def fresh(self) -> None:
        self.store = self.connect()

    # ---- the trainer's side ------------------------------------------------------------------
    def server(self) -> dict | None:
        """The serving shadow's {"epoch", "pid"}, or None (no shadow serves, or a forged value)."""
        key = server_key(self.generation, self.rank)
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception:
            return None

    def request(self, epoch: int, n: int, payload: dict) -> None:
        self.store.set(base(self.generation, epoch, self.rank, n) + "/req", pack(payload))

    def verdict(self, epoch: int, n: int, timeout: float, settle: bool = True) -> str | None:
        """Wait (bounded) for the shadow's claim; with `settle`, then settle it: the claim's
        value, or TRAINER when the trainer set it (the shadow did not answer in time).
        Without `settle`, None when the shadow has not claimed yet."""
        key = base(self.generation, epoch, self.rank, n) + "/claim"
        try:
            self.store.wait([key], datetime.timedelta(seconds=max(timeout, 0.001)))
        except Exception:           # a timed-out wait: this client is not used again
            try:
                self.fresh()
            except Exception:
                pass                # (the claim below retries on fresh clients)
            if not settle:
                return None
        return self.settle_claim(key)

    def settle_claim(self, key: str, bound: float | None = None) -> str:
        """The trainer's claim: the value that stands, read for certain -- retried on fresh
        clients for up to `bound` (SETTLE_S) s, else `ClaimUnsettled` (the shadow may have
        claimed)."""
        bound = SETTLE_S if bound is None else bound
        end, err = time.monotonic() + bound, None
        while True:
            try:
                out = self.store.compare_set(key, "", TRAINER)
                return out.decode() if isinstance(out, bytes) else str(out)
            except ForgedControlKey:        # the value is there and does not verify
                return f"{SHADOW_SKIP} the claim does not verify"
            except Exception as e:
                err = e
            if time.monotonic() >= end:
                raise ClaimUnsettled(
                    f"the job's store did not answer the checkpoint claim {key} for {bound:g} s "
                    f"({type(err).__name__}: {err}); the trainer stops before its update, so "
                    "a copy the shadow may have claimed cannot be torn")
            time.sleep(0.2)
            try:
                self.fresh()
            except Exception as e:
                err = e

    def written(self, epoch: int, n: int) -> dict | None:
        """The shadow's report of request `n`'s write, or None while it is still writing."""
        key = base(self.generation, epoch, self.rank, n) + "/written"
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception:
            return {"ok": False, "error": "the write's report did not verify"}

    # ---- both sides ---------------------------------------------------------------------------
    def claim(self, key: str, value: str) -> str:
        """Set `key` to `value` unless it is set: the value that stands (a forged one: SKIP)."""
        try:
            out = self.store.compare_set(key, "", value)
        except Exception as e:
            return f"{SHADOW_SKIP} the claim could not be read ({type(e).__name__})"
        return out.decode() if isinstance(out, bytes) else str(out)

    # ---- the shadow's side --------------------------------------------------------------------
    def serve(self, epoch: int, pid: int) -> None:
        self.store.set(server_key(self.generation, self.rank), json.dumps({"epoch": epoch,
                                                                          "pid": pid}))

    def next_request(self, epoch: int, n: int, slice_s: float) -> dict | None:
        """Request `n`, waiting at most `slice_s` (None: not yet)."""
        key = base(self.generation, epoch, self.rank, n) + "/req"
        try:
            self.store.wait([key], datetime.timedelta(seconds=slice_s))
            data = self.store.get(key)
        except ForgedControlKey as e:
            raise BadRequest(f"request {n} does not verify ({e})") from None
        except Exception:           # timed out, or the store is not answering: ask again
            self.fresh()
            return None
        try:
            return unpack(data)
        except Exception as e:
            raise BadRequest(f"request {n} does not unpack ({type(e).__name__}: {e})") from None

    def answer(self, epoch: int, n: int, verdict: str) -> bool:
        """The shadow's claim; True when it stands (the trainer has not given up)."""
        return self.claim(base(self.generation, epoch, self.rank, n) + "/claim",
                          verdict) == verdict

    def report_written(self, epoch: int, n: int, info: dict) -> None:
        self.store.set(base(self.generation, epoch, self.rank, n) + "/written", json.dumps(info))
