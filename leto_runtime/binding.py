"""Binding a job's model to its states: layout, allocation or attach, views, fault hooks.

Role: what happens between `job.retain(model)` and the first step.  `retain` only checks the
model and records it; the states are opened when the optimizer is known
(`job.adamw` / `job.optimizer`), because the layout follows the optimizer's parameter groups:
each group's parameters are contiguous (one element range, one set of hyper-parameters per
range), frozen parameters come after every group (retained, protected, never updated).

* `order(model, groups)` — the (name, shape) list of the layout: the groups' parameters in
  `param_groups` order, then the frozen ones; a trainable parameter in no group is refused.
* `materialize(job, client, attach_only)` — open (first trainer) or attach the states (and
  re-bind the views if they were bound).
* `bind_views(job)` — at `job.steps()`: every parameter *object* stays the one the script
  holds (its torch optimizer and DDP keep working), only its `.data` becomes a view of the
  retained params and its `.grad` a view of the retained gradients (frozen: no gradient).
  Until then the parameters are placeholders (`modules.placeholders`).
* `preattach(job)` (a waiting shadow) and `attach_at_promotion(job)` (a promoted one);
  `states_watch(job)`: for a shadow that was ready before its active made the states, a
  check that they exist now (it then pre-attaches while it waits, not at promotion).
* `install_hooks(job)` — the forward / backward fault points.

Calling contract: functions over a `leto_runtime.job.Job` whose `model` is set; the job's
`opt` (if any) is re-bound after every materialization (`opt._bind()`).
"""
from __future__ import annotations

import time
import weakref

import torch

from leto_runtime import modules
from leto_runtime.rmu.states import (GRADS, MARKER, MODEL, QBUF, UNDO, Geometry, Layout,
                                     open_states, pick_chunk_pages)
from leto_runtime.trainer_log import log
from leto_runtime.wire.geometry import of_pool
from leto_runtime.errors import PortingError

DEFAULT_GEOMETRY = Geometry()


def order(model: torch.nn.Module, groups: list[list[torch.Tensor]] | None = None):
    """(name, shape) of every distinct parameter in layout order (see the module doc)."""
    names = {}
    for n, p in model.named_parameters():     # one (first) name per tensor: ties once
        names.setdefault(id(p), (n, p))
    if groups is None:
        return [(n, tuple(p.shape)) for n, p in names.values()]
    out, seen = [], set()
    for k, params in enumerate(groups):
        for p in params:
            if not p.requires_grad:
                continue            # torch skips it (no gradient): laid out with the frozen
            if id(p) not in names:
                raise PortingError(f"param_groups[{k}] holds a tensor of shape {tuple(p.shape)} "
                                 "that is not a parameter of the retained model: build the "
                                 "optimizer over the model job.retain() returned")
            seen.add(id(p))
            out.append((names[id(p)][0], tuple(p.shape)))
    for n, p in names.values():
        if id(p) in seen:
            continue
        if p.requires_grad:
            raise PortingError(f"parameter {n!r} requires grad but is in no param group of the "
                             "optimizer: add it to a group, or freeze it (requires_grad_(False))")
        out.append((n, tuple(p.shape)))
    return out


def geometry(client) -> Geometry:
    # the pool's groups, with its device pages (the state manager rounds S up to granules)
    return DEFAULT_GEOMETRY if client is None else of_pool(client.info)


def materialize(job, client=None, attach_only: bool = False) -> None:
    t0 = time.monotonic()
    if job.inplace and client is None:
        from leto_runtime.rmp.client import RmpClient
        client = RmpClient(job.ctx.sm_socket, timeout=job.ctx.pg_timeout)
    geo = geometry(client)
    job.layout = Layout.of(order(job.model, job.param_order), geo.page_bytes)
    chunk = pick_chunk_pages(job.ctx.chunk_pages, geo)
    job.ss = open_states(job.layout, client=client, geo=geo, device=str(job.device),
                         chunk_pages=chunk, attach_only=attach_only)
    if job.bound:
        bind_views(job)
    if job.opt is not None:
        if job.updater is not None:
            job.updater.close()      # its lending pool's regions are the old mappings
        job.opt._bind()
    job.recovery_info["attach_s"] = time.monotonic() - t0


def bind_views(job) -> None:
    """The parameters become views of the states (`job.steps()` does it, after promotion and
    before recovery: until then they are placeholders, so nothing the script or DDP's
    constructor does can write into retained state), buffers are filled, hooks installed."""
    job.layout.bind(job.model, job.ss.flat(job.ss.model[0]), job.ss.flat(job.ss.grads))
    job._grad_views = {id(p): p.grad.data_ptr() for p in job.model.parameters()
                       if p.grad is not None}
    modules.materialize_buffers(job.model, job.device)
    if job.buffers_fn is not None:
        job.buffers_fn(job.model)
    job.buffer_watch = modules.BufferWatch(job.model)
    install_hooks(job)
    job.bound = True


STATES = frozenset({*MODEL, GRADS, MARKER, UNDO, QBUF})


