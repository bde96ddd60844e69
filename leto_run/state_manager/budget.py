"""What a request may cost the state manager: fds and memory, checked before the work starts.

Role: the size half of the state manager's admission (`conns.py` is the connection half).
* `check_allocation` (`allocation_need`, `memory_refusal`): an `allocate` is measured in O(1)
  from its arguments (`PoolMeta.page_counts`) and refused with a typed error before a single
  page id is planned, when its fds or its memory cannot exist (a 4 TiB request answers at
  once, not after a minute of planning and gigabytes of metadata).
* `host_memory_available` / `device_memory_left`: the limits it is measured against (the
  kernel's MemAvailable and the cgroup's memory limit; the GPU's memory, context-free).
* `FdBudget`: a reply message the kernel could not take at once waits for its reader without
  the pool lock, holding *duplicates* of its page fds (`replies.py`).  They are counted here,
  so that they and the pool's pages stay within RLIMIT_NOFILE; a request that would not fit
  waits for them (each is bounded by the send stall timeout) instead of failing with EMFILE.

Calling contract: `check_allocation` and `FdBudget.take` run with the pool lock held (they read
the pool's fd count and must not race an allocation); `give` and `wait` run without it.  The
other functions are pure or read /proc and /sys only.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass

from leto_run.state_manager.metadata import MAX_STATE_BYTES
from leto_run.state_manager.pool import FD_RESERVE
from leto_runtime.wire import protocol as P

GiB = 1 << 30
_GPU_TOTAL: dict[int, int] = {}      # ordinal -> bytes (cuDeviceTotalMem, asked once)


@dataclass(frozen=True)
class Need:
    """What a new state takes: page fds, and bytes of host and of device memory."""

    fds: int
    host_bytes: int
    device_bytes: int


def allocation_need(meta, nbytes: int, tier: str, protected: bool, device_kind: str) -> Need:
    """O(1): data pages in the tier's memory (memfd on CPU machines), parity in host memory."""
    data, parity = meta.page_counts(nbytes, tier, protected)
    page = meta.page_bytes(tier)
    data_bytes, parity_bytes = data * page, parity * page
    on_host = tier == "host" or device_kind == "memfd"
    return Need(data + parity, parity_bytes + (data_bytes if on_host else 0),
                0 if on_host else data_bytes)


def memory_refusal(nbytes: int, need: Need, host_available: tuple[int, str] | None,
                   device_left: tuple[int, str] | None) -> str | None:
    """Why a state of `nbytes` (needing `need`) cannot be allocated now (None: it may be).
    host_available / device_left: (bytes, where that figure comes from), None if unknown."""
    for want, have, where in ((need.host_bytes, host_available, "host"),
                              (need.device_bytes, device_left, "device")):
        if want and have is not None and want > have[0]:
            return (f"a state of {nbytes} bytes needs {want / GiB:.2f} GiB of {where} memory "
                    f"(pages and parity) but only {have[0] / GiB:.2f} GiB are available "
                    f"({have[1]}); retain less, or free memory on this machine")
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            v = f.read().strip()
    except OSError:
        return None
    return int(v) if v.isdigit() else None


def _stat_sum(path: str, keys: tuple[str, ...]) -> int | None:
    try:
        with open(path) as f:
            rows = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
    except (OSError, ValueError):
        return None
    vals = [int(rows[k]) for k in keys if rows.get(k, "").isdigit()]
    return sum(vals) if vals else None


def _cgroup_available() -> tuple[int, str] | None:
    """The memory cgroup's limit minus what cannot be reclaimed (anonymous and shmem pages:
    retained pages are shmem, and page cache would be dropped for them)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for hid, ctrl, path in (x for x in lines if len(x) == 3):
        if hid == "0" and ctrl == "":                                   # cgroup v2
            roots = [f"/sys/fs/cgroup{path}".rstrip("/"), "/sys/fs/cgroup"]
            files, keys = ("memory.max", "memory.stat"), ("anon", "shmem")
        elif "memory" in ctrl.split(","):                               # cgroup v1
            roots = [f"/sys/fs/cgroup/memory{path}".rstrip("/"), "/sys/fs/cgroup/memory"]
            files, keys = ("memory.limit_in_bytes", "memory.stat"), ("total_rss", "total_shmem")
        else:
            continue
        for root in roots:
            limit = _read_int(f"{root}/{files[0]}")
            if limit is None or limit >= 1 << 60:                      # absent or unlimited
                continue
            used = _stat_sum(f"{root}/{files[1]}", keys) or 0
            return max(0, limit - used), f"memory cgroup limit {limit / GiB:.2f} GiB"
    return None


def host_memory_available() -> tuple[int, str] | None:
    """(bytes, source): the smaller of MemAvailable and the memory cgroup's room."""
    best = None
    kb = _stat_sum("/proc/meminfo", ("MemAvailable:",))
    if kb is not None:
        best = (kb * 1024, "MemAvailable")
    cg = _cgroup_available()
    if cg is not None and (best is None or cg[0] < best[0]):
        best = cg
    return best


