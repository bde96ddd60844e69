"""RMU's progress marker: a small record in protected host memory (paper §5.2, DESIGN.md §6).

The marker says how far this rank got: the iteration t, its phase (computing, gradients
protected, past the global synchronization, updating, done), and during the update the group,
the chunk, whether the undo copy of that chunk is complete, which parity buffer is
authoritative and where the group's parity write-back stands.  A promoted trainer reads it to
decide what to finish or redo.

Crash safety without locks: the page holds two record slots and a `cur` word.  A write fills
the slot that is not current, then flips `cur` -- one aligned 8-byte store, which a SIGKILL
cannot tear -- so a reader always sees either the old or the new record, whole.  The page is
protected by two-tier parity like the model state; each write patches the parity of the one
1 KiB block it touches (the code is symbol-wise, PARITY.md, so the other blocks' parity, zero,
is unchanged), before the flip and after it.  If the marker page is lost together with a crash
between the flip and its parity patch, reconstruction yields the previous record; every record
is a valid recovery point for the state that the next operation leaves (recovery.py restores
an uncommitted chunk from the undo buffer and redoes it).

Stream-ordered writes (CUDA, the paper's "lightweight kernels update the marker in the same
stream"): after `use_stream(device)`, `write_async(...)` computes the same bytes on a mirror of the
block and its parity rows (what they will be once every queued write has happened) and queues
them on the current CUDA stream (cuda/marker_stream.cpp, cudaLaunchHostFunc): the record lands
when the stream has finished the operation queued before it, and work queued after it waits for
it.  The host never waits between RMU operations.  `rec` is the last record written or queued;
`settle()` waits until the queued ones are in memory (`write` and `read` settle first).

Calling contract: `Marker(state)` over a RetainedState/LocalState of >= 1 KiB; `read()` returns
a `Record` (a fresh page reads as `Record.empty()`); `write(rec)` makes `rec` current;
`use_stream(device)` -> bool, then `write_async(rec)` / `settle()`.
"""
from __future__ import annotations

import enum
import logging
import struct
from dataclasses import asdict, dataclass, replace

import torch

log = logging.getLogger("leto.rmu")

MAGIC = 0x4C45544F524D5531          # "LETORMU1"
WORDS = 16                           # int64 words per record slot
CUR = 2 * WORDS                      # index of the `cur` word
BLOCK = 1024                         # bytes covered by the marker's parity patch


class Phase(enum.IntEnum):
    COMPUTE = 0        # iteration t started: forward/backward (gradients not yet protected)
    PROTECTED = 1      # gradients of t all-reduced and protected by parity
    SYNCED = 2         # passed the global synchronization of t (coef recorded)
    UPDATING = 3       # inside the chunked update of t (group/chunk/sub/gstate say where)
    DONE = 4           # the update of t is complete (parity written back, tier 2 refreshed)


class GState(enum.IntEnum):
    LOAD = 0           # copying group g's host parity into the authoritative buffer
    CHUNKS = 1         # chunk transactions of group g
    WRITEBACK = 2      # copying the authoritative buffer back to the host parity
    TIER2 = 3          # refreshing group g's tier-2 parity


