"""benchmarks/rmu_overhead.py's device-idle analysis (`--trace` on CUDA; benchmarks/trace_gaps.py):
the pure function that finds where the device waited and which host CUDA calls overlapped the
wait, against gaps and overlaps worked out by hand."""
from __future__ import annotations

import importlib.util

from leto_testing import ROOT

_spec = importlib.util.spec_from_file_location("trace_gaps", ROOT / "benchmarks" / "trace_gaps.py")
ro = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ro)


def test_gaps_are_the_idle_intervals_with_the_host_calls_inside_them():
    device = [(0, 100, "A"), (150, 300, "B"), (290, 400, "C"), (1000, 1100, "D"), (1120, 1130, "E")]
    host = [(420, 990, "cudaStreamSynchronize"), (995, 999, "cudaLaunchKernel"),
            (0, 90, "cudaLaunchKernel"), (380, 430, "cudaHostRegister")]
    g = ro.idle_gaps(device, host, min_us=50)
    # gaps >= 50 us: 100..150 (B after A) and 400..1000 (C overlaps B; D after C); 1100..1120 is shorter
    assert g["count"] == 2 and g["idle_ms"] == 0.65
    first, second = g["longest"]
    assert (first["at_ms"], first["ms"], first["after"], first["before"]) == (0.4, 0.6, "C", "D")
    assert first["host_calls_ms"] == {"cudaStreamSynchronize": 0.57, "cudaHostRegister": 0.03,
                                      "cudaLaunchKernel": 0.004}
    assert (second["at_ms"], second["ms"], second["after"], second["before"]) == (0.1, 0.05, "A", "B")
    assert second["host_calls_ms"] == {}


def test_no_device_activity_is_no_gap():
    assert ro.idle_gaps([], [(0, 5, "cudaLaunchKernel")]) == {"idle_ms": 0.0, "count": 0, "longest": []}
    assert ro.union([(5, 9, "x"), (0, 6, "y"), (20, 21, "z")]) == [(0, 9), (20, 21)]
