"""The parity codec's Python face: backend selection and fallback, typed errors, page checks,
and the build story's failure mode (a missing compiler gives an actionable error)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from leto_runtime.parity import (PageShapeError, ParityBackendUnavailable, ParityCode, ProtectionGroup,
                                 TooManyErasures, _ext, backends)

KiB = 1 << 10


def data(k: int, S: int = KiB, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (k, S), dtype=np.uint8))


def test_explicit_backends_agree_and_reference_is_always_there():
    d = data(6)
    ref = ParityCode(6, 3, KiB, backend="reference").encode(d)
    assert ParityCode(6, 3, KiB, backend="reference").backend_for(torch.device("cpu")).name == "reference"
    if _ext._compiler() is not None:
        assert torch.equal(ParityCode(6, 3, KiB, backend="cpu").encode(d), ref)
        assert ParityCode(6, 3, KiB).backend_for(torch.device("cpu")).name == "cpu"


def test_cuda_backend_on_cpu_pages_is_a_typed_error():
    with pytest.raises(ParityBackendUnavailable) as ei:
        ParityCode(4, 2, KiB, backend="cuda").encode(data(4))
    assert ei.value.backend == "cuda" and ei.value.fix


def test_auto_warns_once_and_falls_back_to_reference(monkeypatch):
    def unavailable():
        raise ParityBackendUnavailable("cpu", "no C++ compiler found", "install g++")

    monkeypatch.setattr(backends, "cpu_backend", unavailable)
    monkeypatch.setattr(backends, "_warned", set())
    d = data(5)
    with pytest.warns(RuntimeWarning, match="falls back to the NumPy reference"):
        p = ParityCode(5, 2, KiB).encode(d)
    assert torch.equal(p, ParityCode(5, 2, KiB, backend="reference").encode(d))
    with pytest.raises(ParityBackendUnavailable):
        ParityCode(5, 2, KiB, backend="cpu").encode(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same reason does not warn twice
        ParityCode(5, 2, KiB).encode(d)


def test_wide_codes_need_the_reference(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    d = data(4)
    with pytest.raises(ParityBackendUnavailable):
        ParityCode(4, 20, KiB, backend="cpu").encode(d)
    with pytest.warns(RuntimeWarning, match="m <= 16"):
        p = ParityCode(4, 20, KiB).encode(d)
    pages = list(d) + list(p)
    lost = [0, 1, 2, 3, 5, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]   # 19 of 24
    rec = ParityCode(4, 20, KiB, backend="reference").decode([None if j in lost else x for j, x in enumerate(pages)])
    assert all(torch.equal(rec[j], pages[j]) for j in lost)


def test_missing_compiler_is_actionable(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ParityBackendUnavailable) as ei:
        _ext._load("leto_parity_nocc", [str(_ext.source_dir() / "parity_cpu.cpp")], cuda=False)
    assert "compiler" in ei.value.reason and "reference" in ei.value.fix


def test_page_checks():
    code = ParityCode(4, 2, KiB, backend="reference")
    with pytest.raises(PageShapeError):
        code.encode(data(3))                                   # wrong count
    with pytest.raises(PageShapeError):
        code.encode([torch.zeros(KiB - 1, dtype=torch.uint8)] * 4)   # wrong size
    with pytest.raises(PageShapeError):
        code.encode(torch.zeros((KiB, 4), dtype=torch.uint8).t())     # not contiguous
    with pytest.raises(IndexError):
        code.update(code.encode(data(4)), 4, data(1), data(1))
    with pytest.raises(ValueError):
        ParityCode(4, 2, 1000)
    with pytest.raises(ValueError):
        ParityCode(4, 2, KiB, backend="gpu")
    with pytest.raises(TypeError):
        ParityCode(4.0, 2, KiB)


def test_too_many_erasures_is_typed_and_carries_the_facts():
    grp = ProtectionGroup(8, 2, 1, KiB, backend="reference")
    d = data(8)
    p1, p2 = grp.encode(d)
    with pytest.raises(TooManyErasures) as ei:   # 2 data + 1 tier-1 with H1=2 and 1 tier-2 page lost
        grp.decode([None, None] + list(d[2:]), [None, p1[1]], [None])
    assert ei.value.tolerance == 3 and len(ei.value.lost) == 4
    rec = grp.decode([None, None] + list(d[2:]), list(p1), [None])   # data via tier 1, tier 2 re-made
    assert torch.equal(rec.data[0], d[0]) and torch.equal(rec.tier2[0], p2[0])


def test_stacked_and_listed_pages_are_equivalent_and_out_is_filled_in_place():
    code = ParityCode(5, 3, 2 * KiB, backend="reference")
    d = data(5, 2 * KiB)
    out = [torch.empty(2 * KiB, dtype=torch.uint8) for _ in range(3)]
    assert code.encode(list(d), out=out) is out
    assert torch.equal(torch.stack(out), code.encode(d))