@dataclass(frozen=True)
class Record:
    initialized: int = 0     # model state initialized (values + parity)
    t: int = -1              # iteration of the current / last transaction
    phase: int = Phase.DONE
    group: int = 0
    chunk: int = 0           # chunks of `group` committed so far (= the next chunk to run)
    sub: int = 0             # 1: the undo copy of chunk `chunk` is complete (chunk may be dirty)
    auth: int = 0            # authoritative parity buffer (0/1) of `group`
    gstate: int = GState.LOAD
    coef_bits: int = 0       # fp32 bits of the clip coefficient of iteration `coef_t`
    seq: int = 0             # write counter (diagnostics)
    coef_t: int = -1         # the iteration whose global synchronization gave `coef_bits`;
                             # kept when the next iteration begins: a peer may need it to finish

    @classmethod
    def empty(cls) -> "Record":
        return cls()

    @property
    def coef(self) -> float:
        return struct.unpack("<f", struct.pack("<I", self.coef_bits & 0xFFFFFFFF))[0]

    @staticmethod
    def bits(coef: torch.Tensor | float) -> int:
        v = float(coef.item() if isinstance(coef, torch.Tensor) else coef)
        return struct.unpack("<I", struct.pack("<f", v))[0]

    @property
    def done_step(self) -> int:
        """The last iteration whose update is complete."""
        return self.t if self.phase == Phase.DONE else self.t - 1

    @property
    def synced_step(self) -> int:
        """The last iteration whose global synchronization this rank passed."""
        return self.t if self.phase >= Phase.SYNCED else self.t - 1

    def words(self) -> list[int]:
        v = [MAGIC, self.initialized, self.t, int(self.phase), self.group, self.chunk, self.sub,
             self.auth, int(self.gstate), self.coef_bits, self.seq, self.coef_t]
        return v + [0] * (WORDS - len(v))

    @classmethod
    def from_words(cls, w: list[int]) -> "Record":
        if w[0] != MAGIC:
            return cls.empty()
        return cls(*w[1:12])

    def describe(self) -> str:
        d = asdict(self)
        d["phase"] = Phase(self.phase).name
        d["gstate"] = GState(self.gstate).name
        return " ".join(f"{k}={v}" for k, v in d.items() if k != "coef_bits")


