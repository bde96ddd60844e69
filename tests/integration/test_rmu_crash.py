"""RMU transactions and repair with real processes and real SIGKILLs, without the launcher.

A worker (scripts/rmu_worker.py) runs AdamW iterations on retained state in a real state
manager and kills itself at one operation of Pseudocode 1 -- optionally after destroying pages
(16 data pages of the group being updated + 1 host tier-1 parity page: the tolerance) and
scribbling over the chunk and the scratch parity (a kill inside a kernel).  A second worker
recovers (localize, remap, marker, resume point, repair, finish) and trains to the end.  The
oracle is the same iterations on ordinary tensors with no fault: model and optimizer state must
match bit for bit, and every group's parity must match its data.  The ablation (transactions
off) shows the same kill makes the run diverge.

Each worker is a fresh process forked from one that already imported torch and leto_runtime
(`leto_forkserver.ForkServer`): its own pid, memory and fds, SIGKILLed for real, but without the
~2 s import that 90 workers would each pay.  LETO_FORKSERVER=0 starts every worker with
`python` instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from leto_run.state_manager import Geometry
from leto_run.state_manager.harness import SlotHarness
from leto_runtime.rmu.states import QBUFS
from leto_forkserver import ForkServer

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "scripts", "rmu_worker.py")
TOTAL = 5
GEO = Geometry(32, 16, 1, 4096)
ROW16 = {"tier": "device", "count": 16, "first": 8, "gindex": 1}         # a DRAM row, group 1
P1 = {"tier": "host", "part": "p1", "count": 1, "first": 5, "gindex": 1}
# Rows 0-1 of params' authoritative Q of group 1 at chunk 3's commit (auth 1 after three
# commits), where StateSet.q_first puts them
QROWS = {"tier": "device", "count": 2, "first": (2 * 1 + 1) % QBUFS * 16, "state": "leto/rmu/parity"}
# ... and of group 0's buffer 0 (authoritative after its 8 chunks: the write-back's source)
QROWS_G0 = {**QROWS, "first": 0}


PRELOAD = ["torch", "numpy", "leto_runtime.rmp.client", "leto_runtime.rmu.adamw",
           "leto_runtime.rmu.recovery", "leto_runtime.rmu.states", "leto_runtime.rmu.updater"]
_SERVER: list[ForkServer] = []


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    if os.environ.get("LETO_FORKSERVER", "1") != "0":
        _SERVER.append(ForkServer(PRELOAD, env=_env()))
    yield
    while _SERVER:
        _SERVER.pop().close()


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(HERE)))


def run(sock, plan, *extra, allow=None):
    args = [sock, str(TOTAL), json.dumps(plan), *extra]
    if _SERVER:
        rc, out, err = _SERVER[0].run(WORKER, args, _env(), timeout=180, on_start=allow)
    else:
        p = subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
        if allow:
            allow(p.pid)
        out, err = p.communicate(timeout=180)
        rc = p.returncode
    return rc, (json.loads(out.strip().splitlines()[-1]) if rc == 0 else None), err


@pytest.fixture(scope="module")
def reference():
    rc, res, err = run("-", [], "--local")
    assert rc == 0, err
    REFERENCE_PARTS[:] = res["parts"]
    return res["digest"]


REFERENCE_PARTS: list = []      # the fault-free run's per-state, per-group digests


def differing_parts(res) -> list:
    """(state, group) pairs whose final contents differ from the fault-free run's."""
    return [(i, g) for i, (a, b) in enumerate(zip(res["parts"], REFERENCE_PARTS))
            for g, (x, y) in enumerate(zip(a, b)) if x != y]