def device_memory_left(device, held_bytes: int) -> tuple[int, str] | None:
    """(bytes, source) a GPU pool may still create: the GPU's memory (cuDeviceTotalMem needs
    no context) less the device pages the pool holds; None on memfd stand-ins."""
    if getattr(device, "kind", None) != "cuda":
        return None
    total = _GPU_TOTAL.get(device.ordinal)
    if total is None:
        cu = device.cu
        try:
            r = cu.cuDeviceGet(device.ordinal)
            t = cu.cuDeviceTotalMem(r[1]) if r[0] == cu.CUresult.CUDA_SUCCESS else (r[0], 0)
        except Exception:             # no figure: cuMemCreate's own error decides
            return None
        if t[0] != cu.CUresult.CUDA_SUCCESS:
            return None
        total = _GPU_TOTAL[device.ordinal] = int(t[1])
    return max(0, total - held_bytes), f"GPU {device.ordinal} holds {total / GiB:.1f} GiB"


def check_allocation(pool, nbytes: int, tier: str, protected: bool) -> Need:
    """O(1), before any planning (pool lock held): a new state's fds and memory must be
    possible; `BadArgument`, `FdLimit` (naming the fix) or `PoolOutOfMemory` if not."""
    if nbytes > MAX_STATE_BYTES:
        raise P.BadArgument(f"nbytes={nbytes} must be 1..{MAX_STATE_BYTES}")
    need = allocation_need(pool.meta, nbytes, tier, protected, pool.device.kind)
    total = len(pool.fds) + need.fds + FD_RESERVE          # the pool's own rule, before planning
    if total > resource.getrlimit(resource.RLIMIT_NOFILE)[0]:
        try:
            P.check_nofile(total, "the state manager")    # raises the soft limit, or names the fix
        except P.FdLimit as e:
            raise P.FdLimit(f"{need.fds} more pages would exceed RLIMIT_NOFILE "
                            f"({len(pool.fds)} page fds held): {e.message}",
                            {**e.details, "held": len(pool.fds),
                             "limit": e.details["soft"]}) from None
    held_dev = sum(len(s.data) * s.page_bytes for s in pool.meta.states.values()
                   if s.tier == "device")
    why = memory_refusal(nbytes, need, host_memory_available() if need.host_bytes else None,
                         device_memory_left(pool.device, held_dev) if need.device_bytes else None)
    if why:
        raise P.PoolOutOfMemory(why, {"host_bytes": need.host_bytes,
                                      "device_bytes": need.device_bytes})
    return need


class FdBudget:
    """Duplicates of page fds held by replies in flight (see the module docstring)."""

    def __init__(self, pool, reserve: int):
        self.pool, self.reserve = pool, reserve      # reserve: sockets, logs, the keeper link
        self.inflight = 0
        self._cv = threading.Condition()

    def free(self) -> int:
        """fds that may still be opened: the soft limit less the pool's pages, the replies'
        duplicates and the reserve."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft - len(self.pool.fds) - self.inflight - self.reserve

    def could_fit(self, n: int) -> bool:
        """Whether `n` more fds fit once every reply in flight is out."""
        return self.free() + self.inflight >= n

    def take(self, n: int) -> bool:
        """Count `n` duplicates about to be made (pool lock held); False if they do not fit."""
        with self._cv:
            if self.free() < n:
                return False
            self.inflight += n
            return True

    def give(self, fds: list[int]) -> None:
        """Close duplicates made after `take` and return their room."""
        P.close_fds(fds)
        self.release(len(fds))

    def release(self, n: int) -> None:
        with self._cv:
            self.inflight -= n
            self._cv.notify_all()

    def wait(self, n: int, deadline: float) -> bool:
        """Wait (pool lock not held) until `n` fds fit or `deadline`; whether they fit now."""
        with self._cv:
            while self.free() < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))      # pages freed by a release do not notify
            return True


def dup_all(fds: list[int]) -> list[int]:
    """Duplicates (close-on-exec) of `fds`; on failure none is left open."""
    out: list[int] = []
    try:
        for fd in fds:
            out.append(os.dup(fd))
    except OSError:
        P.close_fds(out)
        raise
    return out
