"""A waiting shadow's warm-up forward: the script's own forward pass, run once before promotion
so that the promoted trainer's first forward does not pay CUDA's lazy kernel loading, cuBLAS's
first choices at the step's shapes and the other first-use costs of the model's ops (issue 22,
item 3: the first step after promotion at steady-state speed).

Why the script's help: Leto knows the model but not its input.  `job.warmup(fn)` registers a
callable that runs one forward (`lambda: model(*sample())`, inside the script's own contexts:
`job.autocast()`, an attention backend).  It must run the module itself, never its DDP
wrapper or anything else that calls a collective: shadows wait at different times, and a
collective of one shadow's warm-up would wait for the others'.  A shadow at L3 calls it once while it waits, after the
rehearsed update and the lending pool (`levels.ready_for_first_step`); an active never does
(its first step is its warm-up).

What it may touch: nothing retained.  Until `job.steps()` binds them after the promotion, the
parameters are placeholders (`modules.placeholders`: one zero element expanded to the shape),
so the forward reads zeros and writes only its own activations; gradients are off
(`torch.no_grad`).  What it could change is put back: every buffer's values (a module that
counts its calls, a norm's running statistics) and the CPU and CUDA random states.  Its memory
is capped (`LETO_WARMUP_MIB`, the caching allocator's per-process limit for the call: a warm-up
that needs more fails with an OOM here instead of taking memory the active needs) and given
back after (`empty_cache`); `job.autocast()` keeps no weight casts while it runs (a cast cache
would hold a low-precision copy of every weight at once).  A failure is logged; the first step
then pays what the warm-up would have, as without it.

Calling contract: `run(job) -> float | None` (seconds; None when nothing ran), from the
shadow's main thread, before the promotion.
"""
from __future__ import annotations

import time

import torch

from leto_runtime.trainer_log import log


def run(job) -> float | None:
    fn = getattr(job, "warmup_fn", None)
    if fn is None or job.bound or getattr(job, "_warmed", False):
        return None
    job._warmed = True
    from leto_runtime.wire import settings
    cap = settings.get().warmup_mib << 20
    t0 = time.monotonic()
    saved = {n: b.detach().clone() for n, b in job.model.named_buffers() if not b.is_meta}
    cpu_rng = torch.get_rng_state()
    cuda = job.device.type == "cuda"
    cuda_rng = torch.cuda.get_rng_state(job.device) if cuda else None
    if cuda:
        total = torch.cuda.get_device_properties(job.device).total_memory
        held = torch.cuda.memory_reserved(job.device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (held + cap) / total), job.device)
    job._warming = True
    try:
        with torch.no_grad():
            fn()
        if cuda:
            torch.cuda.synchronize(job.device)
    except Exception as e:
        log(f"warm-up forward failed before promotion ({type(e).__name__}: {str(e)[:200]}); "
            "the first step pays its first use")
        return None
    finally:
        job._warming = False
        bufs = dict(job.model.named_buffers())
        for n, v in saved.items():
            bufs[n].copy_(v)
        torch.set_rng_state(cpu_rng)
        if cuda:
            torch.cuda.set_rng_state(cuda_rng, job.device)
            torch.cuda.set_per_process_memory_fraction(1.0, job.device)
            torch.cuda.empty_cache()
    return time.monotonic() - t0
