"""Build (first run on a machine) and load the native kernels a trainer's RMU will use, up front.

Role: `prepare(device)` is what `Job` calls before its first heartbeat.  The kernels are
compiled on first use by torch's JIT extension builder (about a minute for the C++ codec, a few
minutes for the CUDA kernels; cached afterwards, see leto_runtime/parity/_ext.py).  Built lazily
-- inside `job.adamw()` or the first `opt.step()`, after the first heartbeat -- that time counted
against the launcher's hang detection (`--hang-timeout`, armed by a trainer's first heartbeat):
on a fresh machine the README's demo (hang timeout 10 s) had its trainers killed as hung while
they compiled, and lost the failures it injects.  Start-up is not a hang (leto_run.decisions.
hang_verdict), so the builds belong before the first heartbeat.

What is prepared mirrors what the RMU loads on `device`: the C++ codec (the host-memory marker
and CPU states), and on CUDA the CUDA codec, the fused AdamW / AdamW + parity kernels and the
stream-ordered marker writes (unless LETO_RMU_FUSED=0), the activation-lending allocator (unless
LETO_LEND=0) and the native page mapper (unless LETO_RMP_MAP says otherwise).

Calling contract: `prepare(device) -> {kernel: "ready" | why it is unavailable}`; it never
raises for a kernel that cannot be built or loaded -- the code that uses it falls back or fails
with its own typed error, as before; idempotent (every loader caches its result per process).
"""
from __future__ import annotations

import torch


def prepare(device) -> dict[str, str]:
    from leto_runtime.parity import _ext

    out: dict[str, str] = {}

    def one(name: str, load) -> None:
        try:
            load()
            out[name] = "ready"
        except Exception as e:          # unavailable here: its user reports it when it needs it
            out[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"

    one("parity_cpu", _ext.load_cpu)
    if torch.device(device).type != "cuda":
        return out
    from leto_runtime.rmp import mapping, native_map
    from leto_runtime.rmu import fused, lend
    one("parity_cuda", _ext.load_cuda)
    if fused.wanted():
        one("rmu_cuda", fused.load)
    if lend.wanted(device):
        one("lend_alloc", lend.build)
    if mapping.MAP_PATH == "native":
        one("rmp_map", native_map.build)
    return out
