"""Reading a stock torch optimizer into the Resumable Model Updater's terms.

Role: the one place that knows torch.optim's param_groups.  `describe` turns an optimizer into
one `rmu.chunk_math.Hyper` per parameter group, or refuses it with an `UnsupportedOptimizer`
that names the option and the fix; `ordered_params` gives the parameters in the order the
updater lays them out; `set_group_values` writes a resumed step's values back.  Pure: it reads
and writes Python objects only (no processes, no I/O, no tensor math).

Calling contract: call `describe(opt, device)` when the job takes the optimizer over and again
before every step (a scheduler may have changed lr in between); the list it returns is that
step's input to `chunk_math.update_chunk_`.  Each refusal is a small `check_*` function returning
None or the message, so a caller (or a test) can ask one question at a time.

Supported: exactly torch.optim.AdamW, torch.optim.Adam (L2 decay, or decoupled_weight_decay=True:
AdamW's math) and torch.optim.SGD, with float lr/betas, float32 dense real parameters, and the
options whose single-tensor bits chunk_math reproduces (see check_group).
"""
from __future__ import annotations

import torch
from torch import Tensor

from leto_runtime.errors import ScriptError
from leto_runtime.rmu.chunk_math import Hyper

__all__ = ["UnsupportedOptimizer", "SUPPORTED", "describe", "ordered_params", "set_group_values",
           "check_type", "check_hooks", "check_device", "check_group", "check_params",
           "check_amsgrad", "check_capturable", "check_differentiable", "check_fused",
           "check_foreach", "check_tensor_values"]

SUPPORTED = "torch.optim.AdamW, torch.optim.Adam and torch.optim.SGD"
_WHY_NOT = ("Leto updates optimizer state chunk by chunk, which is exact only for updates that are "
            "element-wise per parameter element (Muon, Shampoo and other matrix-wise optimizers are "
            "not), and only for optimizers whose math Leto reproduces bit for bit (others are not "
            "implemented)")


class UnsupportedOptimizer(ScriptError, ValueError):
    """The optimizer (or one of its options) cannot be taken over; the message says why and how."""


def check_type(opt) -> str | None:
    """Exact types only: a subclass may override step() with math Leto would not run."""
    t = type(opt)
    if t in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        return None
    name = f"{t.__module__}.{t.__qualname__}"
    if isinstance(opt, (torch.optim.Adam, torch.optim.SGD)):
        return (f"{name} is a subclass of a supported optimizer; Leto supports exactly {SUPPORTED} "
                "(not subclasses: a subclass may change step(), which Leto replaces). "
                "Use the torch class itself")
    return f"{name} is not supported; Leto supports {SUPPORTED}. {_WHY_NOT}"


def check_hooks(opt) -> str | None:
    """Step hooks run around opt.step(), which Leto replaces: they would silently not run."""
    from torch.optim import optimizer as _o

    found = [what for what, hooks in (
        ("a step pre-hook on this optimizer (register_step_pre_hook)",
         getattr(opt, "_optimizer_step_pre_hooks", None)),
        ("a step post-hook on this optimizer (register_step_post_hook)",
         getattr(opt, "_optimizer_step_post_hooks", None)),
        ("a global step pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook)",
         getattr(_o, "_global_optimizer_pre_hooks", None)),
        ("a global step post-hook (torch.optim.optimizer.register_optimizer_step_post_hook)",
         getattr(_o, "_global_optimizer_post_hooks", None))) if hooks]
    if not found:
        return None
    return (f"optimizer step hooks are registered: {'; '.join(found)}. Leto replaces opt.step(), "
            "so they would not run; remove them (handle.remove()) and do their work in the "
            "training loop")


def check_device(device) -> str | None:
    dev = torch.device(device)
    if dev.type in ("cpu", "cuda"):
        return None
    return f"device {dev} is not supported: Leto updates optimizer state on CPU or CUDA only"


def check_amsgrad(group: dict) -> str | None:
    if group.get("amsgrad", False):
        return ("amsgrad=True is not supported (Leto does not keep max_exp_avg_sq); "
                "pass amsgrad=False")
    return None


def check_capturable(group: dict) -> str | None:
    if group.get("capturable", False):
        return ("capturable=True is not supported (its tensor step and bias corrections give "
                "other bits); pass capturable=False")
    return None


def check_differentiable(group: dict) -> str | None:
    if group.get("differentiable", False):
        return ("differentiable=True is not supported (Leto's update is not part of an autograd "
                "graph); pass differentiable=False")
    return None


def check_fused(group: dict) -> str | None:
    if group.get("fused", None):
        return ("fused=True is not supported (the fused kernel gives other bits than the "
                "single-tensor math Leto reproduces); pass fused=False")
    return None


def check_foreach(group: dict, device) -> str | None:
    """On CPU torch's foreach ops run the single-tensor kernels (same bits); on CUDA its
    multi-tensor kernels compute other bits, and foreach=None (the default) picks them there."""
    foreach = group.get("foreach", None)
    if torch.device(device).type != "cuda" or foreach is False:
        return None
    how = "foreach=True" if foreach else "foreach=None (the default, which picks foreach on CUDA)"
    return (f"{how} is not supported on CUDA: torch's multi-tensor (foreach) spelling gives "
            "different bits than the single-tensor math Leto reproduces; pass foreach=False")