def preattach(job) -> None:
    """Shadow: map the retained states now, while waiting (issue: "the retained state mapped
    but never written"), so that promotion only refreshes what changed since.  Skipped when
    the active has not created them yet (`job.states_absent` is then set: the wait watches
    for them, `states_watch`), or, with attach at promotion, when mapping fails."""
    from leto_runtime.rmp.client import RmpClient
    t0 = time.monotonic()
    client = None
    try:
        client = RmpClient(job.ctx.sm_socket, timeout=job.ctx.pg_timeout)
        have = {s["name"] for s in client.list()}
        job.states_absent = not STATES <= have
        if job.states_absent:
            client.close()
            return
        materialize(job, client=client, attach_only=True)
    except Exception as e:
        log(f"pre-attach skipped ({type(e).__name__}: {e}); attaching at promotion")
        job.ss = None
        if client is not None:
            try:
                client.close(unmap=True, timeout=1.0)
            except Exception:
                pass
        return
    job.recovery_info["preattach_s"] = time.monotonic() - t0
    warm_localization(job)


def states_watch(job, timeout: float = 0.5):
    """A waiting shadow whose pre-attach found no states (it was ready before its active made
    them: a fast shadow beside a large model's initialization): a predicate for
    `promotion.wait_for_promotion(until=...)`, true once every retained state exists, so
    that the shadow pre-attaches while it waits instead of attaching at promotion (a second
    of a 1B model's first recovery).  None when there is nothing to watch for.  A state
    manager that does not answer within `timeout` reads as "not yet" (a short bound: the check
    runs between the wait's slices, so it must not delay a promotion); the wait goes on as
    without the watch."""
    if job.ss is not None or not getattr(job, "states_absent", False):
        return None
    from leto_runtime.rmp.client import RmpClient
    client = None

    def made() -> bool:
        nonlocal client
        try:
            if client is None:
                client = RmpClient(job.ctx.sm_socket, timeout=timeout, connect_timeout=timeout)
            if not STATES <= {s["name"] for s in client.list()}:
                return False
        except Exception:
            return False
        try:
            client.close(unmap=False)
        except Exception:
            pass
        return True
    return made


def warm_localization(job) -> None:
    """Shadow, pre-attached: resolve the device-page probe and the reconstruction kernels now
    (the first use loads the CUDA parity extension: a compiler-identity check and a dlopen) and
    run the probe once over the mapped pages, so that the promoted trainer's localization is
    the probe alone.  What this probe finds is discarded: only the one after the failure
    counts.  A failure here is logged; localization then loads what it needs itself."""
    from leto_runtime.rmp.reconstruct import prepare_kernels
    t0 = time.monotonic()
    try:
        for st in job.ss.client.states.values():
            if st.tier == "device" and st.mapped and st.device.startswith("cuda"):
                st.probe()
                prepare_kernels(st)
    except Exception as e:
        log(f"localization not warmed before promotion ({type(e).__name__}: {e})")
        return
    job.recovery_info["warm_localize_s"] = time.monotonic() - t0


def attach_at_promotion(job) -> dict:
    """Promoted shadow: bring the pre-attached mappings up to date (one round trip plus the
    changed pages), or attach now.  Returns the attach phase's fields."""
    if job.ss is None:
        materialize(job)
        return {"preattached": False}
    t0 = time.monotonic()
    rep = job.ss.client.refresh()
    # a state re-created under its name (seen here, or by the snapshot's refresh): map afresh
    if rep.views_invalid or job.recovery_info.pop("stale_views", False):
        old = job.ss.client
        materialize(job)
        try:
            old.close(unmap=True, timeout=1.0)
        except Exception:
            pass
    job.recovery_info["attach_s"] = time.monotonic() - t0
    return {"preattached": True, "changed_pages": sum(rep.changed.values()),
            "dropped_pages": sum(rep.dropped.values()), "remapped": bool(rep.views_invalid)}


def install_hooks(job) -> None:
    """Fault points in forward and backward (trainable parameters only: a frozen one never
    gets a gradient).  The hooks hold the job weakly: a tensor's hooks are held from C++,
    where the garbage collector cannot see a cycle through them, so a strong reference would
    keep every job (and its states) alive for good."""
    for h in job._hooks:
        h.remove()
    from torch.nn.parallel import DistributedDataParallel as DDP
    me = weakref.ref(job)

    def fwd(mod, args):
        j = me()
        if j is not None:
            ddp = DDP._get_active_ddp_module()
            j.note_forward(ddp if ddp is not None and ddp.module is mod else None)
            j.faults.fire("forward", step=j.step_t)

    fired = {"t": None}

    def bwd(param):
        j = me()
        if j is None:
            return
        j._grads_seen.add(id(param))
        if fired["t"] != j.step_t:
            fired["t"] = j.step_t
            j.faults.fire("backward", step=j.step_t)

    job._hooks = [job.model.register_forward_pre_hook(fwd)]
    job._hooks += [p.register_post_accumulate_grad_hook(bwd) for p in job.model.parameters()
                   if p.requires_grad]