class Marker:
    def __init__(self, state, backend: str = "auto"):
        self.state = state
        self.words_t = state.pages(0, 1).view(-1)[:BLOCK].view(torch.int64)   # host memory
        # A NumPy view of the same bytes: element stores are plain 8-byte stores, ~50x cheaper
        # than torch indexing (the update writes two records per chunk).
        self.words = self.words_t.numpy()
        self._old = torch.empty(BLOCK, dtype=torch.uint8)
        self._patch = None
        self.protected = bool(getattr(state, "groups", None))
        if self.protected:
            import numpy as np

            from leto_runtime.parity import ProtectionGroup, gf16
            code = ProtectionGroup(1, state.h1, state.h2, BLOCK, backend=backend)
            g1 = code.tier1.G[:, [0]]
            # Both tiers in one delta pass; the coefficients are fixed, so computed once (GF
            # matrix products in Python cost ~0.4 ms, more than the patch itself).
            self._coef = np.concatenate([g1, gf16.mat_mul(code.tier2.G, g1)]) if state.h2 else g1
            self._backend = code.tier1.backend_for(torch.device("cpu"))
            self._rows = [row[:BLOCK] for row in state.tier1(0)]
            p2 = state.tier2(0)
            self._rows += [row[:BLOCK] for row in p2] if (p2 is not None and state.h2) else []
        self._ext = self._dev = self._stream = None
        self._mirror = None          # (block, words, rows, old, patch) while writes are queued
        self._rec = self._read()

    def _block(self) -> torch.Tensor:
        return self.words_t.view(torch.uint8)

    def _read(self) -> Record:
        w = self.words.tolist()
        cur = w[CUR] if w[CUR] in (0, 1) else 0
        return Record.from_words(w[cur * WORDS:(cur + 1) * WORDS])

    def read(self) -> Record:
        self.settle()
        self._rec = self._read()
        return self._rec

    @property
    def rec(self) -> Record:
        return self._rec

    def _prepare(self, rows, old, block):
        prep = getattr(self._backend, "prepared_delta", None)
        args = (rows, [old], [block], self._coef, BLOCK)
        return prep(*args) if prep else (lambda: self._backend.delta_update(*args))

    def _patch_parity(self, old: torch.Tensor) -> None:
        if not self.protected:
            return
        if self._patch is None:
            self._patch = self._prepare(self._rows, old, self._block())
        self._patch()

    # ---- stream-ordered writes (CUDA) ---------------------------------------------------------
    def use_stream(self, device) -> bool:
        """Let write_async queue on `device`'s current CUDA stream; False (writes stay
        synchronous) where the extension is unavailable, with the reason logged."""
        try:
            from leto_runtime.rmu import fused
            self._ext = fused.load()
        except Exception as e:          # build failure: keep host writes, say why
            log.warning("leto.rmu: stream-ordered marker writes unavailable (%s: %s); the updater "
                        "fences before each marker write", type(e).__name__, e)
            self._ext = None
            return False
        self._dev = torch.device(device)
        return True

    def settle(self) -> None:
        """Wait until every queued write is in memory (the mirror is then dropped)."""
        if self._mirror is not None:
            self._stream.synchronize()
            self._mirror = None

    def _mirrored(self):
        if self._mirror is None:        # nothing queued: the memory is current
            import numpy as np
            blk = self.words_t.clone()
            b8 = blk.view(torch.uint8)
            rows = [r.clone() for r in self._rows] if self.protected else []
            old = torch.empty(BLOCK, dtype=torch.uint8)
            patch = self._prepare(rows, old, b8) if self.protected else None
            # The payload of one write: [slot, rows..., cur, rows...] -- destinations and sizes
            # are fixed per slot, so prepared once per slot; the bytes are gathered per write.
            base, R = self.words_t.data_ptr(), [r.data_ptr() for r in self._rows]
            plan = {}
            for nxt in (0, 1):
                dst = [base + nxt * WORDS * 8, *R, base + CUR * 8, *R]
                size = [WORDS * 8, *[BLOCK] * len(R), 8, *[BLOCK] * len(R)]
                plan[nxt] = (torch.tensor(dst, dtype=torch.int64), torch.tensor(size, dtype=torch.int64))
            buf = torch.empty(WORDS * 8 + 8 + 2 * BLOCK * len(R), dtype=torch.uint8)
            self._mirror = (blk, blk.numpy(), b8.numpy(), rows, [r.numpy() for r in rows], old, patch,
                            plan, buf, buf.numpy(), np)
            self._stream = torch.cuda.current_stream(self._dev)
        elif torch.cuda.current_stream(self._dev) != self._stream:
            self.settle()               # another stream: order it after the queued writes
            return self._mirrored()
        return self._mirror

    def write_async(self, rec: Record | None = None, **changes) -> Record:
        """write(), queued on the current CUDA stream (synchronous without use_stream)."""
        if self._ext is None:
            return self.write(rec, **changes)
        rec = replace(rec or self._rec, seq=self._rec.seq + 1, **changes)
        blk, w, b8, rows, rows_np, old, patch, plan, buf, bn, np = self._mirrored()
        cur = int(w[CUR]) if int(w[CUR]) in (0, 1) else 0
        nxt = 1 - cur
        nr = len(rows)
        # The same steps as write(), on the mirror; each step's bytes become segments.
        old.copy_(blk.view(torch.uint8))
        w[nxt * WORDS:(nxt + 1) * WORDS] = rec.words()
        if patch:
            patch()
        o = WORDS * 8
        bn[:o] = b8[nxt * o:(nxt + 1) * o]
        if nr:
            bn[o:o + nr * BLOCK] = np.concatenate(rows_np)
        o += nr * BLOCK
        old.copy_(blk.view(torch.uint8))
        w[CUR] = nxt
        if patch:
            patch()
        bn[o:o + 8] = b8[CUR * 8:CUR * 8 + 8]            # the commit: one 8-byte store
        if nr:
            bn[o + 8:] = np.concatenate(rows_np)
        self._ext.marker_write_async(*plan[nxt], buf, self._dev)     # copies the bytes now
        self._rec = rec
        return rec

    def write(self, rec: Record | None = None, **changes) -> Record:
        self.settle()
        rec = replace(rec or self._rec, seq=self._rec.seq + 1, **changes)
        w = self.words
        cur = int(w[CUR]) if int(w[CUR]) in (0, 1) else 0
        nxt = 1 - cur
        old = self._old
        old.copy_(self._block())
        w[nxt * WORDS:(nxt + 1) * WORDS] = rec.words()
        self._patch_parity(old)
        old.copy_(self._block())
        w[CUR] = nxt                     # the commit: one 8-byte store
        self._patch_parity(old)
        self._rec = rec
        return rec
