"""A state of the Resilient Memory Pool as one trainer process maps it (`RetainedState`), and
the small records the client returns about states (`Marks`, `GroupInfo`, `LocalizeReport`,
`RefreshReport`).

Role: the mapped side of `rmp.client.RmpClient` (which creates every `RetainedState`: allocate,
attach, refresh, remap).  A state's data pages lie back to back in one reserved address range
(GPU or host, `mapping.py`); a protected state's parity pages in a second (host) range.  Tensors
are zero-copy views (`tensors.py`).  `unmap()` waits until no view is alive (or raises
`ViewsAlive`); the memory itself stays in the pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from leto_runtime.rmp.mapping import CudaMapping
from leto_runtime.rmp.tensors import ViewRegistry, make_tensor
from leto_runtime.wire import protocol as P, settings
from leto_runtime.wire.host_pages import HostMapping


@dataclass
class Marks:
    """Failure marks of one state: data page indices; parity by group position."""

    data: list[int] = field(default_factory=list)
    p1: dict[int, list[int]] = field(default_factory=dict)
    p2: dict[int, list[int]] = field(default_factory=dict)
    unmapped: list = field(default_factory=list)      # [role, group, index] awaiting remap

    @classmethod
    def from_wire(cls, d: dict | None) -> "Marks":
        d = d or {}
        return cls(list(d.get("data", [])), {int(k): list(v) for k, v in d.get("p1", {}).items()},
                   {int(k): list(v) for k, v in d.get("p2", {}).items()},
                   list(d.get("unmapped", [])))

    def __bool__(self) -> bool:
        return bool(self.data or self.p1 or self.p2 or self.unmapped)

    def count(self) -> int:
        return len(self.data) + sum(map(len, self.p1.values())) + sum(map(len, self.p2.values()))


@dataclass(frozen=True)
class GroupInfo:
    id: int            # pool-wide group number
    index: int         # position within its state
    first: int         # first data page
    k: int             # data pages


@dataclass
class LocalizeReport:
    marks: dict[str, Marks]
    device_pages_probed: int
    device_probe_s: float
    host_pages_scanned: int
    host_scan_s: float
    total_s: float
    commit_s: float = 0.0              # the keeper's commit of new marks (none: nothing new)
    host_deferred: int = 0             # host pages left to the state manager's background scan

    def failed(self) -> int:
        return sum(m.count() for m in self.marks.values())


@dataclass
class RefreshReport:
    """What `RmpClient.refresh` found and did (state names; page counts per state)."""

    version: int                                   # the pool version the mappings now match
    same: list[str] = field(default_factory=list)
    changed: dict[str, int] = field(default_factory=dict)    # pages re-imported in place
    dropped: dict[str, int] = field(default_factory=dict)    # pages unmapped: no memory left
    reattached: list[str] = field(default_factory=list)      # every page re-imported, same VA
    replaced: list[str] = field(default_factory=list)        # new layout: a new RetainedState
    gone: list[str] = field(default_factory=list)            # released from the pool
    new: list[str] = field(default_factory=list)             # in the pool, not mapped here
    seconds: float = 0.0

    @property
    def views_invalid(self) -> list[str]:
        """States whose tensors made before the refresh no longer show the pool's memory."""
        return self.replaced + self.gone


def _layout(d: dict) -> tuple:
    return (d["n_pages"], d["page_bytes"], d["tier"], d["protected"],
            tuple((g["first"], g["k"], len(g["p1"]), len(g["p2"])) for g in d["groups"]))


