"""CudaMapping.probe's native path (cuda/rmp_probe.cpp) and its fallback: where the CUDA
extension cannot be built, probe() uses the cuda-python loop and says so once (no silent
fallback); where it can, the native function gets the mapping's geometry and the page list.
The GPU behaviour itself is tested in tests/gpu/test_rmp_perf_paths.py."""
from __future__ import annotations

import logging

import pytest

from leto_runtime.parity import _ext
from leto_runtime.parity.errors import ParityBackendUnavailable
from leto_runtime.rmp import mapping


@pytest.fixture(autouse=True)
def unresolved():
    """The native probe not resolved yet: the next probe() loads the (patched) extension; the
    resolution made here does not outlive the test."""
    with mapping.override_native_probe(None):
        yield


def _fake_mapping():
    m = object.__new__(mapping.CudaMapping)     # no CUDA here: only what probe() reads
    m.base, m.page_bytes, m.n_pages = 1 << 40, 2 << 20, 8
    return m


def test_fallback_logs_once_and_uses_the_python_loop(monkeypatch, caplog):
    monkeypatch.setattr(_ext, "load_cuda", lambda: (_ for _ in ()).throw(
        ParityBackendUnavailable("cuda", "no CUDA device is visible")))
    m = _fake_mapping()
    seen = []
    m.probe_python = lambda pages=None: seen.append(pages) or [3]
    with caplog.at_level(logging.WARNING, logger="leto.rmp"):
        assert m.probe() == [3]
        assert m.probe([1, 3]) == [3]
    assert seen == [None, [1, 3]]
    msgs = [r.getMessage() for r in caplog.records if "native device-page probe" in r.getMessage()]
    assert len(msgs) == 1 and "no CUDA device is visible" in msgs[0]


def test_native_function_gets_geometry_and_pages(monkeypatch):
    calls = []

    class Ext:
        @staticmethod
        def rmp_probe_unmapped(base, page_bytes, n_pages, pages, threads):
            calls.append((base, page_bytes, n_pages, pages, threads))
            return [5]

    monkeypatch.setattr(_ext, "load_cuda", lambda: Ext)
    m = _fake_mapping()
    assert m.probe() == [5]
    assert m.probe(range(2, 4)) == [5]
    monkeypatch.setenv("LETO_RMP_PROBE_THREADS", "3")     # read at each probe
    assert m.probe(range(1, 2)) == [5]
    assert calls == [(1 << 40, 2 << 20, 8, None, 1), (1 << 40, 2 << 20, 8, [2, 3], 1),
                     (1 << 40, 2 << 20, 8, [1], 3)]
