"""RMU's progress marker: a small record in protected host memory (paper §5.2; docs/RMU.md,
"The marker").

The marker says how far this rank got: the iteration t, its phase (computing, gradients
protected, past the global synchronization, updating, done), and during the update the group,
the chunk, whether the undo copy of that chunk is complete, which parity buffer is
authoritative and where the group's parity write-back stands.  A promoted trainer reads it to
decide what to finish or redo.

Crash safety without locks: the page holds two record slots and a `cur` word.  A write fills
the slot that is not current, then flips `cur` -- one aligned 8-byte store, which a SIGKILL
cannot tear -- so a reader always sees either the old or the new record, whole.  The page is
protected by two-tier parity like the model state; each write patches the parity of the one
1 KiB block it touches (the code is symbol-wise, docs/PARITY.md, so the other blocks' parity, zero,
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

MAGIC = 0x4C45544F524D5532          # "LETORMU2" (2: the `wb` fields; a "1" record reads as none)
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
    sub: int = 0             # 1 + s: the undo copy of chunk `chunk` is complete in undo slot s
                             # (chunk may be dirty); 0: it is not (chunk clean)
    auth: int = 0            # authoritative parity buffer (0/1) of `group`
    gstate: int = GState.LOAD
    coef_bits: int = 0       # fp32 bits of the clip coefficient of iteration `coef_t`
    seq: int = 0             # write counter (diagnostics)
    coef_t: int = -1         # the iteration whose global synchronization gave `coef_bits`;
                             # kept when the next iteration begins: a peer may need it to finish
    wb: int = -1             # a group whose parity write-back (tier 1 and 2) may still be under
                             # way beside the current group's work (-1: none); its authoritative
    wb_auth: int = 0         # buffer is `wb_auth` (the write-back overlap: updater default)

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
             self.auth, int(self.gstate), self.coef_bits, self.seq, self.coef_t, self.wb,
             self.wb_auth]
        return v + [0] * (WORDS - len(v))

    @classmethod
    def from_words(cls, w: list[int]) -> "Record":
        if w[0] != MAGIC:
            return cls.empty()
        return cls(*w[1:14])

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
        self._ext = self._dev = self._stream = self.mode = None
        self._mirror: _Mirror | None = None     # while writes are queued (write_async)
        # Read on first use, not here: a recovering trainer builds its updater before it has
        # localized and rebuilt lost pages, and the marker page may be one of them (a read of
        # a lost page traps, as real poison does).
        self._rec: Record | None = None

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
        if self._rec is None:
            self._rec = self._read()
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
    def use_stream(self, device, mode: str = "hostfunc") -> bool:
        """Let write_async queue on `device`'s current CUDA stream: mode "hostfunc" (a host
        function applies the payload) or "kernel" (a one-block kernel stores it into registered
        host memory; falls back to "hostfunc" per update where the memory cannot be mapped).
        False (writes stay synchronous) where the extension is unavailable, with the reason logged."""
        if mode not in STREAM_MODES:
            raise ValueError(f"marker stream mode must be one of {STREAM_MODES}, got {mode!r}")
        try:
            from leto_runtime.rmu import fused
            self._ext = fused.load()
        except Exception as e:          # build failure: keep host writes, say why
            log.warning("leto.rmu: stream-ordered marker writes unavailable (%s: %s); the updater "
                        "fences before each marker write", type(e).__name__, e)
            self._ext = None
            return False
        self._dev = torch.device(device)
        self.mode = mode
        return True

    def settle(self) -> None:
        """Wait until every queued write is in memory (the mirror is then dropped)."""
        if self._mirror is not None:
            self._stream.synchronize()
            self._mirror.release()
            self._mirror = None

    def _mirrored(self) -> "_Mirror":
        if self._mirror is None:        # nothing queued: the memory is current
            self._mirror = _Mirror(self)
            self._stream = torch.cuda.current_stream(self._dev)
        elif torch.cuda.current_stream(self._dev) != self._stream:
            self.settle()               # another stream: order it after the queued writes
            return self._mirrored()
        return self._mirror

    def write_async(self, rec: Record | None = None, **changes) -> Record:
        """write(), queued on the current CUDA stream (synchronous without use_stream)."""
        if self._ext is None:
            return self.write(rec, **changes)
        rec = replace(rec or self.rec, seq=self.rec.seq + 1, **changes)
        mi = self._mirrored()
        w, b8, np = mi.w, mi.b8, mi.np
        cur = int(w[CUR]) if int(w[CUR]) in (0, 1) else 0
        nxt = 1 - cur
        nr = len(mi.rows)
        bn = mi.payload()
        # The same steps as write(), on the mirror; each step's bytes become segments.
        mi.old.copy_(mi.blk.view(torch.uint8))
        w[nxt * WORDS:(nxt + 1) * WORDS] = rec.words()
        if mi.patch:
            mi.patch()
        o = WORDS * 8
        bn[:o] = b8[nxt * o:(nxt + 1) * o]
        if nr:
            bn[o:o + nr * BLOCK] = np.concatenate(mi.rows_np)
        o += nr * BLOCK
        mi.old.copy_(mi.blk.view(torch.uint8))
        w[CUR] = nxt
        if mi.patch:
            mi.patch()
        bn[o:o + 8] = b8[CUR * 8:CUR * 8 + 8]            # the commit: one 8-byte store
        if nr:
            bn[o + 8:] = np.concatenate(mi.rows_np)
        try:
            mi.send(nxt, self._stream)
        except BaseException:
            # Nothing of this write was queued: the mirror is ahead of what memory will hold.
            self.settle()
            raise
        self._rec = rec
        return rec

    def write(self, rec: Record | None = None, **changes) -> Record:
        self.settle()
        rec = replace(rec or self.rec, seq=self.rec.seq + 1, **changes)
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


STREAM_MODES = ("hostfunc", "kernel")
RING = 64                            # payload slots of the kernel mode (a full ring waits for its oldest)
KERNEL_SEGMENTS = 66                 # cuda/marker_kernel.h kMaxMarkerSegments
KERNEL_GROUP_WORDS = 1024 * 5        # 1024 threads x kMaxMarkerWordsPerThread


class _Mirror:
    """What the marker block and its parity rows will hold once every queued write has happened,
    and how a write's payload reaches them.  One per run of queued writes (Marker.settle ends it).

    The payload of one write: [slot, rows..., cur, rows...]; destinations and sizes are fixed per
    slot (nxt), so prepared here.  Mode "kernel" registers the block's and the rows' pages for
    device access for the life of the mirror (so a page remapped by recovery between updates is
    registered afresh), and stages payloads in a ring of pinned slots, each reused only after the
    kernel that read it has run."""

    def __init__(self, m: Marker):
        import numpy as np
        self.np, self.m = np, m
        self.blk = m.words_t.clone()
        self.w = self.blk.numpy()
        self.b8 = self.blk.view(torch.uint8).numpy()
        self.rows = [r.clone() for r in m._rows] if m.protected else []
        self.rows_np = [r.numpy() for r in self.rows]
        self.old = torch.empty(BLOCK, dtype=torch.uint8)
        self.patch = m._prepare(self.rows, self.old, self.blk.view(torch.uint8)) if m.protected else None
        nr = len(self.rows)
        self.nbytes = WORDS * 8 + 8 + 2 * BLOCK * nr
        size = [WORDS * 8, *[BLOCK] * nr, 8, *[BLOCK] * nr]
        self.sizes = torch.tensor(size, dtype=torch.int64)
        # fences: after the slot and the first rows, after `cur`, after the second rows
        self.fences = torch.tensor([0] * nr + [1, 1] + [0] * (nr - 1) + [1] if nr else [1, 1],
                                   dtype=torch.int64)
        self.registered: list[int] = []
        self.kernel = m.mode == "kernel" and self._fits(nr) and self._map()
        addr = self.dev_addr if self.kernel else (lambda a: a)
        base, R = m.words_t.data_ptr(), [r.data_ptr() for r in m._rows]
        self.plan = {nxt: torch.tensor([addr(base + nxt * WORDS * 8), *map(addr, R), addr(base + CUR * 8),
                                        *map(addr, R)], dtype=torch.int64) for nxt in (0, 1)}
        if self.kernel:
            self.ring, self.events = _ring(self.nbytes)
            self.ring_np = self.ring.numpy()
            self.k = 0
        else:
            self.buf = torch.empty(self.nbytes, dtype=torch.uint8)
            self.buf_np = self.buf.numpy()

    @staticmethod
    def _fits(nr: int) -> bool:
        """The kernel's limits (cuda/marker_kernel.h): 2 nr + 2 segments, and the slot plus nr
        rows between two fences."""
        if 2 * nr + 2 <= KERNEL_SEGMENTS and WORDS + nr * BLOCK // 8 <= KERNEL_GROUP_WORDS:
            return True
        log.warning("leto.rmu: %d marker parity rows exceed the device-side marker write's limits; "
                    "using host functions", nr)
        return False

    def _map(self) -> bool:
        """Register every page under the block and the rows (each page alone: a page someone
        else registered -- the RMP client pins the parity -- is left to them) and learn their
        device addresses; False (and nothing left registered) where that fails: this mirror
        then uses host functions."""
        ext, page = self.m._ext, 4096
        try:
            spans = [self.m.words_t.data_ptr()] + [r.data_ptr() for r in self.m._rows]
            pages = sorted({a for x in spans for a in range(x & ~(page - 1), x + BLOCK, page)})
            for a in pages:
                if ext.host_register(a, page):
                    self.registered.append(a)
            self.devptr = {x: ext.host_device_pointer(x) for x in spans}
            # a span's pages must map contiguously for the kernel to store through one pointer
            for x in spans:
                last = x + BLOCK - 8
                if ext.host_device_pointer(last) - self.devptr[x] != last - x:
                    raise RuntimeError(f"the marker span at {x:#x} is not contiguous on the device")
            return True
        except Exception as e:          # e.g. memory that cannot be page-locked: say why, carry on
            log.warning("leto.rmu: device-side marker writes unavailable for this update (%s: %s); "
                        "using host functions", type(e).__name__, e)
            self.release()
            return False

    def dev_addr(self, a: int) -> int:
        for base, d in self.devptr.items():        # the block base or a row start
            if base <= a < base + BLOCK:
                return d + (a - base)
        raise ValueError(f"{a:#x} is not in the marker block or its parity rows")

    def payload(self):
        if not self.kernel:
            return self.buf_np
        ev = self.events[self.k]
        if ev is not None:
            ev.synchronize()                       # the kernel that read this slot has run
        return self.ring_np[self.k]

    def send(self, nxt: int, stream) -> None:
        ext = self.m._ext
        if not self.kernel:
            ext.marker_write_async(self.plan[nxt], self.sizes, self.buf, self.m._dev)   # copies now
            return
        ext.marker_write_device(self.plan[nxt], self.sizes, self.fences, self.ring[self.k], self.m._dev)
        ev = self.events[self.k] = torch.cuda.Event()
        ev.record(stream)
        self.k = (self.k + 1) % RING

    def release(self) -> None:
        """Unregister what this mirror registered (after its writes are done: Marker.settle)."""
        for a in self.registered:
            try:
                self.m._ext.host_unregister(a)
            except Exception as e:      # leaves a page locked until exit; never fatal
                log.warning("leto.rmu: cudaHostUnregister of the marker failed: %s", e)
        self.registered = []


_RING: dict = {}


def _ring(nbytes: int):
    """The process's pinned payload slots (RING x nbytes) and, per slot, the event recorded after
    the kernel that last read it (a slot is refilled only once that kernel has run); made once."""
    r = _RING.get(nbytes)
    if r is None:
        r = _RING[nbytes] = (torch.empty((RING, nbytes), dtype=torch.uint8).pin_memory(), [None] * RING)
    return r
