"""Activation lending: RMU's undo/parity/scratch memory serves activations outside the update.

Paper §5.3 ("Minimizing memory and transfer overhead") and §7 ("PyTorch memory allocator
integration"), docs/RMU.md, "Activation lending": RMU's buffers (U: the undo state, six chunks;
Q/Q': four tier-1 parity buffers per model state) are needed only between the global
synchronization and the end of the update.  During forward and backward they are idle, so the
trainer's activations are allocated *in them* and peak HBM does not grow by their size.

Design (chosen over alternatives, see below):

* `cuda/lend_alloc.cpp` is a tiny segment allocator with PyTorch's pluggable-allocator ABI.  It
  serves large segment requests (> 2 MiB) first-fit from the registered address ranges -- the
  mapped U and Q states (RMP pages under leto-run, plain device tensors under torchrun) -- and
  small ones, and whatever does not fit, with cudaMalloc.
* A `torch.cuda.MemPool` over that allocator is the "lending pool".  `enter()` routes every
  allocation of the device, from every thread (the autograd engine runs backward on its own
  thread), to that pool (`torch._C._cuda_beginAllocateToPool`, the binding `use_mem_pool` is
  built on, with an all-streams filter); `leave()` ends the routing.  The caching allocator
  does its usual block splitting/caching inside the pool's segments, so reuse across
  iterations costs nothing after the first lent one.
* `leave()` runs at the start of `Updater.step()` (before gradient protection, i.e. before RMU
  writes U or Q).  It asks the caching allocator for the pool's blocks (`MemPool.snapshot`) and
  fails with `LendingError` if any block *inside the lent ranges* is still allocated: a tensor
  created during forward/backward and kept alive across `opt.step()` (a kept `logits`, say)
  would be overwritten by the update.  It never corrupts it.  Blocks freed but still in use by
  another stream (`active_pending_free`) make it synchronize the device first.  Small
  allocations (the loss, metrics) are served from 2 MiB cudaMalloc segments outside the ranges
  and may outlive the step.
* Libraries that cache workspaces through the caching allocator on first use (cuBLAS and
  cuBLASLt keep one per handle and stream, and the autograd engine's thread has its own handle)
  must not place them in the lent ranges forever: `Lender` runs a tiny forward/backward of
  linear layers (fp32 and bf16 autocast) before the first lent iteration, so they are created in
  the default pool.  `LETO_LEND_WARMUP=N` also leaves the first N iterations unlent (then the
  default pool's cache is emptied), for libraries this does not foresee.
* `torch.cuda.empty_cache()` keeps its meaning inside the window: torch itself releases nothing
  of its default pool while allocations are routed to a pool, so while a `Lender` exists the
  name is bound to `empty_cache` below, which pauses the routing for the call.
* Between `leave()` and the next `enter()` nothing is routed to the pool: the update's own
  temporaries come from the default pool, and the pool's cached (free) blocks lying in the lent
  ranges are not handed out while RMU overwrites them -- their contents are garbage to both.

Crash consistency: U, Q and the scratch chunk are read by recovery only while the marker says
an update is in progress (`recovery.current_group`: phase UPDATING past LOAD, and
`recovery.pending_writeback`: phase UPDATING with a write-back named; the undo buffer
only with `sub` 1 or 2 in CHUNKS).  `Updater.begin(t)` writes the marker (phase COMPUTE) *before*
`enter()`, and every update operation is fenced before it writes DONE, so activations are only
ever written into U/Q while the marker says COMPUTE: a kill in forward/backward of t+1 redoes
t+1 and never reads U/Q (tests/unit/test_rmu_lend.py checks this against recovery's rules).

Alternatives not taken: a CUDA-graph-style private pool without a custom allocator cannot place
segments at given addresses; expandable segments cannot map RMP pages; lending by resizing
(freeing U/Q to the caching allocator and re-reserving them) would lose the retained mapping
that recovery needs after a crash.

Switch: `LETO_LEND=0` turns lending off (the benchmark compares both); it is on by default on
CUDA and not applicable on CPU.  Calling contract: `Lender(ranges, device)`; `enter(t)`,
`leave(t)` once per iteration; `stats()`; `close()`.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path

import torch

from leto_runtime.errors import ScriptError
from leto_runtime.wire import settings

ENV = "LETO_LEND"
SKIP = 512              # bytes left unlent at the start of every range (see Lender.__init__)
NAME = "leto_lend_alloc"
SRC = "lend_alloc.cpp"         # in the kernel sources (leto_runtime.wire.kernel_cache.source_dir())
_STATS = ("region_bytes", "region_in_use", "region_peak", "overflow_in_use", "overflow_peak",
          "region_allocs", "overflow_allocs", "region_misses", "failed_allocs", "live_segments",
          "regions", "reclaims_asked", "reclaims_served")
RECLAIM_WAIT_S = 3.0       # how long a failed allocation waits for the agent to lower the shadows


_TORCH_EMPTY_CACHE = torch.cuda.memory.empty_cache
_ROUTING: "Lender | None" = None     # the lender whose pool receives allocations now


def empty_cache() -> None:
    """`torch.cuda.empty_cache()` as the script expects it, also inside the lending window.

    While allocations are routed to a pool, torch releases no block of its default pool
    (c10 `release_cached_blocks` skips them while `captures_underway` is not empty), so a
    script that frees memory and calls `empty_cache()` in forward/backward would keep it from
    the driver -- and from the shadows (docs/PREINIT.md).  The routing is paused for the
    call; an allocation of another thread meanwhile lands in the default pool, which is always
    safe.  Installed as `torch.cuda.empty_cache` while a `Lender` exists."""
    lender = _ROUTING
    if lender is None or not lender.inside:
        return _TORCH_EMPTY_CACHE()
    torch._C._cuda_endAllocateToPool(lender.index, lender.pool.id)
    torch._C._cuda_releasePool(lender.index, lender.pool.id)
    try:
        _TORCH_EMPTY_CACHE()
    finally:
        torch._C._cuda_beginAllocateToPool(lender.index, lender.pool.id)


def _install_empty_cache(lender: "Lender | None") -> None:
    global _ROUTING
    _ROUTING = lender
    fn = _TORCH_EMPTY_CACHE if lender is None else empty_cache
    torch.cuda.empty_cache = torch.cuda.memory.empty_cache = fn


class LendingError(ScriptError, RuntimeError):
    """A tensor allocated in lent memory during forward/backward is still alive when the
    update starts; RMU would overwrite it."""


def wanted(device) -> bool:
    """Lending on for this device? (on by default on CUDA; LETO_LEND=0 turns it off)."""
    if not str(device).startswith("cuda"):
        return False
    return settings.get().lend


def _cuda_home() -> str | None:
    cands = [settings.get().cuda_home, settings.get().cuda_path]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands += [str(Path(nvcc).parent.parent), str(Path(nvcc).resolve().parents[1])]
    cands += ["/usr/local/cuda"]
    for c in cands:
        if c and os.path.exists(os.path.join(c, "include", "cuda_runtime_api.h")):
            return c
    return None


def build() -> Path:
    """Compile cuda/lend_alloc.cpp (plain C++ against the CUDA runtime; seconds) into the kernel
    cache, once per source version (`leto_runtime.wire.kernel_cache`); returns the library's path."""
    from leto_runtime.wire import kernel_cache as K

    home = _cuda_home()
    if home is None:
        raise RuntimeError("activation lending needs the CUDA toolkit headers (cuda_runtime_api.h)"
                           ": set CUDA_HOME, or turn lending off with LETO_LEND=0")
    lib = next((os.path.join(home, s) for s in ("lib64", "lib", "targets/x86_64-linux/lib")
                if os.path.exists(os.path.join(home, s, "libcudart.so"))), os.path.join(home, "lib64"))
    cxx = K.cxx()
    if cxx is None:
        raise RuntimeError(f"activation lending: {K.NO_COMPILER}; or turn lending off with LETO_LEND=0")
    before = ["-O2", "-shared", "-fPIC", "-std=c++17", f"-I{home}/include"]
    after = [f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}"]
    spec = K.Spec(NAME, "the activation-lending allocator", (SRC,), (cxx,), (*before, "|", *after),
                  include_dirs=(f"{home}/include",))
    try:
        return K.obtain(spec, lambda slot: K.compile_library(slot, cxx, before, after,
                                                             f"lib{NAME}.so")).path
    except K.BuildError as e:
        raise RuntimeError(f"building {SRC} failed: {e}\nturn lending off with LETO_LEND=0") from None