def check_tensor_values(group: dict) -> str | None:
    """Tensor lr/betas/weight_decay: Leto's math takes Python doubles, as torch's float path."""
    names = [k for k in ("lr", "eps", "weight_decay", "momentum", "dampening")
             if isinstance(group.get(k), Tensor)]
    names += [f"betas[{i}]" for i, b in enumerate(group.get("betas", ())) if isinstance(b, Tensor)]
    if not names:
        return None
    return (f"a Tensor {', '.join(names)} is not supported; pass Python floats "
            "(e.g. lr=3e-4, betas=(0.9, 0.95))")


def check_params(group: dict, device) -> str | None:
    dev = torch.device(device)
    for j, p in enumerate(group["params"]):
        where = f"params[{j}] (shape {tuple(p.shape)})"
        if p.is_sparse or p.layout != torch.strided:
            return f"{where} is sparse ({p.layout}); only dense (strided) parameters are supported"
        if p.is_complex():
            return f"{where} is complex ({p.dtype}); only real float32 parameters are supported"
        if p.dtype != torch.float32:
            return (f"{where} is {p.dtype}; float32 parameters are supported (for bf16 compute, "
                    "keep float32 parameters and use torch.autocast)")
        if p.grad is not None and (p.grad.is_sparse or p.grad.layout != torch.strided):
            return (f"{where} has a sparse gradient ({p.grad.layout}); only dense gradients are "
                    "supported (e.g. nn.Embedding(..., sparse=False))")
        if p.device.type != dev.type or (dev.index is not None and p.device != dev):
            return f"{where} is on {p.device}, not on the job's device {dev}"
    return None


def check_group(group: dict, device) -> str | None:
    """Every per-group refusal, first one found."""
    for check in (check_amsgrad, check_capturable, check_differentiable, check_fused,
                  check_tensor_values):
        msg = check(group)
        if msg:
            return msg
    return check_foreach(group, device) or check_params(group, device)


def _kind(opt, group: dict) -> str:
    if type(opt) is torch.optim.SGD:
        return "sgd"
    # Adam and AdamW share one step() in this torch: the group flag decides the decay.
    default = type(opt) is torch.optim.AdamW
    return "adamw" if group.get("decoupled_weight_decay", default) else "adam"


def _hyper(kind: str, group: dict) -> Hyper:
    common = dict(kind=kind, lr=group["lr"], weight_decay=group["weight_decay"],
                  maximize=group.get("maximize", False))
    if kind == "sgd":
        return Hyper(**common, momentum=group["momentum"], dampening=group["dampening"],
                     nesterov=group["nesterov"])
    beta1, beta2 = group["betas"]
    return Hyper(**common, beta1=beta1, beta2=beta2, eps=group["eps"])


def describe(opt, device) -> list[Hyper]:
    """One Hyper per opt.param_groups entry, from the groups' current values, or
    UnsupportedOptimizer with the first refusal (its message names the option and the fix)."""
    msg = check_type(opt) or check_hooks(opt) or check_device(device)
    if msg:
        raise UnsupportedOptimizer(msg)
    ordered_params(opt)  # duplicates refused
    out = []
    for i, group in enumerate(opt.param_groups):
        msg = check_group(group, device)
        if msg:
            raise UnsupportedOptimizer(f"param_groups[{i}]: {msg}")
        try:
            out.append(_hyper(_kind(opt, group), group))
        except ValueError as e:  # e.g. a negative weight_decay set after construction
            raise UnsupportedOptimizer(f"param_groups[{i}]: {e}") from None
    return out


def ordered_params(opt) -> list[list[Tensor]]:
    """The parameters of each group, in param_groups order; a parameter in two groups (or twice
    in one) is refused, as torch's add_param_group does."""
    seen: dict[int, tuple[int, int]] = {}
    out = []
    for i, group in enumerate(opt.param_groups):
        params = list(group["params"])
        for j, p in enumerate(params):
            if id(p) in seen:
                a, b = seen[id(p)]
                raise UnsupportedOptimizer(
                    f"param_groups[{i}]['params'][{j}] is also param_groups[{a}]['params'][{b}]; "
                    "a parameter must appear in exactly one group")
            seen[id(p)] = (i, j)
        out.append(params)
    return out


def set_group_values(opt, hypers: list[Hyper]) -> None:
    """Write each Hyper's values into its param group (to restore a resumed step's lr etc.).
    The kinds must be those describe() reads from the optimizer."""
    if len(hypers) != len(opt.param_groups):
        raise ValueError(f"set_group_values: {len(hypers)} Hyper values for "
                         f"{len(opt.param_groups)} param groups")
    for i, (group, h) in enumerate(zip(opt.param_groups, hypers)):
        if not isinstance(h, Hyper):
            raise ValueError(f"set_group_values: hypers[{i}] is {type(h).__name__}, not a Hyper")
        kind = _kind(opt, group)
        if h.kind != kind:
            raise ValueError(f"set_group_values: hypers[{i}].kind={h.kind!r} but param_groups[{i}] "
                             f"of {type(opt).__name__} is {kind!r}")
    for group, h in zip(opt.param_groups, hypers):
        values = dict(lr=h.lr, weight_decay=h.weight_decay, maximize=h.maximize)
        if h.kind == "sgd":
            values.update(momentum=h.momentum, dampening=h.dampening, nesterov=h.nesterov)
        else:
            values.update(betas=(h.beta1, h.beta2), eps=h.eps)
        # Only what differs is written: an equal value keeps the script's own object (an int
        # 0 stays an int), so the group reads -- and `state_dict()` saves -- as it did.
        for k, v in values.items():
            if k not in group or group[k] != v:
                group[k] = type(group[k])(v) if k == "betas" and k in group else v
