"""What a promoted trainer does with the retained state before it trains again (docs/RMU.md,
"Recovery: finish, redo, undo").

1. `resume_point(progress)` -- a pure function of every rank's marker summary: if any rank
   passed the global synchronization of the newest iteration T, every rank *finishes* T's
   update from its last committed chunk; otherwise every rank *redoes* T from its start (or
   starts at T+1 when all had completed T).  Anything else is impossible by construction and
   raises `RecoveryError`.
2. `repair(states, record, need_grads)` -- rebuild every failed page from a consistent
   boundary: an uncommitted chunk is restored from the undo buffer first (a folded one where
   its stage counts say its undo copy is current: fold.py); the group being
   updated is decoded against its authoritative parity buffer Q (it encodes the committed
   chunks; the host parity of that group is stale and will be rewritten by the write-back),
   and so is a group whose write-back the marker names as possibly under way (`wb`, against
   buffer `wb_auth`; the resumed update writes it back again first); every other group against
   its host tier-1/tier-2 parity; gradients only when this rank must
   finish an update (otherwise they are recomputed and their parity is stale by design).
   Feasibility is decided for every group before anything is written: more losses than a group
   tolerates raise `leto_runtime.rmp.Unrecoverable` and nothing is overwritten.

`prepare(...)` strings the steps together for a trainer that has just attached: localize and
remap, rebuild and read the marker, initialize a state that never was, agree on the resume
point across ranks, repair, finish the interrupted update.  `leto_runtime.resume` calls it; so do
the RMU crash tests, so they exercise the same sequence.

Calling contract: `repair` runs after `RmpClient.localize()` and `remap()` (and after the marker
itself was reconstructed and read).  It returns a `RepairReport`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from leto_runtime.rmp.reconstruct import (GroupLoss, ReconstructReport, Unrecoverable,
                                          _feasible, _repair_group)
from leto_runtime.rmp.verify import ParityMismatch, decode_checked
from leto_runtime.rmu import fold as FD
from leto_runtime.rmu.marker import GState, Phase, Record
from leto_runtime.rmu.states import MARKER, QBUF, UNDO, StateSet


log = logging.getLogger("leto.rmu")


class RecoveryError(RuntimeError):
    """The ranks' markers contradict the protocol (a bug or foreign state): do not guess."""


@dataclass(frozen=True)
class Progress:
    rank: int
    t: int
    phase: int
    coef_bits: int
    initialized: int
    coef_t: int = -1

    @classmethod
    def of(cls, rank: int, rec: Record) -> "Progress":
        return cls(rank, rec.t, int(rec.phase), rec.coef_bits, rec.initialized, rec.coef_t)

    def to_list(self) -> list[int]:
        return [self.rank, self.t, self.phase, self.coef_bits, self.initialized, self.coef_t]

    @property
    def done(self) -> int:           # last iteration whose update is complete
        return self.t if self.phase == Phase.DONE else self.t - 1

    @property
    def synced(self) -> int:         # last iteration whose global synchronization it passed
        return self.t if self.phase >= Phase.SYNCED else self.t - 1


@dataclass(frozen=True)
class Resume:
    action: str          # start | finish | redo | next
    t: int               # the iteration concerned (finish: the one completed now)
    step: int            # the first iteration the loop runs after recovery
    coef_bits: int
    reason: str


def resume_point(progress: list[Progress]) -> Resume:
    """P = the newest iteration whose global synchronization some rank passed.  Every rank
    completes P (those whose update of P is unfinished finish it from their marker); training
    continues at P + 1 -- redone by the ranks that had already started it."""
    if not progress:
        raise RecoveryError("no rank reported its progress")
    P = max(p.synced for p in progress)
    for p in progress:
        if p.done < P - 1 or (p.done == P - 1 and (p.t != P or p.phase < Phase.PROTECTED)):
            raise RecoveryError(
                f"a rank passed the global synchronization of iteration {P} but rank {p.rank} "
                f"had not protected its gradients of it (t={p.t}, phase={Phase(p.phase).name}): "
                "the markers contradict the protocol")
        if p.t > P + 1:
            raise RecoveryError(f"rank {p.rank} is at iteration {p.t}, past {P + 1}")
    finishers = [p for p in progress if p.done < P]
    started = [p for p in progress if p.t == P + 1]
    if finishers:
        coefs = {p.coef_bits for p in progress if p.coef_t == P}
        if len(coefs) != 1:
            raise RecoveryError(f"the clip coefficient of iteration {P} is "
                                f"{'missing' if not coefs else 'not unique'} in the markers")
        who = next(p for p in progress if p.synced == P)
        return Resume("finish", P, P + 1, coefs.pop(),
                      f"rank {who.rank} passed the global synchronization of iteration {P}: "
                      f"rank(s) {[p.rank for p in finishers]} finish that update from their "
                      f"last committed chunk; training continues at {P + 1}")
    if P < 0 and not started:
        return Resume("start", -1, 0, 0, "no iteration has started yet: training starts at step 0")
    if started:
        return Resume("redo", P + 1, P + 1, 0,
                      f"no rank passed the global synchronization of iteration {P + 1}: every "
                      "rank redoes it from its start")
    return Resume("next", P, P + 1, 0,
                  f"every rank completed iteration {P}: training continues at {P + 1}")


