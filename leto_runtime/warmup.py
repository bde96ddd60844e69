"""A waiting shadow's warm-up: the script's own forward pass, run once before promotion so that
the promoted trainer's first step does not pay CUDA's lazy kernel loading, cuBLAS's first
choices at the step's shapes and the other first-use costs of the model's ops (issue 22,
item 3: the first step after promotion at steady-state speed).  Then the backward's: the
autograd engine's device thread and that thread's cuBLAS handle and workspace (a small product
of its own), and, where it fits the cap, the script's forward once more with gradients taken
with respect to one parameter of each shape (`torch.autograd.grad`: returned, never
accumulated into `.grad`), which loads the backward's kernels.

Why the script's help: Leto knows the model but not its input.  `job.warmup(fn)` registers a
callable that runs one forward (`lambda: model(*sample())`, inside the script's own contexts:
`job.autocast()`, an attention backend).  It must run the module itself, never its DDP
wrapper or anything else that calls a collective: shadows wait at different times, and a
collective of one shadow's warm-up would wait for the others'.  Return what the forward
returns (the loss): the backward's warm-up starts from it.  A shadow at L3 calls it while it
waits, after the rehearsed update and the lending pool (`levels.ready_for_first_step`); an
active never does (its first step is its warm-up).

What it may touch: nothing retained.  Until `job.steps()` binds them after the promotion, the
parameters are placeholders (`modules.placeholders`: one zero element expanded to the shape),
so the forward reads zeros and writes only its own activations: under `torch.no_grad` the
first time, with gradients the second, whose backward returns gradients of placeholders and
writes no `.grad`.  What it could change is put back: every buffer's values (a module that
counts its calls, a norm's running statistics) and the CPU and CUDA random states.  Its memory
is capped (`cap_of`: `LETO_WARMUP_MIB`, else the room the agent's preinitialization controller
saw on the device, else DEFAULT_MIB; the caching allocator's per-process limit for the call: a
warm-up that needs more fails with an OOM here instead of taking memory the active needs) and given
back after (`empty_cache`); `job.autocast()` keeps no weight casts while it runs (a cast cache
would hold a low-precision copy of every weight at once).  A failure is logged; the first step
then pays what the warm-up would have, as without it.

Calling contract: `run(job) -> float | None` (seconds; None when nothing ran), from the
shadow's main thread, before the promotion; `job.warmup_backward` then says how far the
backward's warm-up went (`BACKWARD_*`) and `job.warmup_cap` (bytes, source) what it could take.
"""
from __future__ import annotations

import contextlib
import time

import torch

from leto_runtime.trainer_log import log


def run(job) -> float | None:
    fn = getattr(job, "warmup_fn", None)
    if fn is None or job.bound or getattr(job, "_warmed", False):
        return None
    job._warmed = True
    cap, source = cap_of(job)
    job.warmup_cap = (cap, source)
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
        try:
            with torch.no_grad():
                fn()
            if cuda:
                torch.cuda.synchronize(job.device)
        except Exception as e:
            log(f"warm-up forward failed before promotion under the cap of {cap >> 20} MiB "
                f"({source}){_held(job)} ({type(e).__name__}: {_short(e)}); the first step "
                "pays its first use")
            return None
        job.warmup_backward = _backward(job, fn, cap)
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
    took = time.monotonic() - t0
    log(f"warm-up: {job.warmup_backward} in {took:.2f} s under {cap >> 20} MiB ({source})")
    return took


DEFAULT_MIB = 1024                          # the cap without a setting or the agent's view


def cap_of(job) -> tuple[int, str]:
    """(bytes, where they come from) the warm-up may take: `LETO_WARMUP_MIB` when set; else
    the room the agent saw on the device when it started this shadow (`LETO_WARMUP_ROOM`: its
    free memory less the active's regrowth to its recent peak, its trend and the margin,
    `leto_run.preinit.warmup_room`); else DEFAULT_MIB (no view: CPU, or the job's first
    shadows, started before any active ran)."""
    from leto_runtime.wire import settings
    mib = settings.get().warmup_mib
    if mib is not None:
        return mib << 20, "LETO_WARMUP_MIB"
    room = getattr(getattr(job, "ctx", None), "warmup_room", None)
    if room is not None:
        return room, "the agent's view of the device"
    return DEFAULT_MIB << 20, "the default"


BACKWARD_FULL = "forward and backward"      # the script's forward with gradients, then backward
BACKWARD_ENGINE = "autograd engine only"    # the small product: thread, handle, workspace
BACKWARD_NONE = "none"                      # even the small product failed
PARAM_SHARE = 8                             # one parameter's gradient: at most cap / 8
PARAMS_SHARE = 4                            # all of them together: at most cap / 4
ERROR_CHARS = 1200                          # of a failure's text in the log line


def _backward(job, fn, cap: int) -> str:
    """The backward's first-use costs, as far as the cap allows (module docstring)."""
    autocast = getattr(job, "autocast", contextlib.nullcontext)
    try:
        with torch.enable_grad():
            a = torch.ones(64, 64, device=job.device, requires_grad=True)
            with autocast():
                y = (a @ a).float().sum()
            torch.autograd.grad(y, [a])
    except Exception as e:
        log(f"warm-up backward failed ({type(e).__name__}: {str(e)[:200]})")
        return BACKWARD_NONE
    params = one_per_shape(job.model, cap)
    if not params:
        return BACKWARD_ENGINE
    try:
        with torch.enable_grad():
            target = scalar_of(fn())
            if target is None:
                return BACKWARD_ENGINE
            torch.autograd.grad(target, params, allow_unused=True)
        if job.device.type == "cuda":
            torch.cuda.synchronize(job.device)
    except Exception as e:
        log(f"warm-up backward of the script's forward did not run under the cap of "
            f"{cap >> 20} MiB ({job.warmup_cap[1]}){_held(job)} ({type(e).__name__}: "
            f"{_short(e)}); the first backward pays its kernels' first use")
        return BACKWARD_ENGINE
    return BACKWARD_FULL


def _short(e: BaseException) -> str:
    """An exception's text on one line, long enough for an OOM's accounting (which names what
    the process and the other processes hold)."""
    return " ".join(str(e).split())[:ERROR_CHARS]


def _held(job) -> str:
    """What this process's caching allocator holds now (on CUDA), for a failure's log line."""
    if job.device.type != "cuda":
        return ""
    return (f" (this process: {torch.cuda.memory_allocated(job.device) >> 20} MiB allocated, "
            f"{torch.cuda.memory_reserved(job.device) >> 20} MiB reserved)")


def one_per_shape(model: torch.nn.Module, cap: int) -> list[torch.Tensor]:
    """One parameter that needs a gradient per (shape, dtype), each at most cap / PARAM_SHARE
    bytes and together at most cap / PARAMS_SHARE: the backward then runs every kind of
    weight-gradient product the model has, without a gradient for every parameter."""
    seen, out, total = set(), [], 0
    for p in model.parameters():
        key = (tuple(p.shape), p.dtype)
        size = p.numel() * p.element_size()
        if (not p.requires_grad or key in seen or size > cap // PARAM_SHARE
                or total + size > cap // PARAMS_SHARE):
            continue
        seen.add(key)
        out.append(p)
        total += size
    return out


def scalar_of(out) -> torch.Tensor | None:
    """What the backward starts from: the first scalar that needs a gradient in what the
    warm-up function returned (a loss), else the sum of the first such tensor."""
    found = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
    for t in found:
        if t.dim() == 0:
            return t.float()
    return found[0].float().sum() if found else None


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