class RetainedState:
    """One retained state mapped into this process (see the module docstring)."""

    def __init__(self, d: dict, device: str, geometry: dict):
        self._describe(d, geometry)
        self.device = device if self.tier == "device" else "cpu"
        self.views = ViewRegistry(f"retained state {self.name!r}")
        if self.device.startswith("cuda"):
            self._data = CudaMapping(self.n_pages, self.page_bytes, int(self.device.split(":")[1]))
        else:
            self._data = HostMapping(self.n_pages, self.page_bytes)
        per = self.h1 + self.h2
        self._parity = HostMapping(len(self.groups) * per, self.page_bytes) if self.groups else None
        self._plan_slots(d)

    def _describe(self, d: dict, geometry: dict) -> None:
        self.name: str = d["name"]
        self.nbytes: int = d["nbytes"]
        self.kind: str = d["kind"]
        self.protected: bool = d["protected"]
        self.tier: str = d["tier"]
        self.page_bytes: int = d["page_bytes"]
        self.n_pages: int = d["n_pages"]
        self.dtype: str | None = d["dtype"]
        self.shape: list[int] | None = d["shape"]
        self.uid: int | None = d.get("uid")            # this incarnation of the state
        self.version: int = d.get("version", 0)        # pool version the mapping matches
        self.layout = _layout(d)
        self.h1, self.h2 = geometry["tier1"], geometry["tier2"]
        self.groups = [GroupInfo(g["id"], i, g["first"], g["k"]) for i, g in enumerate(d["groups"])]
        self.marks = Marks.from_wire(d.get("marks"))

    def _plan_slots(self, d: dict) -> None:
        # fd slot (position in the reply's fd train) -> (mapping, page index)
        per = self.h1 + self.h2
        self._slots: dict[int, tuple[object, int]] = {}
        self._pending: list[tuple[int, int]] = []      # device fds received, not mapped yet
        for i, s in enumerate(d["data"]):
            if s >= 0:
                self._slots[s] = (self._data, i)
        for gi, g in enumerate(d["groups"]):
            for i, s in enumerate(g["p1"]):
                if s >= 0:
                    self._slots[s] = (self._parity, gi * per + i)
            for i, s in enumerate(g["p2"]):
                if s >= 0:
                    self._slots[s] = (self._parity, gi * per + self.h1 + i)

    def _rebind(self, d: dict, geometry: dict) -> bool:
        """Prepare to re-import every page at the same addresses (a re-attach of a state that
        was re-created or changed too much); False if its layout differs (a new mapping is
        needed).  Tensor views stay valid: the addresses do not change."""
        if _layout(d) != self.layout or not self.mapped:
            return False
        if self._parity is not None:
            self._parity.unpin()
            self._parity.unmap_pages(list(self._parity.mapped))
        self._data.unmap_pages(list(self._data.mapped))
        self._describe(d, geometry)
        self._plan_slots(d)
        return True

    def _page_pos(self, role: str, group: int | None, index: int) -> tuple[object, int]:
        if role == "data":
            return self._data, index
        per = self.h1 + self.h2
        return self._parity, group * per + index + (self.h1 if role == "p2" else 0)

    def _batch_limit(self) -> int:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return max(P.MAX_FDS_PER_MESSAGE, min(settings.get().rmp_map_batch, (soft - 1024) // 2))

    def _map_batch(self, fds: list[int], offset: int) -> None:
        by_map: dict[int, tuple[object, list]] = {}
        defer = self._data.kind == "cuda"
        for j, fd in enumerate(fds):
            m, i = self._slots.get(offset + j, (None, None))
            if m is None:
                P.close_fds([fd])
                continue
            if defer and m is self._data:
                self._pending.append((i, fd))
                continue
            by_map.setdefault(id(m), (m, []))[1].append((i, fd))
        for m, pairs in by_map.values():
            m.map_pages(pairs)
        if len(self._pending) >= self._batch_limit():
            self._flush()

    def _flush(self) -> None:
        pairs, self._pending = self._pending, []
        if pairs:
            self._data.map_pages(pairs, grant=not settings.get().rmp_grant_once)

    def _abort(self) -> None:
        """An attach failed midway: close the fds not mapped yet."""
        P.close_fds([fd for _, fd in getattr(self, "_pending", [])])
        self._pending = []

    def _finish_map(self) -> None:
        self._flush()
        if settings.get().rmp_grant_once:
            self._data.grant_all()
        del self._slots
        if self._parity is not None:
            self._parity.pin()                     # page-locked: fast H2D/D2H on GPU machines

    # ---- views -------------------------------------------------------------------------------
    def tensor(self, dtype=None, shape=None, offset: int = 0, nbytes: int | None = None):
        """A zero-copy view of the data; defaults: the dtype/shape given at allocation."""
        if dtype is None and shape is None and offset == 0 and nbytes is None:
            dtype, shape = self.dtype, self.shape
        if nbytes is None:
            nbytes = self.nbytes - offset
            if shape is not None:
                from leto_runtime.rmp.tensors import torch_dtype

                nbytes = torch_dtype(dtype or "uint8").itemsize
                for s in shape:
                    nbytes *= int(s)
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.n_pages * self.page_bytes:
            raise ValueError(f"view [{offset}, {offset + nbytes}) outside {self.name!r}")
        return make_tensor(self._data.addr(0) + offset, nbytes, self.device, self.views,
                           dtype=dtype, shape=shape)

    def pages(self, first: int = 0, count: int | None = None):
        """Data pages [first, first+count) as a (count, page_bytes) uint8 tensor."""
        count = self.n_pages - first if count is None else count
        if first < 0 or count < 1 or first + count > self.n_pages:
            raise IndexError(f"pages {first}..{first + count - 1} of {self.n_pages}")
        return make_tensor(self._data.addr(first), count * self.page_bytes, self.device,
                           self.views, shape=(count, self.page_bytes))

    def group_pages(self, g: int):
        gi = self.groups[g]
        return self.pages(gi.first, gi.k)

    def _parity_view(self, g: int, start: int, n: int):
        if self._parity is None:
            raise ValueError(f"state {self.name!r} is not protected: it has no parity")
        if n == 0:
            return None
        per = self.h1 + self.h2
        return make_tensor(self._parity.addr(g * per + start), n * self.page_bytes, "cpu",
                           self.views, shape=(n, self.page_bytes))

    def tier1(self, g: int):
        """Group g's tier-1 parity pages, (H1, page_bytes) uint8, host (pinned on GPU machines)."""
        return self._parity_view(g, 0, self.h1)

    def tier2(self, g: int):
        """Group g's tier-2 parity pages, (H2, page_bytes) uint8 (None if H2 = 0)."""
        return self._parity_view(g, self.h1, self.h2)

    def probe(self) -> list[int]:
        """Data pages this process cannot use (device probe; see mapping.py)."""
        return self._data.probe()

    @property
    def mapped(self) -> bool:
        return self._data is not None and self._data.base is not None

    @property
    def mapping(self):
        """The page mapping behind the data (host or CUDA: `HostMapping`, `CudaMapping`), e.g.
        its `base` address and `mapped` pages; a read-only property (the client maps it)."""
        return self._data

    @property
    def parity_mapping(self):
        """The host page mapping behind the parity pages (None if the state has no groups);
        read-only, like `mapping`."""
        return self._parity

    def unmap(self, timeout: float = 10.0) -> None:
        """Unmap after every tensor view is gone (waits up to `timeout`, then ViewsAlive)."""
        if not self.mapped:
            return
        self.views.wait_dead(timeout)
        self._data.close()
        if self._parity is not None:
            self._parity.close()
