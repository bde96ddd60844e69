"""The split decode of the RMP's CUDA reconstruction path (leto_runtime/rmp/reconstruct.py,
`split_coefficients`): syndromes over the data survivors mixed by A^-1, plus each surviving
parity page times (A^-1 V), equals ParityCode.decode.  Checked here with the NumPy reference
backend (the same two primitives the CUDA kernels implement); tests/gpu/test_rmp_perf_paths.py
runs the kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from leto_runtime.parity import ParityCode
from leto_runtime.parity.backends import ReferenceBackend
from leto_runtime.rmp.reconstruct import split_coefficients

S = 2048


@pytest.mark.parametrize("k,m,lost", [
    (8, 4, (0, 3, 5, 7)),          # data only, all parity survives
    (8, 4, (2,)),                  # fewer erasures than parity pages
    (8, 4, (1, 6, 8 + 2)),         # data + one tier-1 page (an output in the parity)
    (12, 4, (8 + 0, 8 + 3)),       # parity only
    (24, 16, tuple(range(4, 20))),  # the GPU test's geometry, a DRAM row
])
def test_split_decode_matches_parity_code(k, m, lost):
    rng = np.random.default_rng(sum(lost) + k)
    data = torch.from_numpy(rng.integers(0, 256, (k, S), dtype=np.uint8))
    code = ParityCode(k, m, S, backend="reference")
    par = code.encode(data)
    pages = [data[j] for j in range(k)] + [par[i] for i in range(m)]
    want = code.decode([None if j in lost else p for j, p in enumerate(pages)])

    lost_par = [j - k for j in lost if j >= k]
    survivors = [i for i in range(m) if i not in lost_par]
    coef, ts, coef2 = split_coefficients(k, m, lost, survivors)
    assert coef2.shape == (len(lost), len(survivors))
    ref = ReferenceBackend()
    outs = [torch.zeros(S, dtype=torch.uint8) for _ in lost]
    data_only = [None if j in lost else data[j] for j in range(k)]
    ref.syndrome_mix(data_only, outs, coef, ts, S)
    ref.delta_update(outs, [par[i] for i in survivors], [None] * len(survivors), coef2, S)
    for j, o in zip(lost, outs):
        assert torch.equal(o, want[j]), j
        assert torch.equal(o, pages[j]), j