# ---- page repair ------------------------------------------------------------------------
@dataclass
class RepairReport:
    restored_from_undo: int = 0
    repaired: list = field(default_factory=list)     # (state, group, data pages, parity pages, source)
    undefined: int = 0                               # unprotected pages remapped without contents
    seconds: float = 0.0

    @property
    def pages(self) -> int:
        return self.restored_from_undo + sum(r[2] + r[3] for r in self.repaired)


def _lost_unprotected(client) -> tuple[set[int], set[int]]:
    undo, q = set(), set()
    for e in getattr(client, "last_remap", []) if client is not None else []:
        if e.get("role") == "data" and e.get("state") == UNDO:
            undo.add(int(e["index"]))
        elif e.get("role") == "data" and e.get("state") == QBUF:
            q.add(int(e["index"]))
    return undo, q


def current_group(rec: Record, transactions: bool = True) -> int | None:
    """The group whose host parity is stale (being updated), else None."""
    if not transactions or rec.phase != Phase.UPDATING or rec.gstate == GState.LOAD:
        return None
    return rec.group


def pending_writeback(rec: Record, transactions: bool = True) -> int | None:
    """A group whose host parity may be torn by a write-back still under way beside the
    current group (the updater's write-back overlap, its default), else None.  Its buffer `wb_auth` is
    authoritative, as `auth` is for the current group."""
    if not transactions or rec.phase != Phase.UPDATING or rec.wb < 0:
        return None
    return rec.wb


def repair(ss: StateSet, rec: Record, *, need_grads: bool, updater, transactions: bool = True,
           backend: str = "auto") -> RepairReport:
    t0 = time.perf_counter()
    rep = RepairReport()
    client = ss.client
    undo_lost, q_lost = _lost_unprotected(client)
    rep.undefined = len(undo_lost) + len(q_lost)
    H1 = ss.geo.tier1
    cg = current_group(rec, transactions)
    # groups decoded against a parity buffer instead of their host parity, with its index
    by_q = {g: a for g, a in ((cg, rec.auth), (pending_writeback(rec, transactions), rec.wb_auth))
            if g is not None}
    lost = [set(st.marks.data) for st in ss.model]
    # 1. plan: an uncommitted chunk comes back from the undo buffer, then every group's decode
    restore = _undo_restores(ss, rec, cg, undo_lost, lost)
    folded = _fold_restores(ss, rec, cg, undo_lost, lost)
    plans = []          # (kind, state index / st, GroupLoss, extra)
    bad: list[GroupLoss] = []
    for i, st in enumerate(ss.model):
        for g in st.groups:
            d = sorted(p for p in lost[i] if g.first <= p < g.first + g.k)
            if g.index in by_q:
                q0 = ss.q_first(i, by_q[g.index], g.index)
                ql = sorted(r for r in range(H1) if q0 + r in q_lost)
                if not d and not ql:
                    continue
                loss = GroupLoss(st.name, g.id, g.index, d, ql, [], H1)
                (plans.append(("q", i, loss)) if len(d) + len(ql) <= H1 else bad.append(loss))
                continue
            p1, p2 = st.marks.p1.get(g.index, []), st.marks.p2.get(g.index, [])
            if not (d or p1 or p2):
                continue
            loss = GroupLoss(st.name, g.id, g.index, d, list(p1), list(p2), H1)
            (plans.append(("host", st, loss)) if _feasible(st, loss) else bad.append(loss))
    if need_grads:
        st = ss.grads
        for g in st.groups:
            d = [p for p in st.marks.data if g.first <= p < g.first + g.k]
            p1, p2 = st.marks.p1.get(g.index, []), st.marks.p2.get(g.index, [])
            if d or p1 or p2:
                loss = GroupLoss(st.name, g.id, g.index, d, list(p1), list(p2), H1)
                (plans.append(("host", st, loss)) if _feasible(st, loss) else bad.append(loss))
    if bad:
        r = ReconstructReport(unrecoverable=bad, seconds=time.perf_counter() - t0)
        worst = max(bad, key=lambda g: g.erasures)
        raise Unrecoverable(f"{len(bad)} protection group(s) lost more pages than their parity "
                            f"tolerates (e.g. group {worst.index} of {worst.state!r}: "
                            f"{len(worst.data)} data + {len(worst.p1)} parity pages lost, "
                            f"tolerance {worst.tolerance}); nothing was written: recover from "
                            "a checkpoint", r)
    # 2. act
    for i, page, u in restore:
        ss.model[i].pages(page, 1).copy_(ss.undo.pages(u, 1))
    rep.restored_from_undo = len(restore)
    if folded is not None:
        base, count, mask = folded
        for i, st in enumerate(ss.model):
            keep = [q for q in range(count) if base + q in lost[i]]     # erasures: decoded below
            rep.restored_from_undo += FD.restore_(st.pages(base, count), ss.undo_pages(i, count, 0), mask, keep)
    for kind, who, loss in plans:
        if kind == "host":
            _repair_group(who, loss, backend)
            rep.repaired.append((loss.state, loss.index, len(loss.data),
                                 len(loss.p1) + len(loss.p2), "host parity"))
        else:
            _decode_with_q(ss, who, loss, by_q[loss.index], updater)
            rep.repaired.append((loss.state, loss.index, len(loss.data), len(loss.p1),
                                 "RMU parity buffer"))
    updater.fence()
    if client is not None:
        for st in ss.all:
            if st.marks:
                client.clear_marks(st.name)
    rep.seconds = time.perf_counter() - t0
    return rep


