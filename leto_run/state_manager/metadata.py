"""The state manager's metadata: retained states, their pages, protection groups, failure marks.

Role: the pure data half of the pool (no fds, no syscalls).  `pool.Pool` mutates it under its
lock and ships a `snapshot()` to the agent's fd keeper after every change, so a restarted state
manager rebuilds exactly this from `PoolMeta.from_snapshot()` plus the kept fds.

Layout (docs/MEMORY.md, "The pool"; docs/PARITY.md): a *protected* state's data pages are cut into
protection groups of up to D pages (the last group may be shorter: the code works for any k); each
group owns H1 tier-1 and H2 tier-2 parity pages in host memory, of the state's page size.  Pages
are named by pool-wide integer ids; where a page sits (state, role, group, index) is derived from
the states, so the snapshot carries only ids, flags and the geometry (32,768 pages ~ 200 KB).

Page flags:
  failed       contents lost; a protected page must be reconstructed before use
  needs_remap  the physical memory is unusable; `remap` replaces it with fresh memory
  poisoned     the loss registry (injected faults, host pages and CPU stand-in device pages:
               this kernel cannot poison pages for real); consulted next to the madvise scan,
               counted by `Pool.pending_losses`
  retired      emulated GPU page retirement: the page has no fd any more (see pool.py)

Page epochs (what a pre-attached mapping needs to catch up, `Pool.changes`): `epochs[pid]` is
the `version` at which page `pid`'s physical memory last changed *under the same state* -- a
remap gave it a fresh fd, an emulated GPU retirement dropped its fd, a restart found no kept
fd for it.  A client that mapped a state at version v re-imports exactly the pages whose epoch
is > v.  A state's `uid` is its first page id (page ids are never reused), so a state released
and re-created under the same name is told apart.  `epoch_floor`: a mapping older than this
must re-import everything (set when a snapshot without epochs was restored).

Calling contract: not thread-safe on its own (the pool holds a lock); `from_snapshot` validates
everything it reads and raises `SnapshotError` rather than guess.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterator

from leto_runtime.wire.geometry import Geometry, GeometryError  # noqa: F401 (re-exported)

SNAPSHOT_VERSION = 1
NAME_RE = re.compile(r"[A-Za-z0-9_.:/@+=-]{1,200}")
DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "bool")
MAX_STATE_BYTES = 1 << 42         # 4 TiB: a sanity bound on requests, far above any GPU


class SnapshotError(ValueError):
    """A keeper snapshot that this state manager cannot trust (version, geometry, shape)."""


def _geometry(d: dict) -> Geometry:
    try:
        return Geometry.from_json(d)
    except GeometryError as e:
        raise SnapshotError(str(e)) from None


@dataclass
class Group:
    id: int                      # pool-wide group number (what `--inject pages:group=G` names)
    first: int                   # index of its first data page in the state
    k: int                       # data pages in this group (<= D)
    p1: list[int]                # tier-1 parity page ids (H1)
    p2: list[int]                # tier-2 parity page ids (H2)

    def to_json(self) -> list:
        return [self.id, self.first, self.k, self.p1, self.p2]


@dataclass
class State:
    name: str
    nbytes: int
    kind: str                    # model | process
    protected: bool
    tier: str                    # device | host (where the data pages live)
    page_bytes: int
    dtype: str | None
    shape: list[int] | None
    data: list[int]              # page ids, in address order
    groups: list[Group] = field(default_factory=list)

    @property
    def uid(self) -> int:
        """Stable identity of this incarnation of the state (its first page id, never reused)."""
        return self.data[0]

    def to_json(self) -> dict:
        return {"name": self.name, "nbytes": self.nbytes, "kind": self.kind,
                "protected": self.protected, "tier": self.tier, "page_bytes": self.page_bytes,
                "dtype": self.dtype, "shape": self.shape, "data": self.data,
                "groups": [g.to_json() for g in self.groups]}


@dataclass
class Flags:
    failed: bool = False
    needs_remap: bool = False
    poisoned: bool = False
    retired: bool = False

    def any(self) -> bool:
        return self.failed or self.needs_remap or self.poisoned or self.retired

    def to_json(self) -> str:
        return "".join(c for c, on in zip("fnpr", (self.failed, self.needs_remap, self.poisoned,
                                                   self.retired)) if on)

    @classmethod
    def from_json(cls, s: str) -> "Flags":
        if not isinstance(s, str) or set(s) - set("fnpr"):
            raise SnapshotError(f"bad page flags {s!r}")
        return cls("f" in s, "n" in s, "p" in s, "r" in s)


@dataclass(frozen=True)
class Where:
    """Where a page sits: `role` data (index in the state) or p1/p2 (index in group `group`)."""

    state: str
    role: str                    # data | p1 | p2
    index: int
    group: int | None            # group *position* in the state (0-based), None for unprotected data
    tier: str                    # device | host

    def describe(self) -> dict:
        return {"state": self.state, "role": self.role, "index": self.index, "group": self.group,
                "tier": self.tier}


def pages_needed(nbytes: int, page_bytes: int) -> int:
    return max(1, math.ceil(nbytes / page_bytes))


class PoolMeta:
    """All metadata of one pool.  `version` counts mutations (the keeper keeps the newest)."""

    def __init__(self, geometry: Geometry, device_page_bytes: int):
        self.geometry = geometry
        self.device_page_bytes = device_page_bytes
        self.states: dict[str, State] = {}
        self.flags: dict[int, Flags] = {}
        self.where: dict[int, Where] = {}
        self.next_page = 1
        self.next_group = 0
        self.version = 0
        self.epochs: dict[int, int] = {}   # page id -> version of its last memory change
        self.epoch_floor = 0               # mappings older than this re-import everything

    # ---- construction ----------------------------------------------------------------------
    def new_page_id(self) -> int:
        pid = self.next_page
        self.next_page += 1
        return pid

    def page_bytes(self, tier: str) -> int:
        return self.device_page_bytes if tier == "device" else self.geometry.page_bytes

    def page_counts(self, nbytes: int, tier: str, protected: bool) -> tuple[int, int]:
        """(data pages, parity pages) `plan_state` would create for these arguments, in O(1):
        what a request is checked against before any page id exists."""
        n = pages_needed(nbytes, self.page_bytes(tier))
        g = self.geometry
        return n, (-(-n // g.data_pages) * (g.tier1 + g.tier2) if protected else 0)

    def plan_state(self, name: str, nbytes: int, kind: str, protected: bool, tier: str,
                   dtype: str | None, shape: list[int] | None) -> State:
        """A new State with fresh page and group ids (not yet added; `add_state` does).
        Its work and memory grow with `nbytes`: check `page_counts` first."""
        page = self.page_bytes(tier)
        n = pages_needed(nbytes, page)
        st = State(name, nbytes, kind, protected, tier, page, dtype, shape,
                   [self.new_page_id() for _ in range(n)])
        if protected:
            D, H1, H2 = self.geometry.data_pages, self.geometry.tier1, self.geometry.tier2
            for first in range(0, n, D):
                st.groups.append(Group(self.next_group, first, min(D, n - first),
                                       [self.new_page_id() for _ in range(H1)],
                                       [self.new_page_id() for _ in range(H2)]))
                self.next_group += 1
        return st

    def add_state(self, st: State) -> None:
        self.states[st.name] = st
        self._index_state(st)
        self.version += 1

    def remove_state(self, name: str) -> list[int]:
        st = self.states.pop(name)
        ids = list(self.page_ids(st))
        for pid in ids:
            self.where.pop(pid, None)
            self.flags.pop(pid, None)
            self.epochs.pop(pid, None)
        self.version += 1
        return ids

    def touch(self, pids) -> int:
        """Record that the memory behind `pids` changed: one new version, their epoch."""
        self.version += 1
        for pid in pids:
            if pid in self.where:
                self.epochs[pid] = self.version
        return self.version

    def changed_since(self, st: State, version: int) -> list[int] | None:
        """Page ids of `st` whose memory changed after `version`; None: re-import everything."""
        if version < self.epoch_floor:
            return None
        # whichever is smaller: the pool's page history or the state's pages, so that a
        # request naming every state costs at most the pool's size
        if len(self.epochs) <= len(st.data):
            return [pid for pid, v in self.epochs.items()
                    if v > version and self.where[pid].state == st.name]
        return [pid for pid in self.page_ids(st) if self.epochs.get(pid, -1) > version]

    def _index_state(self, st: State) -> None:
        covered = set()
        for gi, g in enumerate(st.groups):
            covered.update(range(g.first, g.first + g.k))
            for role, ids in (("p1", g.p1), ("p2", g.p2)):
                for i, pid in enumerate(ids):
                    self.where[pid] = Where(st.name, role, i, gi, "host")
        gi_of = {}
        for gi, g in enumerate(st.groups):
            for i in range(g.first, g.first + g.k):
                gi_of[i] = gi
        for i, pid in enumerate(st.data):
            self.where[pid] = Where(st.name, "data", i, gi_of.get(i), st.tier)
        if st.protected and covered != set(range(len(st.data))):
            raise SnapshotError(f"state {st.name!r}: groups do not cover its pages exactly")

    # ---- queries ---------------------------------------------------------------------------
    @staticmethod
    def page_ids(st: State) -> Iterator[int]:
        yield from st.data
        for g in st.groups:
            yield from g.p1
            yield from g.p2

    def all_page_ids(self) -> list[int]:
        return [pid for st in self.states.values() for pid in self.page_ids(st)]

    def flag(self, pid: int) -> Flags:
        f = self.flags.get(pid)
        if f is None:
            f = self.flags[pid] = Flags()
        return f

    def clean_flags(self) -> None:
        for pid in [p for p, f in self.flags.items() if not f.any()]:
            del self.flags[pid]

    def group_by_id(self, gid: int) -> tuple[State, int, Group]:
        for st in self.states.values():
            for gi, g in enumerate(st.groups):
                if g.id == gid:
                    return st, gi, g
        raise KeyError(gid)

    def marks(self, st: State) -> dict:
        """Failure marks of one state: {"data": [i], "p1": {gi: [i]}, "p2": {gi: [i]}, ...}."""
        out: dict = {"data": [], "p1": {}, "p2": {}, "unmapped": []}
        if len(self.flags) <= len(st.data):        # the cheaper walk, as in changed_since
            flagged = list(self.flags.items())
        else:
            flagged = [(pid, self.flags[pid]) for pid in self.page_ids(st) if pid in self.flags]
        for pid, f in flagged:
            w = self.where.get(pid)
            if w is None or w.state != st.name:
                continue
            if f.needs_remap or f.retired:
                out["unmapped"].append([w.role, w.group, w.index])
            if not f.failed:
                continue
            if w.role == "data":
                out["data"].append(w.index)
            else:
                out[w.role].setdefault(str(w.group), []).append(w.index)
        out["data"].sort()
        for role in ("p1", "p2"):
            for v in out[role].values():
                v.sort()
        out["unmapped"].sort(key=lambda x: (x[0], -1 if x[1] is None else x[1], x[2]))
        return out

    # ---- snapshot --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        self.clean_flags()
        return {"snapshot_version": SNAPSHOT_VERSION, "version": self.version,
                "geometry": self.geometry.to_json(), "device_page_bytes": self.device_page_bytes,
                "next_page": self.next_page, "next_group": self.next_group,
                "states": [st.to_json() for st in self.states.values()],
                "flags": {str(pid): f.to_json() for pid, f in self.flags.items()},
                "epochs": {str(pid): v for pid, v in self.epochs.items()},
                "epoch_floor": self.epoch_floor}

    @classmethod
    def from_snapshot(cls, d: dict) -> "PoolMeta":
        if not isinstance(d, dict) or d.get("snapshot_version") != SNAPSHOT_VERSION:
            raise SnapshotError(f"snapshot version {d.get('snapshot_version') if isinstance(d, dict) else d!r}"
                                f" is not {SNAPSHOT_VERSION}")
        try:
            meta = cls(_geometry(d["geometry"]), int(d["device_page_bytes"]))
            meta.next_page, meta.next_group = int(d["next_page"]), int(d["next_group"])
            meta.version = int(d["version"])
            for s in d["states"]:
                groups = [Group(int(g[0]), int(g[1]), int(g[2]), [int(x) for x in g[3]],
                                [int(x) for x in g[4]]) for g in s["groups"]]
                st = State(str(s["name"]), int(s["nbytes"]), str(s["kind"]), bool(s["protected"]),
                           str(s["tier"]), int(s["page_bytes"]), s["dtype"], s["shape"],
                           [int(x) for x in s["data"]], groups)
                if st.name in meta.states:
                    raise SnapshotError(f"state {st.name!r} appears twice")
                meta.states[st.name] = st
                meta._index_state(st)
            for k, v in d["flags"].items():
                if int(k) in meta.where:
                    meta.flags[int(k)] = Flags.from_json(v)
            if "epochs" in d:
                for k, v in d["epochs"].items():
                    if int(k) in meta.where:
                        meta.epochs[int(k)] = int(v)
                meta.epoch_floor = int(d.get("epoch_floor", 0))
            else:                  # an older snapshot: no page history, so nothing is current
                meta.version += 1
                meta.epoch_floor = meta.version
        except SnapshotError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise SnapshotError(f"malformed snapshot: {type(e).__name__}: {e}") from None
        ids = meta.all_page_ids()
        if len(ids) != len(set(ids)) or (ids and max(ids) >= meta.next_page):
            raise SnapshotError("page ids repeat or exceed next_page")
        return meta
