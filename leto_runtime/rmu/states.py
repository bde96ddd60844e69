"""The retained states one trainer's RMU works on, and how they are laid out.

Role: name, allocate/attach and describe the memory of data-parallel AdamW training:

    leto/params  leto/exp_avg  leto/exp_avg_sq  leto/grads   fp32, N elements each, protected
    leto/marker                                               one host page, protected
    leto/rmu/undo    U: one chunk of params, exp_avg, exp_avg_sq (undo slot 0), then three
                     chunks for the chunk's delta pages (CUDA two-kernel update) / the update's
                     scratch (torch-ops path) / undo slot 1, then two pages for the folded
                     chunk's stage counts (fold.py; never lent)   retained, unprotected
    leto/rmu/parity  Q/Q': four parity buffers (H1 pages) per model state, on the data's device,
                     retained, unprotected (chunk commits make them recoverable, docs/RMU.md).
                     Group g's pair (auth 0/1) is buffers (2g, 2g+1) mod 4, so group g+1's pair
                     is two buffers group g never touches: the updater prefetches g+1's host
                     parity into one while g's chunks run, and (by default; LETO_RMU_WB_OVERLAP=0: in line) writes
                     g's authoritative buffer back to the host while g+1's chunks run.

On CUDA, U and Q are idle outside the update phase and are lent to the caching allocator for
activations (`StateSet.lend_ranges`, `leto_runtime.rmu.lend`): peak HBM does not grow by them.

The four N-element states have the same size, hence the same pages and protection groups
(the state manager cuts groups of D pages from page 0); RMU's chunk j of group g is the same
page range in params, exp_avg and exp_avg_sq.

Two backings with one surface (`pages`, `group_pages`, `tier1`, `tier2`, `tensor`, `groups`,
`h1`, `h2`, `page_bytes`, `device`, `marks`):
* `leto_runtime.rmp.RetainedState` under `leto-run` (the state manager's pool), and
* `LocalState` (ordinary tensors) under plain `torchrun`: the same code runs, so a plain run is
  a reference for exactness, but nothing survives the process.

Calling contract: `open_states(...)` returns a `StateSet`; `StateSet.created` tells whether the
model states were new (the caller then initializes them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from leto_runtime.rmp.retained import GroupInfo, Marks
from leto_runtime.wire.geometry import Geometry  # noqa: F401 (re-exported)

MODEL = ("leto/params", "leto/exp_avg", "leto/exp_avg_sq")
GRADS = "leto/grads"
MARKER = "leto/marker"
UNDO = "leto/rmu/undo"
QBUF = "leto/rmu/parity"
ALIGN = 16          # elements: every parameter view starts 64-byte aligned
QBUFS = 4               # parity buffers per model state (StateSet.q_first)
FOLD_PAGES = 2          # the folded chunk's two copies of its stage counts (fold.py)
MARKER_BYTES = 4096     # one host page (the record needs 1 KiB)


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int          # elements into the flat fp32 state
    numel: int


@dataclass(frozen=True)
class Layout:
    """Where each parameter lives in the flat fp32 states."""

    params: tuple[ParamSlot, ...]
    numel: int           # elements used
    nbytes: int          # bytes allocated per state (whole pages)

    @classmethod
    def of(cls, named_shapes, page_bytes: int) -> "Layout":
        out, off = [], 0
        for name, shape in named_shapes:
            n = math.prod(shape) if shape else 1
            out.append(ParamSlot(name, tuple(int(s) for s in shape), off, int(n)))
            off += -(-n // ALIGN) * ALIGN
        nbytes = max(1, -(-off * 4 // page_bytes)) * page_bytes
        return cls(tuple(out), off, nbytes)

    def to_json(self) -> list:
        return [[p.name, list(p.shape), p.offset] for p in self.params]

    def bind(self, model: torch.nn.Module, P: torch.Tensor, G: torch.Tensor) -> None:
        """Each of `model`'s parameters gets its slot's view of the flat state `P` as `.data`
        and, if trainable, its slot's view of `G` as `.grad`; the Parameter objects stay (a
        torch optimizer or DDP built over them keeps working, ties hold).  A meta parameter,
        or one on another device, first becomes a placeholder on P's device
        (`torch.utils.swap_tensors` keeps the object)."""
        by_name = dict(model.named_parameters())
        for slot in self.params:
            p = by_name[slot.name]
            view = P[slot.offset:slot.offset + slot.numel].view(slot.shape)
            if p.is_meta or p.device != view.device:
                ph = torch.nn.Parameter(torch.zeros(1, dtype=p.dtype, device=view.device)
                                        .expand(slot.shape), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, ph)
            p.data = view
            p.grad = (G[slot.offset:slot.offset + slot.numel].view(slot.shape)
                      if p.requires_grad else None)


class LocalState:
    """An in-process stand-in for a RetainedState (plain torchrun: nothing is retained)."""

    def __init__(self, name: str, nbytes: int, geo: Geometry, device: str, protected: bool,
                 dtype: str | None = None, shape=None):
        S = geo.page_bytes
        self.name, self.page_bytes, self.protected = name, S, protected
        self.n_pages = -(-nbytes // S)
        self.nbytes = nbytes
        self.device = device
        self.dtype, self.shape = dtype, shape
        self.h1, self.h2 = geo.tier1, geo.tier2
        self._data = torch.zeros(self.n_pages * S, dtype=torch.uint8, device=device)
        self.groups = []
        if protected:
            first = 0
            while first < self.n_pages:
                k = min(geo.data_pages, self.n_pages - first)
                self.groups.append(GroupInfo(len(self.groups), len(self.groups), first, k))
                first += k
        per = self.h1 + self.h2
        self._parity = torch.zeros((len(self.groups) * per, S), dtype=torch.uint8)
        self.marks = Marks()

    def tensor(self, dtype=None, shape=None, offset: int = 0, nbytes: int | None = None):
        from leto_runtime.rmp.tensors import torch_dtype
        if nbytes is None:
            nbytes = self.nbytes - offset
        flat = self._data[offset:offset + nbytes]
        t = flat if dtype is None else flat.view(torch_dtype(dtype))
        return t if shape is None else t.view(tuple(shape))

    def pages(self, first: int = 0, count: int | None = None):
        count = self.n_pages - first if count is None else count
        S = self.page_bytes
        return self._data[first * S:(first + count) * S].view(count, S)

    def group_pages(self, g: int):
        gi = self.groups[g]
        return self.pages(gi.first, gi.k)

    def tier1(self, g: int):
        per = self.h1 + self.h2
        return self._parity[g * per:g * per + self.h1]

    def tier2(self, g: int):
        per = self.h1 + self.h2
        return self._parity[g * per + self.h1:(g + 1) * per] if self.h2 else None


@dataclass
class StateSet:
    """Everything RMU touches for one rank (see the module docstring)."""

    model: tuple            # params, exp_avg, exp_avg_sq
    grads: object
    marker: object
    undo: object
    qbuf: object
    geo: Geometry
    chunk_pages: int
    layout: Layout
    created: bool
    client: object = None   # RmpClient, or None for local states
    extra: dict = field(default_factory=dict)

    @property
    def all(self) -> list:
        return [*self.model, self.grads, self.marker, self.undo, self.qbuf]

    @property
    def device(self) -> str:
        return self.model[0].device

    def flat(self, st) -> torch.Tensor:
        """The fp32 flat view of a model/grad state (N elements used)."""
        return st.tensor(dtype="float32", shape=[self.layout.nbytes // 4])

    def q(self, state_index: int, buf: int, group: int) -> torch.Tensor:
        """Parity buffer `buf` (0/1, the marker's `auth` numbering) of protection group `group`
        of model state `state_index`: (H1, S) uint8 on the device."""
        return self.qbuf.pages(self.q_first(state_index, buf, group), self.geo.tier1)

    def q_first(self, state_index: int, buf: int, group: int) -> int:
        """Page index within the parity-buffer state of that buffer's first row: four buffers
        per state in rotation, so group g+1's buffers are none of group g's."""
        return (state_index * QBUFS + (2 * group + buf) % QBUFS) * self.geo.tier1

    def undo_pages(self, state_index: int, count: int, slot: int = 0) -> torch.Tensor:
        """The undo copy of model state `state_index`'s chunk in undo slot `slot` (0: chunks
        0..2 of the undo state, 1: chunks 3..5).  Two slots let the next chunk's undo copy run
        while this chunk's kernel reads its own (updater.Updater.slots); the marker's `sub`
        (1 + slot) tells recovery which slot holds the uncommitted chunk."""
        return self.undo.pages(self.undo_index(state_index, 0, slot), count)

    def undo_index(self, state_index: int, page: int, slot: int = 0) -> int:
        """Page index within the undo state of page `page` of a chunk's undo copy."""
        return (3 * slot + state_index) * self.chunk_pages + page

    def fold_count_page(self, copy: int) -> int:
        """Page index within the undo state of copy 0/1 of the folded chunk's stage counts."""
        return 6 * self.chunk_pages + copy

    def fold_counts(self, copy: int) -> torch.Tensor:
        """Copy 0/1 of the folded chunk's stage counts: int64 words, one per 512-byte unit of
        a page (fold.units), at the start of its own page."""
        from leto_runtime.rmu.fold import units
        return self.undo.pages(self.fold_count_page(copy), 1).view(-1).view(torch.int64)[:units(self.geo.page_bytes)]

    def delta_pages(self, state_index: int, count: int) -> torch.Tensor:
        """Where the fused CUDA update writes old ^ new of chunk pages of model state
        `state_index` (chunks 3..5 of the undo state, i.e. undo slot 1: so the two-kernel path
        uses undo slot 0 only; never read by recovery)."""
        return self.undo.pages((3 + state_index) * self.chunk_pages, count)

    def scratch(self) -> torch.Tensor:
        """The update's fp32 scratch chunk (4th chunk of the undo state, shared with the first
        delta chunk; contents never read by recovery)."""
        E = self.geo.page_bytes // 4
        return self.undo.pages(3 * self.chunk_pages, self.chunk_pages).view(torch.float32) \
            .view(self.chunk_pages * E)

    def lend_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) of the device memory RMU can lend for activations outside the
        update phase: the undo/scratch state and the parity buffers (not the fold's stage
        counts: a stale count must be a count, never an activation's bytes)."""
        out = []
        for st, keep in ((self.undo, FOLD_PAGES), (self.qbuf, 0)):
            t = st.pages(0, st.n_pages - keep)
            out.append((t.data_ptr(), t.numel() * t.element_size()))
        return out

    def chunk_index(self, g: int, j: int) -> tuple[int, int]:
        """(chunk j of group g's position among the update's chunks, how many there are)."""
        n = [len(self.chunks(h)) for h in range(len(self.model[0].groups))]
        return sum(n[:g]) + j, sum(n)

    def chunks(self, g: int) -> list[tuple[int, int]]:
        """(first page within the group, page count) of every chunk of group g."""
        k = self.model[0].groups[g].k
        c = self.chunk_pages
        return [(j, min(c, k - j)) for j in range(0, k, c)]


CHUNK_BYTES_MAX = 512 << 20


def pick_chunk_pages(requested: int, geo: Geometry) -> int:
    """RMU transaction size: the request, else a quarter of a group (>= 1 page, <= 512 MiB).

    Large chunks because every chunk costs two stream synchronizations, two marker writes and
    a fixed share of the parity kernel (its epilogue); the measured effect of the chunk size is
    in docs/BENCHMARKS.md (benchmarks/rmu_overhead.py).  The
    undo and delta buffers (6 chunks) are lent to activations outside the update, so their size
    does not raise the peak (docs/BENCHMARKS.md)."""
    if requested > 0:
        return min(requested, geo.data_pages)
    target = max(1, geo.data_pages // 4)
    return max(1, min(target, CHUNK_BYTES_MAX // geo.page_bytes))


def open_states(layout: Layout, *, client, geo: Geometry, device: str, chunk_pages: int,
                attach_only: bool = False) -> StateSet:
    """Allocate (first trainer) or attach (every later one) the states of `layout`.

    A chunk never spans protection groups, so it is capped at the largest group the layout
    has: a small model does not pay for undo buffers sized for a full group (the chunk count
    per group, which fault injections name, is unchanged)."""
    H1, S = geo.tier1, geo.page_bytes
    chunk_pages = max(1, min(chunk_pages, geo.data_pages, layout.nbytes // S))
    # 3 undo chunks + 3 delta chunks (one is the scratch) + the fold's counts
    undo_bytes = (6 * chunk_pages + FOLD_PAGES) * S
    q_bytes = 3 * QBUFS * H1 * S
    n = layout.nbytes // 4
    if client is None:
        mk = lambda name, nb, prot, dtype=None, shape=None, dev=device: LocalState(  # noqa: E731
            name, nb, geo, dev, prot, dtype, shape)
        model = tuple(mk(nm, layout.nbytes, True, "float32", [n]) for nm in MODEL)
        return StateSet(model, mk(GRADS, layout.nbytes, True, "float32", [n]),
                        mk(MARKER, MARKER_BYTES, True, dev="cpu"), mk(UNDO, undo_bytes, False),
                        mk(QBUF, q_bytes, False), geo, chunk_pages, layout, True, None)
    existing = {s["name"]: s for s in client.list()}
    created = MODEL[0] not in existing

    def get(name, nbytes, kind, protected, tier, dtype=None, shape=None):
        if attach_only or name in existing:
            return client.attach(name, nbytes)
        return client.retain(name, nbytes, kind=kind, protected=protected, tier=tier,
                             dtype=dtype, shape=shape)

    model = tuple(get(nm, layout.nbytes, "model", True, "device", "float32", [n]) for nm in MODEL)
    grads = get(GRADS, layout.nbytes, "model", True, "device", "float32", [n])
    marker = get(MARKER, MARKER_BYTES, "model", True, "host")
    undo = get(UNDO, undo_bytes, "process", False, "device")
    qbuf = get(QBUF, q_bytes, "process", False, "device")
    return StateSet(model, grads, marker, undo, qbuf, geo, chunk_pages, layout, created, client)