def _undo_restores(ss: StateSet, rec: Record, cg: int | None, undo_lost: set[int],
                   lost: list[set[int]]) -> list[tuple[int, int, int]]:
    """(state, data page, undo page) of each page of the uncommitted chunk (the marker says its
    undo copy is complete: `sub` 1 or 2), to restore from the undo buffer; they leave `lost`.
    Pages whose undo copy was lost become erasures in `lost` instead."""
    restore: list[tuple[int, int, int]] = []
    if cg is not None and rec.gstate == GState.CHUNKS and rec.sub in (1, 2):
        first, count = ss.chunks(cg)[rec.chunk]
        base = ss.model[0].groups[cg].first + first
        for i in range(3):
            for q in range(count):
                u = ss.undo_index(i, q, slot=rec.sub - 1)
                if u in undo_lost:
                    lost[i].add(base + q)
                else:
                    restore.append((i, base + q, u))
                    lost[i].discard(base + q)
    return restore


def _fold_restores(ss: StateSet, rec: Record, cg: int | None, undo_lost: set[int],
                   lost: list[set[int]]):
    """The folded chunk in flight (`sub` = FOLD_SUB): (first page, pages, restore mask) from
    its stage counts (fold.py), else None.  A page whose undo page was lost becomes an erasure
    in `lost`; so does every page of the chunk when both copies of the counts were lost."""
    if cg is None or rec.gstate != GState.CHUNKS or rec.sub != FD.FOLD_SUB:
        return None
    first, count = ss.chunks(cg)[rec.chunk]
    base = ss.model[0].groups[cg].first + first
    tg = FD.tag(rec.t, *ss.chunk_index(cg, rec.chunk))
    copies = [None if ss.fold_count_page(c) in undo_lost else ss.fold_counts(c) for c in range(2)]
    try:
        counts = FD.read_counts(copies, tg, count)
    except FD.FoldError as e:           # corrupt evidence: no guess, the checkpoint fallback
        raise RecoveryError(f"the folded chunk {rec.chunk} of group {cg}: {e}") from e
    if counts is None:
        log.warning("leto.rmu: both copies of the folded chunk's stage counts were lost: its %d "
                    "pages per state are erasures", count)
        counts = torch.zeros(FD.units(ss.geo.page_bytes), dtype=torch.int64)
        for i in range(3):
            lost[i].update(range(base, base + count))
    mask = FD.restore_mask(counts, count, ss.geo.page_bytes)
    whole = mask.all(dim=1).tolist()        # pages wholly restored: a loss there does not matter
    for i in range(3):
        for q in range(count):
            if ss.undo_index(i, q, slot=0) in undo_lost:
                lost[i].add(base + q)
            elif whole[q]:
                lost[i].discard(base + q)
    return base, count, mask


