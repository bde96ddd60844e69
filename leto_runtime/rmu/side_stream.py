"""The updater's side stream (CUDA): group-level parity copies queued beside the current stream.

Two kinds of work run there, both between a group's host parity and its parity buffers, and
both outside any chunk transaction:

* the next group's parity load (`prefetch(t, g)`): group g's host tier-1 parity is copied into
  its load buffer while the previous group's chunks run -- a buffer that group never touches
  (`states.StateSet.q`); `take_prefetch(t, g)` makes the current stream wait for the queued
  copy and says whether it was group g's load of step t (otherwise the caller loads in line);
* the overlapped write-back (`writeback(side)`, LETO_RMU_WB_OVERLAP, the default): group g's
  tier-1 write-back and tier-2 refresh, ordered after everything queued so far;
  `finish_writeback()` makes work queued from then on wait for them.

The stream runs in order, so a prefetch queued after a write-back follows it.  On CPU there is
no side stream (`stream` is None): `prefetch` does nothing and `writeback` runs in line.

Calling contract: one `SideStream` per `updater.Updater`, which decides when each copy may run
(the marker protocol: updater.py); `quiesce()` at a step boundary, before anything else is
queued.
"""
from __future__ import annotations

import contextlib

import torch


class SideStream:
    def __init__(self, ss, cuda: bool):
        self.ss = ss
        self.stream = torch.cuda.Stream(device=ss.device) if cuda else None
        self.prefetched: tuple | None = None     # (t, group, event) of the queued parity load
        self._wb_done = None                     # the event after the queued write-back

    def quiesce(self) -> None:
        """A parity load no update consumed and a queued write-back end before anything queued
        from here on."""
        if self.prefetched is not None:
            torch.cuda.current_stream().wait_event(self.prefetched[-1])
        self.prefetched = None
        self.finish_writeback()

    def prefetch(self, t: int, g: int) -> None:
        """Queue the load of group g's host parity into its buffer on the side stream (CUDA).
        Safe without marker changes: the buffer is none of group g-1's (states.StateSet.q),
        nothing writes the host parity of g before g's own write-back, and a trainer that
        resumes at g's LOAD copies it again itself."""
        if self.stream is None or g >= len(self.ss.model[0].groups):
            return
        self.stream.wait_stream(torch.cuda.current_stream())     # the buffer's last users
        with torch.cuda.stream(self.stream):
            for i, st in enumerate(self.ss.model):
                self.ss.q(i, 0, g).copy_(st.tier1(g), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.prefetched = (t, g, ev)

    def take_prefetch(self, t: int, g: int) -> bool:
        """The current stream waits for the queued parity load, if any (a copy that is not this
        load's may still write a buffer this one aliases); True when it was group g's of step
        t, so that group's buffer holds its host parity."""
        pre, self.prefetched = self.prefetched, None
        if pre is not None:
            torch.cuda.current_stream().wait_event(pre[2])
        return pre is not None and pre[:2] == (t, g)

    @contextlib.contextmanager
    def writeback(self, side: bool):
        """The body runs on the side stream where `side` and there is one (yields it), ordered
        after everything queued so far, and `finish_writeback` then waits for what it queued;
        otherwise in line (yields None)."""
        stream = self.stream if side and self.stream is not None else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            yield stream
            if stream is not None:
                ev = torch.cuda.Event()
                ev.record(stream)
                self._wb_done = ev

    def finish_writeback(self) -> None:
        """Work queued from here on (a marker write that stops naming the write-back among it)
        waits for the queued write-back."""
        if self._wb_done is not None:
            torch.cuda.current_stream().wait_event(self._wb_done)
            self._wb_done = None
