"""`SlotHarness`: one rank slot's state manager + fd keeper, run without the agent.

Role: what the agent does for the memory pool of one slot, in ~60 lines, for tests, benchmarks
and as the reference for the agent's integration: make a private run directory, start an
`FdKeeper`, spawn the state manager with `procs.spawn` (own process group, parent-death signal,
pidfd), wait until it serves, respawn it after a crash, register trainer pids, tear down.

Calling contract: construct and call from the main thread (as `procs.spawn` requires); `close()`
stops the state manager (SIGTERM, then SIGKILL after `grace`), closes the keeper (the memory goes
with the last holder) and removes the run directory.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

from leto_run.procs import Proc, spawn
from leto_run.state_manager.keeper import FdKeeper
from leto_run.state_manager.metadata import Geometry


class SlotHarness:
    def __init__(self, *, device: str = "cpu", geometry: Geometry | None = None, slot: int = 0,
                 allow_wait: float = 2.0, ready_timeout: float = 60.0, stderr=None,
                 run_dir: str | None = None):
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="leto-rmp-")    # 0700
        self.slot, self.ready_timeout, self.stderr = slot, ready_timeout, stderr
        self.keeper = FdKeeper(self.run_dir, slot)
        self.argv = self.keeper.state_manager_argv(device=device, geometry=geometry,
                                                   allow_wait=allow_wait)
        self.proc: Proc | None = None
        self.starts = 0
        self.start()

    @property
    def socket(self) -> str:
        return self.keeper.sm_socket

    def start(self) -> Proc:
        """Spawn the state manager (again) and wait until it serves; raises if it does not."""
        env = dict(os.environ)
        self.proc = spawn(self.argv, env, stderr=self.stderr)
        self.starts += 1
        deadline = time.monotonic() + self.ready_timeout
        while not self.keeper.wait_ready(0.05):
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"state manager exited with {self.proc.popen.returncode} "
                                   f"before serving: {' '.join(self.argv)}")
            if time.monotonic() > deadline:
                break
        if not self.keeper.ready:
            raise TimeoutError("state manager did not become ready")
        return self.proc

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Signal the state manager and reap it; returns its exit code (negative: signal)."""
        self.proc.send(sig)
        code = self.proc.popen.wait(timeout=30)
        self.proc.poll_exit()
        # the keeper notices the EOF on its own thread; wait so a restart is not refused
        for _ in range(200):
            if self.keeper.stats()["connected_pid"] is None:
                break
            self.keeper.wait_ready(0.01)
        return code

    def restart(self) -> Proc:
        if self.proc is not None and self.proc.popen.poll() is None:
            self.kill()
        return self.start()

    def allow(self, pid: int) -> None:
        self.keeper.allow_pid(pid)

    def close(self, grace: float = 5.0) -> None:
        if self.proc is not None and self.proc.popen.poll() is None:
            self.proc.send(signal.SIGTERM)
            try:
                self.proc.popen.wait(timeout=grace)
            except Exception:
                self.proc.send(signal.SIGKILL)
                self.proc.popen.wait(timeout=30)
            self.proc.poll_exit()
        self.keeper.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "SlotHarness":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
