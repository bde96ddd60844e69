"""The waiting shadow's rehearsed update (leto_runtime/rmu/rehearsal.py): a whole RMU step on
scratch states of the same configuration, which leaves the updater's own states -- the
retained ones in a shadow -- byte for byte as they were, and fires none of its fault points."""
from __future__ import annotations

import torch

from leto_runtime.rmu import rehearsal
from leto_runtime.rmu.adamw import AdamWConfig
from leto_runtime.rmu.marker import Phase
from leto_runtime.rmu.states import Geometry, Layout, open_states
from leto_runtime.rmu.updater import Updater


def _states_bytes(ss) -> list[bytes]:
    """Every byte of every state, data and parity (host and device tiers)."""
    out = []
    for st in (*ss.model, ss.grads, ss.marker, ss.undo, ss.qbuf):
        out.append(bytes(st._data.cpu().numpy()) + bytes(st._parity.cpu().numpy()))
    return out


def test_a_rehearsal_runs_an_update_on_scratch_and_leaves_the_states_and_fault_points_alone():
    geo = Geometry(8, 4, 1, 4096)
    ss = open_states(Layout.of([("w", (9000,))], geo.page_bytes), client=None, geo=geo,
                     device="cpu", chunk_pages=2)
    fired = []
    up = Updater(ss, AdamWConfig(lr=1e-2, clip_grad_norm=1.0, total_steps=10), backend="cpu",
                 inject=lambda point, **where: fired.append(point))
    g = torch.Generator().manual_seed(7)
    for st in (*ss.model, ss.grads):
        ss.flat(st).copy_(torch.randn(ss.flat(st).numel(), generator=g))
    up.encode_all([*ss.model, ss.grads])
    up.marker.write(initialized=1, t=4, phase=Phase.DONE)
    before = _states_bytes(ss)
    marker = up.marker.rec

    seconds = rehearsal.rehearse(up)

    assert seconds > 0
    assert _states_bytes(ss) == before             # nothing of the updater's own states moved
    assert up.marker.rec == marker and fired == []
    # The updater still works as it did: one real step of it fires its points in order.
    up.begin(5)
    up.step(5, None)
    assert fired[:3] == ["grads.protect", "sync", "sync.after"], fired


def test_the_scratch_geometry_keeps_the_code_and_shrinks_the_pages():
    g = rehearsal.scratch_geometry(Geometry(1024, 16, 1, 4 << 20))
    assert (g.data_pages, g.tier1, g.tier2, g.page_bytes) == (1024, 16, 1, 64 << 10)
    assert rehearsal.scratch_geometry(Geometry(8, 4, 1, 4096)).page_bytes == 4096
