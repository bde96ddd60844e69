"""The update's lookahead (leto_runtime/rmu/lookahead.py): when the host waits for the GPU and
what it does around the wait.  The waits themselves need CUDA; their order is plain Python and
is what makes a death in them provable (the drain window is closed before the fault point and
the wait, opened after).  The event source is the one thing replaced here: a recorded marker of
the stream's progress, here a counter of chunks the "GPU" has finished that `synchronize()`
advances, as a CUDA event's would; the GPU tests run the real one
(tests/gpu/test_inplace_gpu.py, case nccl-rmu.lookahead-drained)."""
from __future__ import annotations

import pytest

from leto_runtime.rmu.lookahead import Lookahead


class Stream:
    """What the host queued and what has run: chunk numbers in queue order."""

    def __init__(self):
        self.queued, self.done, self.log = 0, 0, []

    def event(self):
        n = self.queued = self.queued + 1
        stream = self

        class Done:
            def synchronize(self):
                stream.log.append(("wait", n))
                stream.done = max(stream.done, n)
        return Done()


def run(depth: int, chunks: int):
    st = Stream()
    ahead = Lookahead(depth, lambda: st.log.append(("close",)), lambda: st.log.append(("open",)),
                      lambda point, **w: st.log.append((point, w["chunk"])), event=st.event)
    behind = []
    for j in range(chunks):
        ahead.queued(0, 0, j)
        behind.append(st.queued - st.done)          # chunks queued and not known finished
    return st, behind


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_host_stays_depth_chunks_ahead_and_waits_inside_a_closed_window(depth):
    st, behind = run(depth, 8)
    assert behind == [min(j + 1, depth) for j in range(8)]
    waits = [e for e in st.log if e[0] == "wait"]
    assert [n for _, n in waits] == list(range(1, 8 - depth + 1))      # the oldest, in order
    # each wait: close, the fault point (naming the chunk just queued), the wait, open
    for i in range(len(waits)):
        assert st.log[4 * i:4 * i + 4] == [("close",), ("rmu.lookahead", depth + i),
                                           ("wait", i + 1), ("open",)]


def test_depth_zero_never_waits_and_clear_forgets_an_abandoned_run():
    st, _ = run(0, 5)
    assert st.log == [] and st.queued == 0           # not even an event per chunk
    st = Stream()
    ahead = Lookahead(1, lambda: None, lambda: None, lambda p, **w: None, event=st.event)
    ahead.queued(0, 0, 0)
    ahead.clear()                                    # the next run starts with nothing pending
    ahead.queued(1, 0, 0)
    assert st.log == []
