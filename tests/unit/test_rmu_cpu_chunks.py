"""RMU's prepared CPU chunk operations (leto_runtime/rmu/cpu_chunks.py) and the parity call they
replay (ParityCode.prepare_update), against an independent expectation: the undo copy equals the
chunk's bytes, and the parity after a prepared delta equals a fresh encode of the changed group."""
from __future__ import annotations

import pytest
import torch

from leto_runtime.parity import ParityCode
from leto_runtime.rmu.cpu_chunks import ChunkCalls
from leto_runtime.rmu.states import Geometry, Layout, open_states

S = 4096


def _rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def test_prepared_update_is_the_update_and_keeps_the_code():
    code = ParityCode(k=32, m=16, page_bytes=S, backend="cpu")
    data = _rand(32, S, seed=1)
    q = code.encode(data)
    new = _rand(8, S, seed=2)
    out = torch.zeros_like(q)
    old = data[4:12].clone()            # held: the call keeps addresses, not the tensors
    call = code.prepare_update(out, range(4, 12), old, new, base=q)
    assert call is not None
    call()
    data[4:12] = new
    assert torch.equal(out, code.encode(data))          # the code of the changed group
    assert code.last_delta_plan().method == "pagewise"
    # a replay after the pages changed again in place: same addresses, new contents
    old, newer = data[4:12].clone(), _rand(8, S, seed=3)
    q.copy_(out)
    out.zero_()
    call2 = code.prepare_update(out, range(4, 12), old, data[4:12], base=q)
    data[4:12] = newer
    call2()
    assert torch.equal(out, code.encode(data))


def test_prepare_update_declines_what_update_would_do_otherwise():
    code = ParityCode(k=64, m=16, page_bytes=S, backend="cpu")
    data = _rand(64, S, seed=4)
    q = code.encode(data)
    # a long run: the syndrome path is cheaper, so there is no pagewise call to prepare
    assert code.prepare_update(q, range(0, 64), data, data.clone()) is None
    with pytest.raises(Exception):                     # pages of the wrong size are still refused
        code.prepare_update(q, range(0, 2), data[:2], torch.zeros(2, S // 2, dtype=torch.uint8))


def _states(chunk_pages=2, data_pages=8):
    geo = Geometry(data_pages, 4, 1, S)
    layout = Layout.of([("w", (20 * S // 4,))], S)       # 20 pages: groups of 8, 8 and 4
    ss = open_states(layout, client=None, geo=geo, device="cpu", chunk_pages=chunk_pages)
    for i, st in enumerate(ss.model):
        st.pages().copy_(_rand(st.n_pages, S, seed=10 + i))
    return ss


def test_chunk_calls_copy_and_patch_like_an_encode_and_replay():
    ss = _states()
    cc = ChunkCalls(ss)
    cc.check()
    for g in range(len(ss.model[0].groups)):
        gi = ss.model[0].groups[g]
        code = ParityCode(k=gi.k, m=ss.geo.tier1, page_bytes=S, backend="cpu")
        for i, st in enumerate(ss.model):
            ss.q(i, 0, g).copy_(code.encode(st.pages(gi.first, gi.k)))
        auth = 0
        for rnd in range(2):                          # the second round replays prepared calls
            for j, (first, count) in enumerate(ss.chunks(g)):
                cc.undo_copy(g, j, 0)
                for i, st in enumerate(ss.model):
                    chunk = st.pages(gi.first + first, count)
                    assert torch.equal(ss.undo_pages(i, count, 0), chunk)
                    chunk.copy_(_rand(count, S, seed=100 * rnd + 10 * j + i))     # "the update"
                assert cc.parity_delta(g, j, auth, 0, code)
                auth = 1 - auth
                for i, st in enumerate(ss.model):
                    assert torch.equal(ss.q(i, auth, g), code.encode(st.pages(gi.first, gi.k))), \
                        (g, rnd, j, i)
    n = cc.prepared
    cc.check()                                        # nothing moved: the calls stay
    assert cc.prepared == n > 0


def test_chunk_calls_are_dropped_when_a_state_moves():
    ss = _states()
    cc = ChunkCalls(ss)
    cc.check()
    cc.undo_copy(0, 0, 0)
    assert cc.prepared
    st = ss.model[1]
    st._data = st._data.clone()                       # the state now lives elsewhere
    cc.check()
    assert not cc.prepared
    cc.undo_copy(0, 0, 0)
    assert torch.equal(ss.undo_pages(1, 2, 0), st.pages(0, 2))


def test_chunk_calls_decline_a_plan_other_than_pagewise():
    ss = _states(chunk_pages=16, data_pages=16)      # a chunk of 16 pages, m = 4: syndrome
    cc = ChunkCalls(ss)
    cc.check()
    code = ParityCode(k=16, m=4, page_bytes=S, backend="cpu")
    assert cc.parity_delta(0, 0, 0, 0, code) is False
    with pytest.raises(ValueError, match="CPU path"):
        ChunkCalls(type("SS", (), {"device": "cuda:0"})())
    ChunkCalls(type("SS", (), {"device": "cpu:0"})())      # an index on CPU is still CPU
