"""The folded chunk's recovery rules (leto_runtime/rmu/fold.py) against a simulation of the
kernel's store order written out here (cuda/adamw_ws.cu, fold with counts): per unit, stage by
stage, the undo copy, the count, and the previous stage's new values -- stopped anywhere."""
from __future__ import annotations

import pytest
import torch

from leto_runtime.rmu import fold as FD


def kernel_stages(n: int) -> list[list[int]]:
    """The pages of each stage as the kernel runs them (page_of(s, p) = n_pad-1-(2s+p))."""
    n_pad = (n + 15) // 16 * 16
    return [[n_pad - 1 - (2 * s + p) for p in range(2) if n_pad - 1 - (2 * s + p) < n] for s in range(n_pad // 2)]


def test_stage_of_each_page_is_the_kernel_s():
    for n in (1, 2, 3, 15, 16, 17, 31, 256, 257):
        want = [None] * n
        for s, pages in enumerate(kernel_stages(n)):
            for p in pages:
                want[p] = s
        assert FD.stage_of_pages(n).tolist() == want
        assert FD.n_stages(n) == len(kernel_stages(n))


def test_units_cover_the_page_in_512_byte_columns_of_2_kib_tiles():
    assert FD.units(2 << 20) == 4096 and FD.units(4096) == 8
    assert FD.units(13 << 10) == 28          # 13 blocks of 1 KiB: 7 tiles (the last half-empty)
    assert FD.units(13 << 10) * FD.UNIT_BYTES >= 13 << 10


def test_tags_name_one_transaction_and_never_zero():
    tags = {FD.tag(t, i, 50) for t in range(4) for i in range(50)}
    assert len(tags) == 200 and 0 not in tags
    assert FD.tag(0, 0, 1) != 0
    # a model of more than 2^16 chunks (small pages): still one tag per transaction
    assert len({FD.tag(t, i, 1 << 17) for t in (0, 1) for i in (0, 1, (1 << 17) - 1)}) == 6
    with pytest.raises(FD.FoldError, match="outside the update's 50 chunks"):
        FD.tag(1, 50, 50)


def _stop_kernel(before, n, S, progress, torn, gen):
    """The kernel's stores per unit u up to `progress[u]` = (k, phase): stages < k fully done
    (undo copy, count, new values of stages < k-1), then in stage k the undo copy torn (phase
    0), or stage k's undo copy done, the count k+1 stored and stage k-1's new values torn
    (phase 1).  Returns the chunk,
    the undo buffer and the visible counts."""
    chunk = before.clone()
    undo = torch.randint(0, 256, before.shape, generator=gen, dtype=torch.uint8)   # the previous chunk's
    new = torch.randint(0, 256, before.shape, generator=gen, dtype=torch.uint8)
    counts = torch.zeros(FD.units(S), dtype=torch.int64)
    stages = kernel_stages(n)
    for u, (k, phase) in enumerate(progress):
        lo, hi = u * FD.UNIT_BYTES, min(S, (u + 1) * FD.UNIT_BYTES)
        if lo >= S:
            continue
        for s in range(min(k, len(stages))):
            for p in stages[s]:
                undo[p, lo:hi] = before[p, lo:hi]
            counts[u] = s + 1
            if s >= 1:
                for p in stages[s - 1]:
                    chunk[p, lo:hi] = new[p, lo:hi]
        if k < len(stages):
            if phase == 0:               # stage k's undo stores under way
                for p in stages[k]:
                    undo[p, lo:lo + torn] = before[p, lo:lo + torn]
            else:                        # stage k's undo copy done, count k+1 stored, and
                for p in stages[k]:      # stage k-1's new values under way
                    undo[p, lo:hi] = before[p, lo:hi]
                counts[u] = k + 1
                for p in stages[k - 1] if k >= 1 else []:
                    chunk[p, lo:lo + torn] = new[p, lo:lo + torn]
        elif k >= 1:                     # after the loop: the last stage's new values under way
            for p in stages[k - 1]:
                chunk[p, lo:lo + torn] = new[p, lo:lo + torn]
    return chunk, undo, counts


@pytest.mark.parametrize("n,S", [(4, 4096), (17, 2048), (32, 8192), (3, 13 << 10)])
def test_restoring_by_the_counts_gives_the_values_before_the_kernel_wherever_it_stopped(n, S):
    gen = torch.Generator().manual_seed(n * S)
    before = torch.randint(0, 256, (n, S), generator=gen, dtype=torch.uint8)
    u = FD.units(S)
    full = FD.n_stages(n)
    for trial in range(20):
        progress = [(int(torch.randint(0, full + 1, (1,), generator=gen)), int(torch.randint(0, 2, (1,), generator=gen)))
                    for _ in range(u)]
        chunk, undo, counts = _stop_kernel(before, n, S, progress, torn=int(torch.randint(0, 512, (1,), generator=gen)),
                                           gen=gen)
        tg = FD.tag(trial, 3, 8)
        words = [(tg << 16) | counts, (tg << 16) | counts]
        got = FD.read_counts(words, tg, n)
        assert torch.equal(got, counts)
        FD.restore_(chunk, undo, FD.restore_mask(got, n, S))
        assert torch.equal(chunk, before), f"trial {trial}: progress {progress}"


def test_counts_of_another_transaction_read_as_none_and_a_lost_copy_falls_back():
    tg, n = FD.tag(7, 2, 8), 8
    mine = torch.tensor([(tg << 16) | 3, ((tg - 1) << 16) | 8, (tg << 16) | 8, 0])
    assert FD.read_counts([mine], tg, n).tolist() == [3, 0, 8, 0]
    assert FD.read_counts([None, mine], tg, n).tolist() == [3, 0, 8, 0]
    assert FD.read_counts([None, None], tg, n) is None
    with pytest.raises(FD.FoldError, match="not the kernel's"):
        FD.read_counts([torch.tensor([(tg << 16) | 9])], tg, n)        # 8 pages: 8 stages


def test_restore_leaves_erasures_alone():
    n, S = 2, 1024
    chunk = torch.zeros(n, S, dtype=torch.uint8)
    undo = torch.ones(n, S, dtype=torch.uint8)
    mask = torch.ones(n, FD.units(S), dtype=torch.bool)
    assert FD.restore_(chunk, undo, mask, keep=[1]) == 1
    assert bool((chunk[0] == 1).all()) and bool((chunk[1] == 0).all())


def test_the_injected_kill_is_one_the_kernel_can_leave_and_restores():
    """fold.garbage_ (the fault injection) leaves a state the recovery rules bring back."""
    n, S = 5, 4096
    gen = torch.Generator().manual_seed(3)
    before = [torch.randint(0, 256, (n, S), generator=gen, dtype=torch.uint8) for _ in range(3)]
    chunk = [b.clone() for b in before]
    undo = [torch.zeros(n, S, dtype=torch.uint8) for _ in range(3)]
    copies = [torch.zeros(FD.units(S), dtype=torch.int64) for _ in range(2)]
    tg = FD.tag(4, 1, 8)
    FD.garbage_(chunk, undo, copies, tg, gen)
    assert any(not torch.equal(c, b) for c, b in zip(chunk, before))      # it did tear the chunk
    mask = FD.restore_mask(FD.read_counts(copies, tg, n), n, S)
    for c, d in zip(chunk, undo):
        FD.restore_(c, d, mask)
    assert all(torch.equal(c, b) for c, b in zip(chunk, before))


def test_counts_that_are_not_the_kernel_s_stop_the_recovery_before_it_writes(monkeypatch):
    """A count of this transaction above the chunk's stages (corrupt memory, not a lost page):
    recovery does not guess -- RecoveryError (the trainer exits for the checkpoint fallback)
    and the chunk is left as it was."""
    from leto_runtime.rmu.adamw import AdamWConfig
    from leto_runtime.rmu.marker import GState, Phase
    from leto_runtime.rmu.recovery import RecoveryError, repair
    from leto_runtime.rmu.states import Geometry, Layout, open_states
    from leto_runtime.rmu.updater import Updater
    monkeypatch.setenv("LETO_RMU_FOLD", "1")
    geo = Geometry(8, 4, 1, 4096)
    ss = open_states(Layout.of([("w", (20000,))], geo.page_bytes), client=None, geo=geo, device="cpu",
                     chunk_pages=2)
    up = Updater(ss, AdamWConfig(lr=1e-2), backend="cpu")
    assert up.fold
    ss.flat(ss.model[0]).copy_(torch.randn(ss.flat(ss.model[0]).numel(), generator=torch.Generator().manual_seed(1)))
    rec = up.marker.write(t=3, phase=Phase.UPDATING, group=0, chunk=1, sub=FD.FOLD_SUB, auth=0,
                          gstate=GState.CHUNKS)
    tg = FD.tag(3, *ss.chunk_index(0, 1))
    for c in range(2):
        ss.fold_counts(c).fill_((tg << 16) | (FD.n_stages(2) + 1))
    before = ss.flat(ss.model[0]).clone()
    with pytest.raises(RecoveryError, match="not the kernel's"):
        repair(ss, rec, need_grads=False, updater=up, backend="cpu")
    assert torch.equal(ss.flat(ss.model[0]), before)


def test_the_fold_batch_knob_takes_1_or_4_and_names_itself_otherwise():
    """LETO_RMU_FOLD_BATCH: the folded kernel's stages per count.  The updater's build has 1 and
    4 (cuda/adamw_ws.cu); anything else is refused before a kernel could be asked for it."""
    from leto_runtime.wire import settings as S
    assert S.Settings.from_env({}).rmu_fold_batch == "1"
    assert S.Settings.from_env({"LETO_RMU_FOLD_BATCH": "4"}).rmu_fold_batch == "4"
    [why] = S.problems({"LETO_RMU_FOLD_BATCH": "2"})
    assert "LETO_RMU_FOLD_BATCH" in str(why) and "1, 4" in str(why), why
