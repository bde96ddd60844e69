"""Build (first run on a machine) and load the native kernels a trainer's RMU will use, up front.

Role: `prepare(device)` is what `Job` calls before its first heartbeat, where it will use
kernels under leto-run (in place; or on CUDA); a plain torchrun run retains nothing, protects
nothing and never calls it (job.py).  The kernels are compiled on first use (about a minute for
the C++ codec, a few minutes for the CUDA kernels; cached afterwards in the kernel cache,
leto_runtime/wire/kernel_cache.py, docs/KERNELS.md).  Built lazily
-- inside `job.adamw()` or the first `opt.step()`, after the first heartbeat -- that time counted
against the launcher's hang detection (`--hang-timeout`, armed by a trainer's first heartbeat):
on a fresh machine the README's demo (hang timeout 10 s) had its trainers killed as hung while
they compiled, and lost the failures it injects.  Start-up is not a hang (leto_run.decisions.
hang_verdict), so the builds belong before the first heartbeat.

What is prepared mirrors what the RMU loads on `device`: the C++ codec (the host-memory marker
and CPU states), and on CUDA the CUDA codec, the extension with the fused AdamW / AdamW + parity kernels and the
stream-ordered marker writes (unless both LETO_RMU_FUSED=0 and LETO_RMU_STREAM_MARKER=0), the
activation-lending allocator (unless LETO_LEND=0) and, for retained states, the native page
mapper (unless LETO_RMP_MAP says otherwise).

Calling contract: `prepare(device, retained) -> {kernel: "ready" | "not used" | why it is
unavailable}`; it
never raises for a kernel that cannot be built or loaded, nor for a module that reads a bad
environment variable while it is imported -- the code that uses it falls back or fails
with its own typed error, as before; idempotent (every loader caches its result per process).
"""
from __future__ import annotations

import torch

from leto_runtime.wire import settings


def prepare(device, retained: bool = True) -> dict[str, str]:
    """`retained`: the states live in a state manager (in place under leto-run), so the native
    page mapper is needed on CUDA."""

    out: dict[str, str] = {}

    def one(name: str, load) -> None:
        try:
            out[name] = load() or "ready"
        except Exception as e:          # unavailable here: its user reports it when it needs it
            out[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"

    def parity(kind: str) -> None:
        from leto_runtime.parity import _ext
        (_ext.load_cpu if kind == "cpu" else _ext.load_cuda)()

    def rmu_cuda():
        from leto_runtime.rmu import fused
        # the fused kernels (LETO_RMU_FUSED) and the stream-ordered marker writes
        # (LETO_RMU_STREAM_MARKER, updater.py / marker.py) live in the same extension
        if not fused.wanted() and settings.get().rmu_stream_marker == "0":
            return "not used"
        fused.load()

    def lend_alloc():
        from leto_runtime.rmu import lend
        if not lend.wanted(device):
            return "not used"
        lend.build()

    def rmp_map():
        from leto_runtime.rmp import native_map
        from leto_runtime.wire import settings
        if settings.get().rmp_map != "native":
            return "not used"
        native_map.build()

    one("parity_cpu", lambda: parity("cpu"))
    if torch.device(device).type != "cuda":
        return out
    one("parity_cuda", lambda: parity("cuda"))
    one("rmu_cuda", rmu_cuda)
    one("lend_alloc", lend_alloc)
    if retained:
        one("rmp_map", rmp_map)
    return out
