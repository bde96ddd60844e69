"""The live status view: ranks, roles, state, step, last heartbeat, restarts.

On a TTY (or with ``--status``) a rich table redrawn in place at most twice a second; otherwise
(``--no-status``, pipes, CI) one plain line per state change, so logs stay greppable.

Contract: the agent calls `set_group` after each (re)start, `changed` when something changed,
and `refresh` from its loop; `next_refresh` tells the loop when the next redraw is due.
Nothing here blocks or raises into the loop.
"""
from __future__ import annotations

import sys
import threading
import time

from leto_run.console import CONSOLE

_PERIOD = 0.5


class StatusView:
    def __init__(self, enabled: bool | None, console_lock: threading.Lock):
        self.live_mode = sys.stdout.isatty() if enabled is None else enabled
        self.lock = console_lock
        self.slots = []
        self.generation = 0
        self.restarts = 0
        self._dirty = False
        self._last = 0.0
        self._last_line: dict[int, str] = {}
        self._live = None
        if self.live_mode:
            try:
                from rich.console import Console
                from rich.live import Live
                self._live = Live(console=Console(stderr=True), auto_refresh=False,
                                  transient=False)
                self._live.start()
            except Exception:      # a broken terminal must not take the job down
                self._live = None
                self.live_mode = False

    def set_group(self, slots, generation: int, restarts: int) -> None:
        self.slots, self.generation, self.restarts = slots, generation, restarts
        self._last_line.clear()
        self.changed()

    def changed(self) -> None:
        self._dirty = True

    def next_refresh(self, now: float) -> float:
        if self._live is not None:
            return self._last + _PERIOD
        return now + 3600.0 if not self._dirty else now

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._live is not None:
            if force or now - self._last >= _PERIOD:
                self._last = now
                try:
                    self._live.update(self._table(now), refresh=True)
                except Exception:
                    pass
            return
        if not self._dirty and not force:
            return
        self._dirty = False
        for slot in self.slots:
            for sp in slot.all():
                line = (f"rank {slot.rank} {sp.role.value} pid {sp.proc.pid}: {sp.state.value}"
                        + (f" step {sp.step}" if sp.step is not None else ""))
                key = (slot.rank, sp.role.value)
                # Plain mode prints state changes, not every step, to keep logs readable.
                short = f"{sp.role.value}:{sp.state.value}"
                if self._last_line.get(key) != short:
                    self._last_line[key] = short
                    # The one console writer: a closed console never raises into the loop.
                    CONSOLE.write(f"[leto-run status gen={self.generation} "
                                  f"restarts={self.restarts}] {line}\n")

    def _table(self, now: float):
        from rich.table import Table
        t = Table(title=f"leto-run  generation {self.generation}  restarts {self.restarts}")
        for col in ("rank", "local", "role", "pid", "state", "step", "last heartbeat"):
            t.add_column(col)
        for slot in self.slots:
            for sp in slot.all():
                hb = ("-" if sp.last_beat is None else f"{now - sp.last_beat:.1f}s ago"
                      if sp.awaiting is None else f"none for {now - sp.last_beat:.1f}s")
                t.add_row(str(slot.rank), str(slot.local_rank), sp.role.value,
                          str(sp.proc.pid), sp.state.value,
                          "-" if sp.step is None else str(sp.step), hb)
        return t

    def stop(self) -> None:
        if self._live is not None:
            try:
                self._live.stop()
            except Exception:
                pass
            self._live = None