_LIB: ctypes.CDLL | None = None
_ALLOC = None           # the CUDAPluggableAllocator (one per process: it wraps the one .so)


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        so = build()
        L = ctypes.CDLL(str(so))
        L.lend_add_region.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
        L.lend_add_region.restype = ctypes.c_int
        L.lend_clear_regions.restype = ctypes.c_int64
        L.lend_in_region.argtypes = [ctypes.c_size_t]
        L.lend_set_small_limit.argtypes = [ctypes.c_size_t]
        L.lend_set_enabled.argtypes = [ctypes.c_int]
        L.lend_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        L.lend_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        L.lend_alloc.restype = ctypes.c_void_p
        L.lend_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        L.lend_set_reclaim.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.c_double]
        _LIB = L
    return _LIB


def reclaim_message(ctx) -> tuple[str, str]:
    """The `reclaim` datagram this process sends, around the request's decimal bytes."""
    from leto_runtime.wire import contract as C
    msg = json.dumps({"v": C.HEARTBEAT_VERSION, "kind": "reclaim", "rank": ctx.rank,
                      "role": "active", "gen": ctx.generation, "pid": os.getpid(),
                      "step": None, "detail": "@BYTES@"}, separators=(",", ":"))
    head, tail = msg.split("@BYTES@")
    return head, tail


