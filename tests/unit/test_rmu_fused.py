"""leto_runtime/rmu/fused.py off the GPU: the fast path is never taken where it cannot be
checked (CPU devices, LETO_RMU_FUSED=0), the reason is recorded, and the Updater then runs the
torch-ops AdamW.  The kernel itself is tested against torch.optim.AdamW on the GPU
(tests/gpu/test_rmu_fused_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from leto_runtime.rmu import fused as F
from leto_runtime.rmu.adamw import AdamWConfig
from leto_runtime.rmu.states import Geometry, Layout, open_states
from leto_runtime.rmu.updater import Updater

CFG = AdamWConfig(lr=1e-3, clip_grad_norm=1.0)


def test_no_fast_path_on_cpu_and_the_reason_is_kept():
    assert F.Fused.for_device("cpu", CFG) is None
    assert F.why_not == "not a CUDA device"


def test_switch_off_is_honoured_before_anything_is_built(monkeypatch):
    monkeypatch.setenv("LETO_RMU_FUSED", "0")
    assert not F.wanted()
    assert F.Fused.for_device(torch.device("cuda", 0), CFG) is None
    assert F.why_not == "LETO_RMU_FUSED=0"


def test_updater_on_cpu_uses_the_torch_ops():
    geo = Geometry(8, 4, 1, 4096)
    ss = open_states(Layout.of([("w", (5000,))], geo.page_bytes), client=None, geo=geo, device="cpu",
                     chunk_pages=2)
    up = Updater(ss, CFG, backend="cpu")
    assert up.fused is None and up.side.stream is None  # no fused kernel, no prefetch stream


def test_fused_layout_is_read_from_the_env_and_a_bad_name_says_the_fix(monkeypatch):
    """LETO_RMU_FUSED_LAYOUT picks the one-kernel chunk's layout (cuda/adamw_syndrome.cu's 0..4);
    unset, 4x2x3; "auto" checks ws first with 4x2x3 as its fallback; a name the kernel does not
    have is a typed error listing the names, not a silent fallback."""
    monkeypatch.delenv(F.LAYOUT_ENV, raising=False)
    assert F.layouts() == (0,) and F.layout() == 0
    monkeypatch.setenv(F.LAYOUT_ENV, "auto")
    assert F.layouts() == (F.LAYOUTS["ws"], F.LAYOUTS["4x2x3"]) and F.layout() == 4
    assert sorted(F.LAYOUTS.values()) == [0, 1, 2, 3, 4]
    for name, i in F.LAYOUTS.items():
        monkeypatch.setenv(F.LAYOUT_ENV, name)
        assert F.layout() == i and F.layouts() == (i,)
    monkeypatch.setenv(F.LAYOUT_ENV, "2x2x3-rowmajor")
    with pytest.raises(F.LayoutError, match="2x2x3-rowmajor.*one of 4x2x3, 4x2x3-statemajor"):
        F.layout()
