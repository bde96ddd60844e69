"""Checkpoints of the runtime state: `job.state_dict()` / `job.load_state_dict(sd)` and the
start step of `job.steps(n, start=k)`.

`state_dict()` is a dict of CPU copies, as `torch.distributed.checkpoint` and `torch.save`
take it: `model` (the model's `state_dict()`), `optimizer` (torch's format for the script's
optimizer, `AdoptedOptimizer.state_dict()`), `scheduler` (its `state_dict()` or None), `step`
(the next step to run).  Copies, not views: `dcp.load` writes into the tensors of the
template it is given, and a view would let a recovering trainer's load overwrite retained
state.  The format is the same under torchrun and leto-run, so a checkpoint written by either
resumes under the other.

`load_state_dict(sd)` keeps `sd` as the job's initial state; `apply(job)` writes it where the
first trainer would run `init(model, seed)` (`resume.initialize`): parameters and buffers,
the optimizer's moments (into the retained states, or into the torch optimizer under
torchrun), its groups' values, the scheduler.  A trainer that recovers in place has the
retained state, newer than any checkpoint: it ignores the load (one log line).

Calling contract: `load_state_dict` before `job.steps()`, after `job.optimizer(...)`; Adam's
per-parameter `step` must equal the checkpoint's `step` (one step count for all).
"""
from __future__ import annotations

import copy

import torch

from leto_runtime.trainer_log import log
from leto_runtime.errors import PortingError


def state_dict(job) -> dict:
    opt = job.opt
    if opt is None or not hasattr(opt, "torch_opt"):
        raise PortingError("job.state_dict() needs the optimizer of job.optimizer(...)")
    model = {k: v.detach().cpu().clone() for k, v in job.model.state_dict().items()}
    sched = opt.scheduler.state_dict() if opt.scheduler is not None else None
    return {"model": model, "optimizer": _complete(opt.state_dict(), opt), "scheduler": sched,
            "step": int(opt.done)}


def small_part(job) -> dict:
    """What a shadow's snapshot of the state (`leto_runtime.ckpt_snapshot`) needs beside the
    retained params and optimizer states: the state dict's keys, the buffers, the groups'
    values, the scheduler, the step."""
    opt = job.opt
    params = {k for k, _ in job.model.named_parameters(remove_duplicate=False)}
    sd = job.model.state_dict()
    return {"step": int(opt.done), "keys": list(sd),
            "buffers": {k: v.detach().cpu().clone() for k, v in sd.items() if k not in params},
            # deep copies: torch's state dicts share the live lists (a scheduler's base_lrs)
            "param_groups": copy.deepcopy(opt.torch_opt.state_dict()["param_groups"]),
            "scheduler": (copy.deepcopy(opt.scheduler.state_dict())
                          if opt.scheduler is not None else None)}


def assemble(job, small: dict, flats: list[torch.Tensor]) -> dict:
    """The shadow's `state_dict()`: the same dict as the active's, from `small` (the active's
    `small_part`) and `flats` (host copies of the retained model states, params first, each
    `layout.numel` long).  Views into `flats`, not copies (DCP copies what it writes)."""
    opt, P = job.opt, flats[0]
    slot = {s.name: s for s in job.layout.params}
    first: dict[int, str] = {}
    for n, p in job.model.named_parameters():
        first.setdefault(id(p), n)
    params = dict(job.model.named_parameters(remove_duplicate=False))
    model = {}
    for k in small["keys"]:
        if k in params:
            s = slot[first[id(params[k])]]
            model[k] = P[s.offset:s.offset + s.numel].view(s.shape)
        else:
            model[k] = small["buffers"][k]
    osd = {"state": optimizer_state(opt, flats[1:], small["step"], copy=False),
           "param_groups": small["param_groups"]}
    return {"model": model, "optimizer": _complete(osd, opt, copy=False),
            "scheduler": small["scheduler"], "step": int(small["step"])}


def retained_copy(job, small: dict) -> dict:
    """`job.state_dict()` as it was when `small` (`small_part`) was taken, on a trainer whose
    retained states nothing has written since: host copies of those, and `small`."""
    ss = job.ss
    return assemble(job, small, [ss.flat(st)[:ss.layout.numel].detach().to("cpu", copy=True)
                                 for st in ss.model])


