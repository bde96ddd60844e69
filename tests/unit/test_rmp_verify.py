"""A decode checked against its leftover syndromes (leto_runtime/rmp/verify.py): the oracle is
the group as it was encoded, before any page was lost or silently corrupted."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from leto_runtime.parity import ParityCode
from leto_runtime.rmp.verify import Checked, ParityMismatch, decode_checked

K, M, S = 12, 6, 1024


def group(seed: int):
    code = ParityCode(K, M, S, backend="reference")
    data = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (K, S), dtype=np.uint8))
    return code, [*data.clone(), *code.encode(data).clone()]


def lose(pages, lost):
    """The pages a repair sees (None: lost) and where the decode writes (fresh garbage)."""
    out = {j: torch.full((S,), 0xA5, dtype=torch.uint8) for j in lost}
    return [None if j in lost else p.clone() for j, p in enumerate(pages)], out


def completed(pages, out):
    return [out[j] if p is None else p for j, p in enumerate(pages)]


def test_no_corruption_rebuilds_exactly():
    code, truth = group(1)
    pages, out = lose(truth, [2, 7, K + 1])
    assert decode_checked(code, pages, out, what="g") == Checked()
    assert all(torch.equal(a, b) for a, b in zip(completed(pages, out), truth))


@pytest.mark.parametrize("victim", [K + 0, K + 4], ids=["parity-row-0", "parity-row-4"])
def test_one_corrupted_parity_row_is_located_and_corrected(victim):
    code, truth = group(2)
    pages, out = lose(truth, [5, 9])
    pages[victim][100] ^= 0x10                 # a flipped bit the scrub has not reached yet
    got = decode_checked(code, pages, out, what="g")
    assert got.corrected == [victim]
    assert all(torch.equal(a, b) for a, b in zip(completed(pages, out), truth))


def test_a_corrupted_data_page_stops_it_may_have_been_used():
    code, truth = group(6)
    pages, out = lose(truth, [5, 9])
    pages[3][100] ^= 0x10
    before = pages[3].clone()
    with pytest.raises(ParityMismatch, match=r"data page\(s\) \[3\].*already have been used"):
        decode_checked(code, pages, out, what="g")
    assert torch.equal(pages[3], before)


def test_unlocatable_corruption_stops_and_leaves_the_survivors_alone():
    code, truth = group(3)
    pages, out = lose(truth, [0, 1])
    for j in (2, 3, 4, 5, 6):                  # 2 erasures + 5 errors at one symbol: > M/2
        pages[j][64] ^= 0xFF
    before = [None if p is None else p.clone() for p in pages]
    with pytest.raises(ParityMismatch, match="disagree"):
        decode_checked(code, pages, out, what="group 3 of 'x'")
    assert all(b is None or torch.equal(p, b) for p, b in zip(pages, before))


def test_too_few_checks_left_to_trust_a_correction():
    code, truth = group(4)
    pages, out = lose(truth, [0, 1, 2, 3])     # 4 erasures of 6: one more leaves a single check
    pages[K + 5][0] ^= 1
    with pytest.raises(ParityMismatch):
        decode_checked(code, pages, out, what="g")


def test_all_syndromes_used_is_reported_unchecked():
    code, truth = group(5)
    pages, out = lose(truth, list(range(M)))
    assert decode_checked(code, pages, out, what="g") == Checked(checked=False)
    assert all(torch.equal(a, b) for a, b in zip(completed(pages, out), truth))
