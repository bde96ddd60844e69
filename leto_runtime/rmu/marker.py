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

Calling contract: `Marker(state)` over a RetainedState/LocalState of >= 1 KiB; `read()` returns
a `Record` (a fresh page reads as `Record.empty()`); `write(rec)` makes `rec` current.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import asdict, dataclass, replace

import torch

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
        self._rec = self._read()

    def _block(self) -> torch.Tensor:
        return self.words_t.view(torch.uint8)

    def _read(self) -> Record:
        w = self.words.tolist()
        cur = w[CUR] if w[CUR] in (0, 1) else 0
        return Record.from_words(w[cur * WORDS:(cur + 1) * WORDS])

    def read(self) -> Record:
        self._rec = self._read()
        return self._rec

    @property
    def rec(self) -> Record:
        return self._rec

    def _patch_parity(self, old: torch.Tensor) -> None:
        if not self.protected:
            return
        if self._patch is None:
            prep = getattr(self._backend, "prepared_delta", None)
            args = (self._rows, [old], [self._block()], self._coef, BLOCK)
            self._patch = prep(*args) if prep else (lambda: self._backend.delta_update(*args))
        self._patch()

    def write(self, rec: Record | None = None, **changes) -> Record:
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