def optimizer_state(opt, flats: list[torch.Tensor], done: int, copy: bool = True) -> dict:
    """torch's `state` of the adopted optimizer from the flat optimizer states (CPU copies
    when `copy`, else views of `flats`)."""
    state: dict = {}
    if done <= 0:
        return state
    for i, slot, h in opt.slots():
        entry = {}
        for k, n in enumerate(h.state_names):
            v = flats[k][slot.offset:slot.offset + slot.numel].view(slot.shape)
            entry[n] = v.detach().cpu().clone() if copy else v
        if h.kind in ("adam", "adamw"):
            entry = {"step": torch.tensor(float(done)), **entry}
        if entry:
            state[i] = entry
    return state


def _complete(osd: dict, opt, copy: bool = True) -> dict:
    """Every optimizer state entry present (zeros where torch has none yet, before the first
    step): `dcp.load` fills only the entries its template has."""
    for i, slot, h in opt.slots():
        entry = osd["state"].setdefault(i, {})
        if h.kind in ("adam", "adamw"):
            entry.setdefault("step", torch.tensor(0.0))
        for n in h.state_names:
            entry.setdefault(n, torch.zeros(slot.shape, dtype=torch.float32))
        if copy:
            osd["state"][i] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                               for k, v in entry.items()}
    return osd


def load(job, sd: dict) -> None:
    if job.opt is None or not hasattr(job.opt, "torch_opt"):
        raise PortingError("job.load_state_dict() comes after job.optimizer(...), before "
                           "job.steps()")
    missing = {"model", "optimizer", "scheduler", "step"} - set(sd)
    if missing:
        raise PortingError(f"not a job.state_dict(): it lacks {sorted(missing)}")
    k = int(sd["step"])
    for i, st in sd["optimizer"].get("state", {}).items():
        if "step" in st and float(st["step"]) != float(k):
            raise PortingError(f"optimizer state {i} has step {float(st['step'])}, the checkpoint "
                             f"step {k}: Leto keeps one step count for every parameter")
    job.loaded = sd


def apply(job) -> None:
    """The first trainer writes the loaded checkpoint (instead of `init`)."""
    sd, opt = job.loaded, job.opt
    with torch.no_grad():
        own = job.model.state_dict()
        for name, v in sd["model"].items():
            if name not in own:
                raise PortingError(f"the checkpoint's model has {name!r}, the model does not")
            own[name].copy_(v)
    osd = sd["optimizer"]
    if opt.rmu:
        flats = [job.ss.flat(st) for st in job.ss.model[1:]]
        for i, slot, h in opt.slots():
            entry = osd["state"].get(i, osd["state"].get(str(i), {}))
            for k, n in enumerate(h.state_names):
                if n in entry:
                    flats[k][slot.offset:slot.offset + slot.numel].copy_(
                        entry[n].reshape(-1).to(flats[k].device))
        apply_values(job)
    elif int(sd["step"]) > 0:
        opt.torch_opt.load_state_dict(osd)
        _scheduler(job)
    else:           # before the first step torch has no state (SGD's first step copies)
        apply_values(job)
    opt.done = int(sd["step"])


def apply_values(job) -> None:
    """The checkpoint's group values (lr, betas, ...) and scheduler state, not its tensors:
    also what a trainer that recovers at the job's first step, before any record, takes."""
    osd = job.loaded["optimizer"]
    job.opt.torch_opt.load_state_dict({"state": {}, "param_groups": osd["param_groups"]})
    _scheduler(job)


def _scheduler(job) -> None:
    sd, opt = job.loaded, job.opt
    if opt.scheduler is not None and sd["scheduler"] is not None:
        opt.scheduler.load_state_dict(sd["scheduler"])


def ignored(job) -> None:
    if job.loaded is not None:
        log(f"the checkpoint of step {job.loaded['step']} given to load_state_dict() is not "
            "used: this trainer resumes from the retained state, which is newer")
