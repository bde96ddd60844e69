"""RMU state layout (leto_runtime/rmu/states.py): the parity buffers' per-group rotation that lets
the updater prefetch the next group's host parity and write a group's parity back while the next
runs, and the default chunk size."""
from __future__ import annotations

from leto_runtime.rmu.states import Geometry, Layout, open_states, pick_chunk_pages


def _ss():
    geo = Geometry(2, 3, 1, 4096)
    layout = Layout.of([("w", (9 * 1024,))], geo.page_bytes)
    return open_states(layout, client=None, geo=geo, device="cpu", chunk_pages=1)


def test_next_groups_buffers_are_none_of_this_groups_pair():
    ss = _ss()
    assert len(ss.model[0].groups) == 5
    ptr = lambda i, b, g: ss.q(i, b, g).data_ptr()  # noqa: E731
    for i in range(3):
        for g in range(6):
            pair = {ptr(i, 0, g), ptr(i, 1, g)}
            assert len(pair) == 2
            # g+1's load (prefetched while g runs) and its first commit never touch g's pair,
            # which the write-back of g may still read while g+1 runs ...
            assert not {ptr(i, 0, g + 1), ptr(i, 1, g + 1)} & pair
            # ... and g+2 reuses them
            assert {ptr(i, 0, g + 2), ptr(i, 1, g + 2)} == pair
    # the three states' buffers never overlap
    every = {ptr(i, b, g) for i in range(3) for b in (0, 1) for g in range(4)}
    assert len(every) == 12
    assert all(ss.q(i, b, g).shape == (3, 4096) for i in range(3) for b in (0, 1) for g in range(4))
    assert {ss.q_first(i, b, g) * 4096 for i in range(3) for b in (0, 1) for g in range(4)} == \
        {p - ss.q(0, 0, 0).data_ptr() for p in every}


def test_default_chunk_is_a_quarter_group_capped_at_512_mib():
    assert pick_chunk_pages(0, Geometry(1024, 16, 1, 2 << 20)) == 256
    assert pick_chunk_pages(0, Geometry(1024, 16, 1, 4 << 20)) == 128     # 512 MiB cap
    assert pick_chunk_pages(0, Geometry(32, 16, 1, 4096)) == 8
    assert pick_chunk_pages(0, Geometry(2, 16, 1, 4096)) == 1
    assert pick_chunk_pages(7, Geometry(1024, 16, 1, 2 << 20)) == 7
    assert pick_chunk_pages(5000, Geometry(1024, 16, 1, 2 << 20)) == 1024