def arm_reclaim(L) -> None:
    """Under leto-run in place (and LETO_RECLAIM not 0): a lent allocation that would fail
    after torch's own cache release asks the agent to lower the local shadows, waits for
    the memory (at most RECLAIM_WAIT_S) and retries (cuda/lend_alloc.cpp).  The datagram is
    the one `beats.send("reclaim", None, str(bytes))` would write."""
    from leto_runtime.context import Context
    ctx = Context.from_env()
    on = (settings.get().reclaim and ctx.under_leto and ctx.recovery == "inplace"
          and ctx.heartbeat_socket)
    if not on:
        L.lend_set_reclaim(b"", b"", b"", 0.0)
        return
    head, tail = reclaim_message(ctx)
    L.lend_set_reclaim(ctx.heartbeat_socket.encode(), head.encode(), tail.encode(),
                       RECLAIM_WAIT_S)


def raw_stats() -> dict:
    buf = (ctypes.c_int64 * 16)()
    lib().lend_stats(buf)
    return dict(zip(_STATS, list(buf)[:len(_STATS)]))


def live_in(snapshot: list, ranges: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], bool]:
    """(address, size) of every allocated block of `snapshot` (torch's memory-snapshot segment
    list) inside `ranges`, and whether any block there is freed but still used by a stream."""
    live, pending = [], False
    for seg in snapshot:
        base = int(seg["address"])
        if not any(lo <= base < lo + n for lo, n in ranges):
            continue
        addr = base
        for b in seg["blocks"]:
            a = int(b.get("address", addr))
            size = int(b["size"])
            state = b["state"]
            if state == "active_allocated":
                live.append((a, size))
            elif state == "active_pending_free":
                pending = True
            addr = a + size
    return live, pending