CASES = {
    "grads.protect": ({"at": "grads.protect", "step": 2}, "redo"),
    "sync.after": ({"at": "sync.after", "step": 2}, "finish"),
    "rmu.load": ({"at": "rmu.load", "step": 2, "group": 1}, "finish"),
    "rmu.undo": ({"at": "rmu.undo", "step": 2, "group": 0, "chunk": 3}, "finish"),
    "rmu.update+garbage": ({"at": "rmu.update", "step": 2, "group": 1, "chunk": 2,
                            "garbage": True}, "finish"),
    "rmu.delta+garbage": ({"at": "rmu.delta", "step": 3, "group": 1, "chunk": 5,
                           "garbage": True}, "finish"),
    "rmu.commit": ({"at": "rmu.commit", "step": 1, "group": 2, "chunk": 1}, "finish"),
    "rmu.writeback": ({"at": "rmu.writeback", "step": 2, "group": 1}, "finish"),
    "rmu.tier2": ({"at": "rmu.tier2", "step": 2, "group": 0}, "finish"),
    "rmu.done": ({"at": "rmu.done", "step": 2}, "finish"),
    # the update queued to its end, DONE among it (in memory on CPU): nothing left to finish
    "rmu.settle": ({"at": "rmu.settle", "step": 2}, "next"),
    "update+pages@tolerance": ({"at": "rmu.update", "step": 2, "group": 1, "chunk": 3,
                                "garbage": True, "pages": [ROW16, P1]}, "finish"),
    "writeback+pages@tolerance": ({"at": "rmu.writeback", "step": 3, "group": 1,
                                   "pages": [ROW16, P1]}, "finish"),
    "commit+marker page lost": ({"at": "rmu.commit", "step": 2, "group": 1, "chunk": 3,
                                 "pages": [{"tier": "host", "part": "data", "count": 1,
                                            "state": "leto/marker", "gindex": 0}]}, "finish"),
    # the authoritative parity buffer Q of the group being updated loses two rows (unprotected
    # device memory: recovery re-derives them from the group's committed data)
    "commit+auth Q rows lost": ({"at": "rmu.commit", "step": 2, "group": 1, "chunk": 3,
                                 "pages": [QROWS]}, "finish"),
    # a DRAM row of group 0 (its update done; with the write-back overlap its write-back may
    # still be under way) lost while group 1's chunks run
    "update+done group pages@tolerance": ({"at": "rmu.update", "step": 2, "group": 1, "chunk": 0,
                                           "garbage": True, "pages": [{**ROW16, "gindex": 0},
                                                                      {**P1, "gindex": 0}]}, "finish"),
    "compute+pages@tolerance": ({"at": "step", "step": 3, "pages": [ROW16, P1,
                                 {**ROW16, "state": "leto/exp_avg_sq", "gindex": 0}]}, "redo"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kill_at_rmu_operation_is_bit_exact(case, reference):
    kill_and_recover(case, CASES[case], reference)


def kill_and_recover(case, spec, reference):
    """One worker killed at `spec`'s point, a second one recovering and training to the end:
    resumed as the case says, bit-identical to the fault-free run, every parity consistent
    right after the recovery and at the end."""
    point, action = spec
    with SlotHarness(device="cpu", geometry=GEO, allow_wait=10) as h:
        rc, _, err = run(h.socket, [point], allow=h.allow)
        # (the scribbling comes first, then the page loss: no SIGBUS)
        assert rc == -9, err
        rc1, err1 = rc, err
        rc, res, err = run(h.socket, [], allow=h.allow)
        assert rc == 0, err
    assert res["resume"][0] == action and res["resume"][1] == point["step"], res
    # (what a rare failure needs to be understood: both workers' exits and the recovery's figures)
    assert res["digest"] == reference, (f"{case}: state differs from the fault-free run in (state, "
                                        f"group) {differing_parts(res)}; first worker exit {rc1}, "
                                        f"recovery {res}; stderr:\n{err1[-2000:]}\n---\n{err[-3000:]}")
    assert res["parity_problems"] == [] and res["parity_after_recovery"] == []
    if ROW16 in point.get("pages", []):
        assert res["repaired"] >= 16      # + the tier-1 page (rebuilt, or rewritten by the write-back)


# Two undo slots (LETO_RMU_UNDO_PIPELINE=1; on CPU the slots alternate in line): the kills whose
# uncommitted chunk is an odd one of the update (group 1's chunks start at 8: chunks 3 and 5 use
# slot 1), so recovery must restore it from the slot the marker names (sub = 2), and one in
# slot 0.
SLOT_CASES = {
    # the uncommitted chunk is in slot 1 (sub = 2) and one of its undo pages is lost
    "slot 1 undo page lost": ({"at": "rmu.update", "step": 2, "group": 1, "chunk": 3, "garbage": True,
                               "pages": [{"tier": "device", "count": 1, "first": 3 * 4 + 1,
                                          "state": "leto/rmu/undo"}]}, "finish"),
}


@pytest.mark.parametrize("case,overlap", [
    *[(c, "0") for c in ("rmu.update+garbage", "rmu.delta+garbage", "update+pages@tolerance", *SLOT_CASES)],
    ("rmu.delta+garbage", "1"), (next(iter(SLOT_CASES)), "1")])      # both options together
def test_kill_with_two_undo_slots_is_bit_exact(case, overlap, reference, monkeypatch):
    monkeypatch.setenv("LETO_RMU_UNDO_PIPELINE", "1")
    monkeypatch.setenv("LETO_RMU_WB_OVERLAP", overlap)      # and both options together
    kill_and_recover(case, {**CASES, **SLOT_CASES}[case], reference)


# The write-back overlap (the default since 2026-11-30; on CPU the write-back runs in line, the
# marker protocol is the same): kills while the marker names a group's write-back as possibly
# under way -- at the write-back and tier 2 themselves (CASES above), in the next group's chunks
# with pages of either group lost, at the drop, and before DONE.
WB_CASES = {   # points where the marker names group 0's (or 2's) write-back, and just after
    "wb pending: Q rows + data of group 0": ({"at": "rmu.update", "step": 2, "group": 1, "chunk": 0,
                                              "garbage": True, "pages": [QROWS_G0, {**ROW16, "gindex": 0,
                                                                                   "count": 14}]}, "finish"),
    "wb drop + group 0 pages": ({"at": "rmu.writeback.drop", "step": 2, "group": 0,
                                 "pages": [{**ROW16, "gindex": 0}]}, "finish"),
    "after the drop: undo + group 0 pages": ({"at": "rmu.undo", "step": 2, "group": 1, "chunk": 1,
                                              "pages": [{**ROW16, "gindex": 0}, {**P1, "gindex": 0}]}, "finish"),
    "done + last group pages": ({"at": "rmu.done", "step": 3, "pages": [
        {**ROW16, "gindex": 2, "count": 7, "first": 0}, {**P1, "gindex": 2}]}, "finish"),
    "commit of the first chunk after a group": ({"at": "rmu.commit", "step": 1, "group": 1, "chunk": 0}, "finish"),
}


# WB_CASES need the overlap (the marker must name a pending write-back); the in-line write-back
# (LETO_RMU_WB_OVERLAP=0, the default until 2026-11-30) keeps the kill points around it.
@pytest.mark.parametrize("case,overlap", [
    *[(c, "1") for c in WB_CASES],
    *[(c, "0") for c in ("rmu.writeback", "rmu.tier2", "rmu.load", "writeback+pages@tolerance",
                         "update+done group pages@tolerance", "rmu.done")]])
def test_kill_with_and_without_the_write_back_overlap_is_bit_exact(case, overlap, reference, monkeypatch):
    monkeypatch.setenv("LETO_RMU_WB_OVERLAP", overlap)
    kill_and_recover(case, {**CASES, **WB_CASES}[case], reference)


# The folded chunk (LETO_RMU_FOLD=1, leto_runtime/rmu/fold.py): the undo copy made inside the
# chunk's update, per-unit stage counts (two copies, pages 24 and 25 of the undo state with
# 4-page chunks) tell recovery what to restore.  "garbage" is then what a kill inside the folded
# kernel leaves: random counts, the undo copy of the counted stages, the rest torn.
UNDO_PAGE = {"tier": "device", "count": 1, "state": "leto/rmu/undo"}
COUNTS0, COUNTS1 = {**UNDO_PAGE, "first": 6 * 4}, {**UNDO_PAGE, "first": 6 * 4 + 1}
FOLD_CASES = {
    "fold: counts copy 0 lost": ({"at": "rmu.update", "step": 2, "group": 1, "chunk": 2, "garbage": True,
                                  "pages": [COUNTS0]}, "finish"),
    "fold: counts copy 1 lost + row": ({"at": "rmu.update", "step": 3, "group": 0, "chunk": 5, "garbage": True,
                                        "pages": [COUNTS1, {**ROW16, "gindex": 0}]}, "finish"),
    # both copies: the chunk's 4 pages per state become erasures, decoded from Q
    "fold: both counts lost": ({"at": "rmu.update", "step": 2, "group": 1, "chunk": 2, "garbage": True,
                                "pages": [COUNTS0, COUNTS1]}, "finish"),
    # ... and with a DRAM row over the chunk: still 16 erasures
    "fold: both counts lost + row over the chunk": ({"at": "rmu.update", "step": 2, "group": 1, "chunk": 3,
                                                     "garbage": True, "pages": [COUNTS0, COUNTS1, ROW16]}, "finish"),
    # an undo page of exp_avg (state 1, chunk page 2) lost: that page is an erasure
    "fold: undo page lost": ({"at": "rmu.update", "step": 2, "group": 2, "chunk": 1, "garbage": True,
                              "pages": [{**UNDO_PAGE, "first": 4 + 2}]}, "finish"),
}


@pytest.mark.parametrize("case", ["rmu.undo", "rmu.update+garbage", "rmu.delta+garbage", "rmu.commit",
                                  "update+pages@tolerance", "sync.after", *FOLD_CASES])
def test_kill_with_the_folded_chunk_is_bit_exact(case, reference, monkeypatch):
    monkeypatch.setenv("LETO_RMU_FOLD", "1")
    kill_and_recover(case, {**CASES, **FOLD_CASES}[case], reference)


def test_folded_chunk_with_its_counts_and_too_many_pages_lost_is_unrecoverable(monkeypatch):
    """Both copies of the counts and a row beside the chunk: 4 + 16 erasures in one group, more
    than its 16 parity pages: recovery stops before writing anything and says why."""
    monkeypatch.setenv("LETO_RMU_FOLD", "1")
    with SlotHarness(device="cpu", geometry=GEO, allow_wait=10) as h:
        kill = {"at": "rmu.update", "step": 2, "group": 1, "chunk": 0, "garbage": True,
                "pages": [COUNTS0, COUNTS1, ROW16]}
        assert run(h.socket, [kill], allow=h.allow)[0] == -9
        rc, res, err = run(h.socket, [], allow=h.allow)
    assert rc != 0 and "Unrecoverable" in err and "tolerance 16" in err
    assert "stage counts were lost" in err


@pytest.mark.parametrize("point", ["recovery.reconstruct", "recovery.finish"])
def test_second_crash_during_recovery_is_bit_exact(point, reference):
    with SlotHarness(device="cpu", geometry=GEO, allow_wait=10) as h:
        first = {"at": "rmu.update", "step": 2, "group": 1, "chunk": 4, "garbage": True,
                 "pages": [ROW16]}
        assert run(h.socket, [first], allow=h.allow)[0] == -9
        again = {"at": point, "step": 2}     # before repairing / after it, before finishing
        assert run(h.socket, [again], allow=h.allow)[0] == -9
        rc, res, err = run(h.socket, [], allow=h.allow)
        assert rc == 0, err
    assert res["digest"] == reference, (f"differs in (state, group) {differing_parts(res)}; "
                                        f"recovery {res}; stderr:\n{err[-3000:]}")


def test_more_losses_than_tolerated_is_unrecoverable_and_writes_nothing():
    with SlotHarness(device="cpu", geometry=GEO, allow_wait=10) as h:
        row17 = {**ROW16, "count": 17, "first": 2}
        assert run(h.socket, [{"at": "sync.after", "step": 1, "pages": [row17]}],
                   allow=h.allow)[0] == -9
        rc, res, err = run(h.socket, [], allow=h.allow)
    assert rc != 0 and "Unrecoverable" in err and "tolerance 16" in err


def test_ablation_without_transactions_diverges(reference):
    """Paper Fig. 12: the same kill with RMU's transactions off leaves a state that cannot be
    brought back to the fault-free one."""
    with SlotHarness(device="cpu", geometry=GEO, allow_wait=10) as h:
        kill = {"at": "rmu.update", "step": 2, "group": 1, "chunk": 2, "garbage": True}
        assert run(h.socket, [kill], "--no-transactions", allow=h.allow)[0] == -9
        rc, res, err = run(h.socket, [], "--no-transactions", allow=h.allow)
        assert rc == 0, err
    assert res["digest"] != reference
    # and the transactional run of the same schedule is exact (test above, rmu.update+garbage)