def _decode_with_q(ss: StateSet, i: int, loss: GroupLoss, auth: int, updater) -> None:
    """Group `loss.index` of model state i is mid-update: its committed content is encoded by
    the authoritative parity buffer Q (same device as the data)."""
    st = ss.model[i]
    g = st.groups[loss.index]
    rows = list(st.group_pages(loss.index).unbind(0))
    q = list(ss.q(i, auth, loss.index).unbind(0))
    lost_d = [p - g.first for p in loss.data]
    pages = [None if j in lost_d else rows[j] for j in range(g.k)] + \
            [None if r in loss.p1 else q[r] for r in range(len(q))]
    out = {**{j: rows[j] for j in lost_d}, **{g.k + r: q[r] for r in loss.p1}}
    try:        # checked against the syndromes left over; a located corruption corrected
        decode_checked(updater.code(g.k), pages, out, what=f"group {loss.index} of {st.name!r}")
    except ParityMismatch as e:
        raise Unrecoverable(f"{e} (decoded against the RMU parity buffer); recover from a "
                            "checkpoint", ReconstructReport(unrecoverable=[loss])) from e


def _noop(*args, **kwargs) -> None:
    return None


def prepare(ss: StateSet, up, *, rank: int, initialize, gather=None, fire=_noop, phase=_noop,
            transactions: bool = True, backend: str = "auto", restore=None):
    """Initialize (first trainer) or recover (every later one) the states `ss` of updater `up`.

    initialize(): writes the initial values, encodes parity and marks the marker initialized.
    gather(Progress) -> list[Progress]: every rank's progress (one rank: `[mine]`).
    fire(point, step=...): fault injection at `recovery.*` points.  phase(name, seconds, **f):
    the recovery report.  restore(Resume): the optimizer's values of the step finished or run
    next, before it is.  Returns (Resume, RepairReport | None); raises RecoveryError or
    leto_runtime.rmp.Unrecoverable when the state cannot be recovered in place."""
    client = ss.client
    recovering = client is not None and not ss.created
    if recovering:
        from leto_runtime.rmp.reconstruct import reconstruct
        fire("recovery.localize", step=None)
        t0 = time.monotonic()
        loc = client.localize()
        t1 = time.monotonic()
        if any(m.unmapped for m in loc.marks.values()):
            client.remap()
        t2 = time.monotonic()
        reconstruct(client, [MARKER], clear=True, backend=backend)
        # its parts, for the per-1,000-pages figure (issue 22): the device probe, the state
        # manager's share (host scan, marks, the keeper's commit), the remap, the marker
        phase("localize", time.monotonic() - t0, pages=loc.failed(),
              probed=loc.device_pages_probed, probe_s=loc.device_probe_s,
              sm_s=loc.total_s - loc.device_probe_s, host_scanned=loc.host_pages_scanned,
              host_scan_s=loc.host_scan_s, host_deferred=loc.host_deferred,
              commit_s=loc.commit_s, remap_s=t2 - t1, marker_s=time.monotonic() - t2)
    rec = up.marker.read()
    if not rec.initialized:
        initialize()
        rec = up.marker.rec
    t0 = time.monotonic()
    mine = Progress.of(rank, rec)
    res = resume_point(gather(mine) if gather else [mine])
    phase("agree", time.monotonic() - t0, resume=res.action, step=res.t, reason=res.reason)
    if restore is not None:          # the optimizer's values of the step finished or run next
        restore(res)
    rep = None
    if recovering:
        fire("recovery.reconstruct", step=None)
        t0 = time.monotonic()
        need = res.action == "finish" and rec.done_step < res.t
        rep = repair(ss, rec, need_grads=need, updater=up, transactions=transactions,
                     backend=backend)
        phase("reconstruct", time.monotonic() - t0, pages=rep.pages, undo=rep.restored_from_undo,
              undefined=rep.undefined)
    if res.action == "finish":
        fire("recovery.finish", step=res.t)
        t0 = time.monotonic()
        up.resume(res.t, res.coef_bits)
        phase("finish", time.monotonic() - t0, step=res.t)
    return res, rep


def check_consistent(ss: StateSet, updater, states=None) -> list[str]:
    """Every group's host parity matches its data, tier 1 and tier 2 (test/diagnostic helper;
    synchronizes)."""
    problems = []
    for st in states or [*ss.model]:
        for g in st.groups:
            p1 = updater.code(g.k).encode(st.group_pages(g.index)).cpu()
            if not torch.equal(p1, st.tier1(g.index).cpu()):
                problems.append(f"{st.name} group {g.index}: tier-1 parity differs")
            if updater.t2 is not None and not torch.equal(
                    updater.t2.encode(p1), st.tier2(g.index).cpu()):
                problems.append(f"{st.name} group {g.index}: tier-2 parity differs")
    return problems
