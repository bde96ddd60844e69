"""The folded chunk's promise against a real kill in the middle of its kernel (issue 22, item 4;
leto_runtime/rmu/fold.py): a child process SIGKILLed while the folded kernel runs on memory
this process owns (`benchmarks/fold_kill.py`).  Once the child is reaped nothing moves any more;
in every unit the undo copy is current below the count and the chunk untouched at and above it;
the restore gives the values before the kernel bit for bit; and at least one trial stopped the
kernel half-way (else the test proved nothing about the middle of a kernel)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@pytest.mark.gpu_alone          # the kill's timing against the kernel is the whole GPU's
@pytest.mark.parametrize("batch", [1, 4], ids=["count-every-stage", "count-every-4"])
def test_a_kill_inside_the_folded_kernel_leaves_what_the_counts_say(batch):
    """`batch`: the kernel's stages per count (LETO_RMU_FOLD_BATCH): the same promise."""
    from benchmarks import fold_kill as K
    rows = [K.trial(d, batch=batch) for d in (0.0, 0.002, 0.006, 0.015)]
    for r in rows:
        print(f"\ndelay {r['delay_ms']:.0f} ms: counts {sorted(set(r['counts']))} of {r['stages']}, "
              f"{r['units_touched_pages']} (page, unit) pairs new or torn")
        assert r["exitcode"] == -9 and r["still_after_reap"], r
        assert r["copies_agree"], r
        assert r["undo_current_below_count"] and r["untouched_at_or_above_count"], r
        assert r["restored_bit_exact"], r
    assert any(r["partial"] for r in rows), "no trial stopped the kernel half-way"
