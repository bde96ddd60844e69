"""Page owners and the pool: the memory the state manager holds, as file descriptors only.

Role: everything the state manager does to memory.  `Pool` keeps the metadata (`metadata.py`),
one fd per page, and the link to the agent's fd keeper; every mutation ends in `_commit`, which
hands the keeper duplicates of new fds and the new metadata snapshot *before* the client hears
about it, so a state manager killed at any point restarts with consistent memory and metadata.

Page owners (`pages.py`): memfd pages (host state, parity, the CPU stand-in for device pages)
and CUDA VMM pages held as fds without a context.

Emulated faults (`inject`; docs/MEMORY.md, "Emulated faults" -- the recovery path must not be
able to tell them from real ones).  A loss is atomic, as real poison is: no reader ever sees
half-destroyed contents, only the old bytes or a trap.  Every loss is entered into the loss
registry at once (the flags `poisoned`/`retired`), which localization consults and
`status()["pending_losses"]` counts, so a live trainer learns of it at its next safe point and
repairs it before any use (`leto_runtime.rmu.guard`):
* memfd page (host state, parity, and the CPU stand-in for device pages): the memfd is truncated
  to 0 bytes, so every CPU mapping of it -- a live trainer's too -- traps (SIGBUS) and
  MADV_POPULATE_READ fails with EFAULT (found by a real probe and by the state manager's scan);
  pages pinned for DMA (GPU machines) keep their old physical page until unpinned, as a retired
  GPU page stays behind a live mapping;
* GPU page: the state manager drops its fd and the keeper's (emulated retirement: the physical
  page goes away with the last live mapping); the next importer gets no mapping for that page,
  and cuPointerGetAttribute fails on it.  Live mappings keep working until their process ends:
  a GPU page fault takes effect at the next attach -- or, for a mapping made before the fault
  (a pre-attached shadow), at its `refresh` (the page's epoch moved; it is unmapped there), and
  `localize` marks it lost in any case (the pool holds no memory for it).  CPU tests get this
  emulation for stand-in pages with LETO_SM_FAULT_EMULATION=retire.

Calling contract: every public method is called with `self.lock` held by the server (one
operation at a time); errors are `leto_runtime.wire.protocol` typed errors.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from typing import Callable

from leto_run.state_manager.metadata import NAME_RE, DTYPES, MAX_STATE_BYTES, PoolMeta, State
from leto_run.state_manager.pages import MemfdPages
from leto_runtime.wire import settings
from leto_runtime.wire import protocol as P
from leto_runtime.wire.host_pages import HostMapping

FD_RESERVE = 64 + 2 * P.MAX_FDS_PER_MESSAGE      # sockets, logs and one fd train in flight
# Tests: LETO_SM_FAULT_EMULATION=retire makes CPU stand-in device pages fail as GPU pages do
# (fd dropped, memory alive in live mappings) instead of truncated.
FAULT_EMULATION_ENV = "LETO_SM_FAULT_EMULATION"


class Pool:
    """Metadata + one fd per page + the keeper link.  See the module docstring."""

    def __init__(self, meta: PoolMeta, device, keeper=None, log: Callable[[str], None] = print,
                 bulletin=None):
        self.meta, self.device, self.keeper, self.log = meta, device, keeper, log
        self.bulletin = bulletin                  # leto_runtime.wire.bulletin.Writer, or None
        self.host = MemfdPages("host", sealed=True)
        self.fds: dict[int, int] = {}
        self.scan: dict[str, tuple[HostMapping, list[int]]] = {}   # the SM's view of host pages
        self.scan_epochs: dict[str, int] = {}     # per state: the newest background scan
        self.deferred_scan: threading.Thread | None = None      # the latest one started
        self.lock = threading.RLock()
        self.keeper_ok = keeper is not None
        self.started = time.time()

    # ---- bookkeeping -----------------------------------------------------------------------
    def owner(self, tier: str):
        return self.device if tier == "device" else self.host

    def snapshot(self) -> dict:
        return {"meta": self.meta.snapshot(), "device": self.device.info()}

    def _commit(self, put: dict[int, int] | None = None, drop: list[int] | None = None) -> None:
        """Keeper first (dups of `put`, snapshot, `drop`), then close our fds of `drop`."""
        if self.keeper is not None:
            try:
                self.keeper.commit(put or {}, drop or [], self.snapshot())
                self.keeper_ok = True
            except P.RmpError as e:
                self.keeper_ok = False
                self.log(f"WARNING: fd keeper unreachable ({e}); this memory would not survive "
                         "a state-manager crash")
                if put and isinstance(e, (P.BadFds, P.FdLimit)):
                    raise P.FdLimit(f"the fd keeper could not take {len(put)} more fds: {e}",
                                    e.details if isinstance(e, P.FdLimit) else {})
        for pid in drop or []:
            fd = self.fds.pop(pid, None)
            if fd is not None:
                os.close(fd)

    def _fd_budget(self, more: int) -> None:
        need = len(self.fds) + more + FD_RESERVE
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if need <= soft:
            return
        try:
            P.check_nofile(need, "the state manager")
        except P.FdLimit as e:
            raise P.FdLimit(f"{more} more pages would exceed RLIMIT_NOFILE "
                            f"({len(self.fds)} page fds held): {e.message}",
                            {**e.details, "held": len(self.fds), "limit": e.details["soft"]}) from None

    def _scan_map(self, st: State) -> None:
        ids = ([pid for pid in st.data] if st.tier == "host" else []) + \
              [pid for g in st.groups for pid in g.p1 + g.p2]
        if not ids:
            return
        hm = HostMapping(len(ids), st.page_bytes)
        hm.map_pages((i, os.dup(self.fds[pid])) for i, pid in enumerate(ids) if pid in self.fds)
        self.scan[st.name] = (hm, ids)
        # walked once now, in the background: a localization's first scan of a cold view
        # otherwise pays for building its page tables on the recovery's critical path
        from leto_run.state_manager.localize import scan_later
        scan_later(self, {st.name: (hm, list(range(len(ids))))})

    def restore(self, fds: dict[int, int]) -> list[int]:
        """Adopt the keeper's fds for the current metadata; returns page ids found missing."""
        want = set(self.meta.all_page_ids())
        for pid, fd in fds.items():
            if pid in want:
                self.fds[pid] = fd
            else:
                os.close(fd)                          # a page the last snapshot never recorded
        missing = [p for p in want if p not in self.fds and not self.meta.flag(p).retired]
        for p in missing:
            f = self.meta.flag(p)
            f.failed = f.needs_remap = True
        if missing:
            self.meta.touch(missing)                  # mappings elsewhere must drop them too
        for st in self.meta.states.values():
            self._scan_map(st)
        self._commit(drop=[p for p in fds if p not in want])
        if missing:
            self._announce()
        return missing

    def _announce(self) -> None:
        """Tell live trainers that losses are registered (after they are: see bulletin.py)."""
        if self.bulletin is not None:
            self.bulletin.bump()

    # ---- operations ------------------------------------------------------------------------
    def allocate(self, name: str, nbytes: int, kind: str, protected: bool, tier: str,
                 dtype: str | None, shape: list[int] | None, exist_ok: bool) -> tuple[State, bool]:
        if not NAME_RE.fullmatch(name):
            raise P.BadArgument(f"name {name[:80]!r} must match {NAME_RE.pattern}")
        if not 0 < nbytes <= MAX_STATE_BYTES:
            raise P.BadArgument(f"nbytes={nbytes} must be 1..{MAX_STATE_BYTES}")
        if kind not in P.KINDS or tier not in P.TIERS:
            raise P.BadArgument(f"kind={kind!r} / tier={tier!r}: use {P.KINDS} / {P.TIERS}")
        if dtype is not None and dtype not in DTYPES:
            raise P.BadArgument(f"dtype={dtype!r} is not one of {DTYPES}")
        old = self.meta.states.get(name)
        if old is not None:
            same = (old.nbytes, old.kind, old.protected, old.tier) == (nbytes, kind, protected, tier)
            if not same:
                raise P.SizeMismatch(f"state {name!r} exists with nbytes={old.nbytes} kind={old.kind} "
                                     f"protected={old.protected} tier={old.tier}; asked for "
                                     f"nbytes={nbytes} kind={kind} protected={protected} tier={tier}")
            if not exist_ok:
                raise P.AlreadyExists(f"state {name!r} exists; attach to it by name")
            return old, False
        st = self.meta.plan_state(name, nbytes, kind, protected, tier, dtype, shape)
        ids = list(self.meta.page_ids(st))
        self._fd_budget(len(ids))
        made: dict[int, int] = {}
        try:
            for pid in st.data:
                made[pid] = self.owner(tier).create(st.page_bytes)
            for pid in ids[len(st.data):]:
                made[pid] = self.host.create(st.page_bytes)
            self.fds.update(made)
            self.meta.add_state(st)
            self._scan_map(st)
            self._commit(put=made)
        except BaseException:
            hm = self.scan.pop(name, None)
            if hm is not None:
                hm[0].close()
            for pid, fd in made.items():
                self.fds.pop(pid, None)
                os.close(fd)
            if name in self.meta.states:
                self.meta.remove_state(name)
            raise
        return st, True

    def state(self, name: str) -> State:
        st = self.meta.states.get(name)
        if st is None:
            raise P.UnknownName(f"no retained state named {name[:80]!r}",
                                {"known": sorted(self.meta.states)[:50]})
        return st

    def describe(self, st: State) -> tuple[dict, list[int]]:
        """The attach reply for `st` and the fds to send (data pages, then each group's p1, p2)."""
        fds: list[int] = []

        def slot(pid: int) -> int:
            fd = self.fds.get(pid)
            if fd is None:
                return -1                 # retired (emulated) or lost: no memory to map
            fds.append(fd)
            return len(fds) - 1

        d = {"name": st.name, "nbytes": st.nbytes, "kind": st.kind, "protected": st.protected,
             "tier": st.tier, "page_bytes": st.page_bytes, "dtype": st.dtype, "shape": st.shape,
             "n_pages": len(st.data), "data": [slot(p) for p in st.data],
             "groups": [{"id": g.id, "first": g.first, "k": g.k, "p1": [slot(p) for p in g.p1],
                         "p2": [slot(p) for p in g.p2]} for g in st.groups],
             "marks": self.meta.marks(st), "geometry": self.meta.geometry.to_json(),
             "device": self.device.info(), "uid": st.uid, "version": self.meta.version}
        return d, fds

    def changes(self, mapped: list[tuple[str, int, int]], max_pages: int) -> tuple[dict, list[int]]:
        """What changed for mappings made at `version` (one (name, uid, version) per state);
        at most `max_pages` pages are listed in all (the rest of the states say ``stale``).

        Per state: ``same``; ``changed`` with ``pages`` = [[role, group, index, slot]] (slot:
        position of its current fd in the reply's fd train, -1 = the pool holds no memory for
        it: the mapping must drop it); ``stale`` (more than `max_pages` pages changed, or the
        mapping predates the history: re-attach); ``recreated`` (released and allocated again:
        other pages, re-attach); ``gone`` (released).  `names`: every state in the pool now.
        """
        fds: list[int] = []
        out: dict[str, dict] = {}
        for name, uid, version in mapped:
            st = self.meta.states.get(name)
            if st is None:
                out[name] = {"status": "gone"}
                continue
            if st.uid != uid:
                out[name] = {"status": "recreated"}
                continue
            pids = self.meta.changed_since(st, version)
            if pids is None or len(pids) > max_pages:
                out[name] = {"status": "stale"}
                continue
            max_pages -= len(pids)                 # a budget for the whole reply (its size)
            pages = []
            for pid in sorted(pids):
                w = self.meta.where[pid]
                fd = self.fds.get(pid)
                if fd is not None:
                    fds.append(fd)
                pages.append([w.role, w.group, w.index, -1 if fd is None else len(fds) - 1])
            out[name] = {"status": "changed" if pages else "same", "pages": pages,
                         "marks": self.meta.marks(st)}
        return {"states": out, "names": sorted(self.meta.states),
                "version": self.meta.version}, fds

    def release(self, name: str) -> int:
        st = self.state(name)
        hm = self.scan.pop(name, None)
        if hm is not None:
            hm[0].close()
        ids = self.meta.remove_state(name)
        self._commit(drop=ids)
        return len(ids)

    def localize(self, device_failures: dict[str, list[int]]) -> dict:
        from leto_run.state_manager.localize import localize

        return localize(self, device_failures)

    def remap(self, names: list[str] | None,
              mapped: list[tuple[str, int, int]] = ()) -> tuple[list[dict], list[int], dict]:
        """Fresh physical memory for every page that needs it; returns (entries, new fds,
        current).  `mapped`: the caller's mappings as (name, uid, version); `current` names the
        version each of them matches once it maps these entries (only where nothing else
        changed since its version), so its next `refresh` does not re-import them."""
        todo = [(pid, w) for pid, w in self.meta.where.items()
                if (names is None or w.state in names) and
                (self.meta.flags.get(pid) and self.meta.flags[pid].needs_remap)]
        for n in names or []:
            self.state(n)
        self._fd_budget(len(todo))
        new: dict[int, int] = {}
        try:
            for pid, w in todo:
                st = self.meta.states[w.state]
                new[pid] = self.owner(w.tier).create(st.page_bytes)
        except BaseException:
            for fd in new.values():
                os.close(fd)
            raise
        entries, out = [], []
        for pid, w in todo:
            old = self.fds.pop(pid, None)
            self.fds[pid] = new[pid]
            if old is not None:
                os.close(old)
            f = self.meta.flag(pid)
            f.needs_remap = f.retired = f.poisoned = False
            st = self.meta.states[w.state]
            if not st.protected:
                f.failed = False                   # nothing to rebuild: remapped without contents
            if w.tier == "host" and w.state in self.scan:
                hm, ids = self.scan[w.state]
                hm.map_page(ids.index(pid), os.dup(new[pid]))
            out.append(new[pid])
            entries.append({**w.describe(), "fd": len(out) - 1, "contents": "reconstruct"
                            if st.protected else "undefined"})
        prior = {n: self.meta.changed_since(self.meta.states[n], v)
                 for n, uid, v in mapped if n in self.meta.states
                 and self.meta.states[n].uid == uid}
        v = self.meta.touch([pid for pid, _ in todo])  # other mappings of these pages are stale
        self._commit(put=new)
        done = set(new)
        current = {n: v for n, pids in prior.items() if pids is not None and set(pids) <= done}
        return entries, out, current

    def all_marks(self) -> dict:
        return {n: self.meta.marks(st) for n, st in self.meta.states.items()}

    def clear_marks(self, name: str) -> int:
        st = self.state(name)
        n = 0
        for pid in self.meta.page_ids(st):
            f = self.meta.flags.get(pid)
            if f and f.failed and not f.needs_remap:
                f.failed = False
                n += 1
        self.meta.version += 1
        self._commit()
        return n

    def inject(self, tier: str, count: int, first: int, part: str | None, group: int | None,
               state: str | None) -> dict:
        """Destroy and make unavailable `count` consecutive pages (see module docstring)."""
        part = part or ("data" if tier == "device" else "p1")
        if tier not in P.TIERS or part not in ("data", "p1", "p2") or count < 1 or first < 0:
            raise P.BadArgument(f"inject: tier={tier!r} part={part!r} count={count} first={first}")
        if part != "data" and tier != "host":
            raise P.BadArgument("parity pages live in host memory: use tier=host")
        if group is None and state is None:
            gids = sorted(g.id for st in self.meta.states.values() for g in st.groups
                          if part != "data" or st.tier == tier)
            if not gids:
                raise P.BadArgument("inject: no protection group to inject into; name state=")
            group = gids[0]
        if group is not None:
            try:
                st, gi, g = self.meta.group_by_id(group)
            except KeyError:
                raise P.BadArgument(f"inject: no protection group {group}") from None
            pool_ids = st.data[g.first:g.first + g.k] if part == "data" else getattr(g, part)
        else:
            st = self.state(state)
            if part != "data":
                raise P.BadArgument("inject: parity pages are named by group=G")
            pool_ids = st.data
        if part == "data" and st.tier != tier:
            raise P.BadArgument(f"inject: state {st.name!r} lives in {st.tier} memory, not {tier}")
        ids = pool_ids[first:first + count]
        if len(ids) != count:
            raise P.BadArgument(f"inject: pages {first}..{first + count - 1} of {part} exceed the "
                                f"{len(pool_ids)} available")
        how = self._fault_pages(ids, st)
        if how == "retired":
            self.meta.touch(ids)       # no memory behind them now: mappings elsewhere drop them
        else:
            self.meta.version += 1
        self._commit(drop=[pid for pid in ids if how == "retired"])
        self._announce()
        report = [{**self.meta.where[pid].describe(), "page_id": pid} for pid in ids]
        self.log(f"injected fault: {count} {part} page(s) of state {st.name!r} "
                 f"({tier} memory) destroyed and made unavailable ({how})")
        return {"pages": report, "emulation": how, "tier": tier, "part": part}

    def _fault_pages(self, ids: list[int], st: State) -> str:
        host = self.meta.where[ids[0]].tier == "host"
        if host or (self.device.kind == "memfd" and settings.get().sm_fault_emulation != "retire"):
            for pid in ids:
                # Registered first, then destroyed: a trainer that checks the registry after a
                # read it did before the trap knows the read may be stale.  Truncation is the
                # destruction: it is atomic for every mapping (no reader sees random bytes).
                self.meta.flag(pid).poisoned = True
                if pid in self.fds:
                    os.ftruncate(self.fds[pid], 0)
            return "poison-registry" if host else "truncated"
        for pid in ids:
            self.meta.flag(pid).retired = True        # fd dropped by _commit (ours and the keeper's)
        return "retired"

    def status(self) -> dict:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        by_tier: dict[str, int] = {}
        for st in self.meta.states.values():
            by_tier[st.tier] = by_tier.get(st.tier, 0) + len(st.data) * st.page_bytes
        return {"pid": os.getpid(), "uptime_s": time.time() - self.started,
                "device": self.device.info(), "geometry": self.meta.geometry.to_json(),
                "device_page_bytes": self.meta.device_page_bytes,
                "states": {n: {"nbytes": s.nbytes, "kind": s.kind, "protected": s.protected,
                               "tier": s.tier, "pages": len(s.data), "groups": len(s.groups)}
                           for n, s in self.meta.states.items()},
                "data_bytes": by_tier, "fds_held": len(self.fds), "nofile": [soft, hard],
                "keeper": self.keeper is not None, "keeper_ok": self.keeper_ok,
                "metadata_version": self.meta.version, "cuda_context": False,
                "pending_losses": self.pending_losses()}

    def pending_losses(self) -> int:
        """Pages registered lost (or remapped and not yet rebuilt) that a trainer has not
        repaired: nonzero tells a live trainer to localize and repair before it reads again."""
        return sum(1 for f in self.meta.flags.values() if f.any())