class Lender:
    """The lending pool over `ranges` [(address, bytes)] of device memory (see the module
    docstring)."""

    def __init__(self, ranges: list[tuple[int, int]], device, *, warmup: int | None = None):
        global _ALLOC
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        # Every range starts SKIP bytes in: under plain torchrun U/Q are caching-allocator
        # tensors, and a pool block starting at the same address as such a tensor would collide
        # with it in the caching allocator's pointer -> block map ("invalid device pointer" when
        # the second one is freed; seen on the H200).
        self.ranges = [(int(a) + SKIP, int(n) - SKIP) for a, n in ranges if n > SKIP]
        self.warmup = settings.get().lend_warmup if warmup is None else warmup
        self.iters = 0
        self.inside = False
        self.dirty = False              # the last check failed: check again before any update
        self.lent_iters = 0
        self.check_s = 0.0
        L = lib()
        if L.lend_clear_regions() != 0:
            raise RuntimeError("activation lending: a previous lending pool still has segments in "
                               "its ranges (one Lender per process)")
        for a, n in self.ranges:
            if L.lend_add_region(a, n, self.index) < 0:
                raise RuntimeError(f"activation lending: range {a:#x}+{n} overlaps another")
        if _ALLOC is None:
            _ALLOC = torch.cuda.memory.CUDAPluggableAllocator(str(build()), "lend_alloc",
                                                              "lend_free")
        self.pool = torch.cuda.MemPool(_ALLOC.allocator())
        arm_reclaim(L)
        prewarm(self.device)
        torch.cuda.empty_cache()
        _install_empty_cache(self)

    @property
    def region_bytes(self) -> int:
        return sum(n for _, n in self.ranges)

    def enter(self, t: int) -> bool:
        """Route this device's allocations to the lending pool (from the second iteration of
        the process on).  Returns whether it did."""
        self.iters += 1
        if self.inside or self.iters <= self.warmup:
            return False
        if self.iters == self.warmup + 1 and self.warmup:
            torch.cuda.empty_cache()     # the unlent iterations' activations, cached
        torch._C._cuda_beginAllocateToPool(self.index, self.pool.id)
        self.inside = True
        self.lent_iters += 1
        return True

    def _end_routing(self) -> None:
        if self.inside:
            self.inside = False
            torch._C._cuda_endAllocateToPool(self.index, self.pool.id)
            torch._C._cuda_releasePool(self.index, self.pool.id)

    def leave(self, t: int) -> None:
        """End the routing; raise `LendingError` if lent memory still holds a live tensor."""
        import time
        if not (self.inside or self.dirty):
            return
        t0 = time.perf_counter()
        self._end_routing()
        snap = self._snapshot()
        live, pending = live_in(snap, self.ranges)
        if pending:
            torch.cuda.synchronize(self.device)
        self.check_s += time.perf_counter() - t0
        self.dirty = bool(live)
        if live:
            total = sum(n for _, n in live)
            a, n = max(live, key=lambda x: x[1])
            raise LendingError(
                f"iteration {t}: {len(live)} tensor(s) ({total / 2**20:.1f} MiB; the largest "
                f"{n / 2**20:.1f} MiB at {a:#x}) allocated during forward/backward are still alive "
                f"at opt.step(), in the memory RMU lends for activations (its undo and parity "
                f"buffers); the update would overwrite them.  Fix: drop them before opt.step() "
                f"(e.g. `del logits`, or keep `loss.item()` instead of a large tensor), or turn "
                f"activation lending off with {ENV}=0 (peak memory then grows by "
                f"{self.region_bytes / 2**20:.0f} MiB).")

    def _snapshot(self) -> list:
        snap = getattr(self.pool, "snapshot", None)
        if snap is not None:
            try:
                return snap(include_traces=False)
            except TypeError:
                return snap()
        pid = tuple(self.pool.id)
        return [s for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id", ())) == pid]

    def stats(self) -> dict:
        s = raw_stats()
        s.update(lent_iters=self.lent_iters, check_ms_total=self.check_s * 1e3)
        return s

    def close(self) -> None:
        """End any routing and give the pool's cached segments back (the ranges are then free
        for another Lender in this process)."""
        self._end_routing()
        if _ROUTING is self:
            _install_empty_cache(None)
        pool, self.pool = self.pool, None
        if pool is not None:
            del pool
            torch.cuda.empty_cache()
            lib().lend_clear_regions()


def prewarm(device) -> None:
    """Create the per-thread, per-stream library workspaces that the caching allocator keeps
    forever (cuBLAS / cuBLASLt, forward thread and autograd thread) before any lending."""
    dev = torch.device(device)
    for dtype, ac in ((torch.float32, False), (torch.bfloat16, True)):
        x = torch.randn(64, 64, device=dev, requires_grad=True)
        w = torch.randn(64, 64, device=dev, requires_grad=True)
        b = torch.randn(64, device=dev, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac):
            y = torch.nn.functional.linear(x, w, b)
            y = torch.nn.functional.linear(y, w)
        y.float().sum().backward()
        del x, w, b, y
    torch.cuda.current_stream(dev).synchronize()
